"""The streamed disaggregated flow against fake pods that speak the resume annotations: a prefill pod that
dies right after its first token reached the client (its KV hold gone with it) leaves a stream that a
decode pod continues from what the client holds, computing the prompt itself: no error reaches the client."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from tokenfleet.runtime.openai import kv_transfer as wire
from tokenfleet.runtime.openai.resume import CONTINUATION_FIELD, Progress, StreamStart

START = StreamStart("cmpl-1", 1_700_000_000, [5, 6, 7], True)


def _event(annotations: bytes, text: str, finish: str | None = None, usage: dict | None = None) -> bytes:
    chunk: dict = {
        "id": START.id,
        "object": "text_completion",
        "created": START.created,
        "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }
    if usage:
        chunk["usage"] = usage
    return annotations + b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def prefill_then_die(request: web.Request) -> web.StreamResponse:
    """A prefill pod streams its first token, annotated, then its process dies: no finish, no [DONE]."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", wire.HOLD_HEADER: "hold-1"})
    await resp.prepare(request)
    await resp.write(_event(START.encode() + Progress([10], 3).encode(), "w10"))
    await asyncio.sleep(0.3)  # the token reaches the router, and so the client, before the pod dies
    request.transport.close()
    return resp


def continue_stream(requests: list[dict]):
    """A decode pod continuing a stream: two more tokens, then the end."""

    async def generate(request: web.Request) -> web.StreamResponse:
        requests.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(START.encode() + b"\n")
        await resp.write(_event(Progress([11], 7).encode(), " w11"))
        usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        await resp.write(_event(Progress([12], 11).encode(), " w12", "length", usage))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return generate


async def test_a_prefill_pod_dying_after_its_first_token_is_continued_on_a_decode_pod(
    serve_app, start_router, make_pod
):
    prefill, decode, continuations = make_pod(), make_pod(), []
    prefill.generate, decode.generate = prefill_then_die, continue_stream(continuations)
    async with serve_app(prefill.app()) as p_url, serve_app(decode.app()) as d_url:
        backends = [
            {"name": "p", "model": "m", "url": p_url, "role": "prefill"},
            {"name": "d", "model": "m", "url": d_url, "role": "decode"},
        ]
        async with start_router(backends) as (url, _), aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "w1 w2 w3", "max_tokens": 3, "stream": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                raw = (await r.read()).decode()
    events = [b[len("data: ") :] for b in raw.split("\n\n") if b.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, raw
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], raw
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == "w10 w11 w12"
    assert ": tokenfleet" not in raw  # annotations never reach the client
    (sent,) = continuations
    # What the client holds, and no hold to fetch: the prefill pod is gone with it.
    assert sent[CONTINUATION_FIELD]["output_token_ids"] == [10]
    assert sent[CONTINUATION_FIELD]["num_delivered_chars"] == 3
    assert wire.FIELD not in sent
