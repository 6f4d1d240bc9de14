"""Resumed streams against fake pods that speak the resume annotations (runtime/openai/resume.py).

- Disaggregated: a prefill pod that dies right after its first token reached the client (its KV hold gone
  with it) leaves a stream that a decode pod continues from what the client holds, computing the prompt
  itself.
- A stream that breaks when no other pod is in rotation (a rollout's new pod still loading, a lost node's
  replacement starting) is held, as a queued request would be, and continued on the first pod that comes
  in.
Either way the client sees one whole stream, never an error event."""

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


def one_token_then_die(pod, headers: dict[str, str] | None = None):
    """The pod streams its first token, annotated, then its process dies: no finish, no [DONE]."""

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **(headers or {})})
        await resp.prepare(request)
        await resp.write(_event(START.encode() + Progress([10], 3).encode(), "w10"))
        await asyncio.sleep(0.3)  # the token reaches the client before the pod dies
        pod.loading = True  # restarted: loading its model again, out of rotation
        request.transport.close()
        return resp

    return generate


def continue_stream(requests: list[dict]):
    """A pod continuing a stream (decode, or any pod on a resume): two more tokens, then the end."""

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
    # The prefill pod names its KV hold, then dies with it.
    prefill.generate = one_token_then_die(prefill, {wire.HOLD_HEADER: "hold-1"})
    decode.generate = continue_stream(continuations)
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


async def test_a_broken_stream_waits_for_a_pod_to_come_into_rotation(serve_app, start_router, make_pod):
    first, second, continuations = make_pod(), make_pod(), []
    first.generate, second.generate = one_token_then_die(first), continue_stream(continuations)
    second.loading = True  # not in rotation yet: /load answers 503, as a pod loading its model does
    async with serve_app(first.app()) as a_url, serve_app(second.app()) as b_url:
        backends = [{"name": "a", "model": "m", "url": a_url}, {"name": "b", "model": "m", "url": b_url}]
        routing = {"queueTimeoutSeconds": 10}
        async with (
            start_router(backends, routing, {"failureThreshold": 1}, wait_ready=False) as (url, router),
            aiohttp.ClientSession() as s,
        ):
            fleet = router.fleet
            deadline = asyncio.get_running_loop().time() + 5
            while not any(fleet.available(ep) and ep.url == a_url for ep in fleet.endpoints.by_id.values()):
                assert asyncio.get_running_loop().time() < deadline, "the first pod never came into rotation"
                await asyncio.sleep(0.02)

            async def ready_later() -> None:
                await asyncio.sleep(1.0)  # well after the break: the stream must have waited
                second.loading = False

            later = asyncio.create_task(ready_later())
            body = {"model": "m", "prompt": "w1 w2 w3", "max_tokens": 3, "stream": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers["x-tokenfleet-endpoint"] == a_url
                raw = (await r.read()).decode()
            await later
    events = [b[len("data: ") :] for b in raw.split("\n\n") if b.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, raw
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], raw
    assert "".join(c["choices"][0]["text"] for c in chunks) == "w10 w11 w12"
    (sent,) = continuations
    assert sent[CONTINUATION_FIELD]["output_token_ids"] == [10]
