"""The router's stream splicing, against small aiohttp pods that speak the resume wire on loopback.

A `WirePod` "generates" token i as the text ` w{100+i}`, annotates its stream as a real pod does and
honours continuations; it can die (the connection drops), or hand the stream back, after some events.
What a client sees is checked: one id, the whole text once, the usage of the whole completion, a single
`[DONE]`; and the bounds: at most `maxResumes` continuations, and a stream the pod called not resumable
ends with an error event that says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web
from tokenfleet.runtime.openai.resume import (
    CONTINUATION_FIELD,
    HANDOFF,
    RESUME_HEADER,
    RESUME_STREAM,
    RESUME_WHOLE,
    Progress,
    StreamStart,
)

CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=20)
PROMPT_IDS = [1, 2, 3]


def full_text(n: int) -> str:
    return "".join(f" w{100 + i}" for i in range(n))


@pytest.fixture
def make_wire_pod(make_pod):
    base = type(make_pod())

    class WirePod(base):
        def __init__(self, model, tokenizer, *, die_after=None, handoff_after=None, why_not=None):
            super().__init__(model, tokenizer)
            self.die_after = die_after  # events this pod sends before its connection drops
            self.handoff_after = handoff_after  # ... before it hands the stream back
            self.why_not = why_not  # the stream cannot be resumed, for this reason
            self.delay_between = 0.0  # seconds between events
            self.payloads: list[dict] = []
            self.headers: list[dict] = []

        async def generate(self, request: web.Request) -> web.StreamResponse:
            payload = await request.json()
            self.payloads.append(payload)
            self.headers.append(dict(request.headers))
            asked = request.headers.get(RESUME_HEADER)
            annotate = asked in (RESUME_STREAM, RESUME_WHOLE)
            max_tokens = payload["max_tokens"]
            if not payload.get("stream") and asked != RESUME_WHOLE:
                body = {
                    "id": "cmpl-whole",
                    "object": "text_completion",
                    "created": 1,
                    "model": self.model,
                    "choices": [{"index": 0, "text": full_text(max_tokens), "finish_reason": "length"}],
                    "usage": {
                        "prompt_tokens": 3,
                        "completion_tokens": max_tokens,
                        "total_tokens": 3 + max_tokens,
                    },
                }
                return web.json_response(body)
            usage = asked == RESUME_WHOLE or (payload.get("stream_options") or {}).get("include_usage")
            cont = payload.get(CONTINUATION_FIELD)
            rid = cont["id"] if cont else f"cmpl-{request.url.port}"
            created = cont["created"] if cont else 1000 + len(self.payloads)
            first = len(cont["output_token_ids"]) if cont else 0
            chars = cont["num_delivered_chars"] if cont else 0
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            head = StreamStart(rid, created, PROMPT_IDS, self.why_not is None, self.why_not).encode()
            head = head if annotate else b""
            for sent, i in enumerate(range(first, max_tokens)):
                if sent == self.die_after:
                    await asyncio.sleep(0.05)  # let the events reach the router, as on a real network
                    request.transport.close()
                    return resp
                if sent == self.handoff_after:
                    await resp.write(HANDOFF)
                    await resp.write_eof()
                    return resp
                text = f" w{100 + i}"
                chars += len(text)
                cached = 2 if cont and sent == 0 else None
                progress = Progress([100 + i], chars, cached).encode() if annotate else b""
                choice = {
                    "index": 0,
                    "text": text,
                    "finish_reason": "length" if i == max_tokens - 1 else None,
                }
                event = {"id": rid, "object": "text_completion", "created": created, "model": self.model}
                event["choices"] = [choice]
                await resp.write(head + progress + b"data: " + json.dumps(event).encode() + b"\n\n")
                head = b""
                await asyncio.sleep(self.delay_between)
            if usage:
                event = {"id": rid, "object": "text_completion", "created": created, "model": self.model}
                event |= {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": max_tokens}}
                event["usage"]["total_tokens"] = 3 + max_tokens
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

    return lambda **kw: WirePod("m", make_pod().tokenizer, **kw)


@contextlib.asynccontextmanager
async def fleet(serve_app, start_router, free_ports, pods, **retries):
    """The pods on ascending ports (round-robin tries them in that order) behind a router."""
    ports = sorted(free_ports(len(pods)))
    async with contextlib.AsyncExitStack() as stack:
        urls = [
            await stack.enter_async_context(serve_app(p.app(), port))
            for p, port in zip(pods, ports, strict=True)
        ]
        backends = [{"name": f"p{i}", "model": "m", "url": u} for i, u in enumerate(urls)]
        routing = {"strategy": "round-robin", "retries": {"maxResumes": 2, **retries}}
        yield await stack.enter_async_context(
            start_router(backends, routing, discovery={"probeIntervalSeconds": 30})
        )


def body(**kw) -> dict:
    return {"model": "m", "prompt": "w1 w2 w3", "max_tokens": 8, **kw}


async def stream(url: str, payload: dict) -> tuple[dict, bytes]:
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
        s.post(url + "/v1/completions", json={**payload, "stream": True}) as r,
    ):
        assert r.status == 200
        return dict(r.headers), await r.read()


def events(raw: bytes) -> list:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), f"not for a client: {block!r}"
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def client_view(raw: bytes) -> tuple[set[str], str, dict | None, int]:
    evs = events(raw)
    chunks = [e for e in evs if isinstance(e, dict) and "error" not in e]
    text = "".join(c["text"] for e in chunks for c in e["choices"])
    usage = next((e["usage"] for e in chunks if e.get("usage")), None)
    assert evs[-1] == "[DONE]"
    return {e["id"] for e in chunks}, text, usage, evs.count("[DONE]")


async def test_a_stream_whose_pod_dies_is_continued_on_another(
    serve_app, start_router, free_ports, make_wire_pod
):
    dying, healthy = make_wire_pod(die_after=3), make_wire_pod()
    async with fleet(serve_app, start_router, free_ports, [dying, healthy]) as (url, router):
        _, raw = await stream(url, body(stream_options={"include_usage": True}))
    ids, text, usage, num_done = client_view(raw)
    assert text == full_text(8) and num_done == 1
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert usage == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    # The continuation carried what the client held: the prompt ids, three tokens and their text.
    (cont,) = [p[CONTINUATION_FIELD] for p in healthy.payloads]
    assert cont["prompt_token_ids"] == PROMPT_IDS and cont["output_token_ids"] == [100, 101, 102]
    assert cont["num_delivered_chars"] == len(full_text(3))
    assert router.metrics.resumes._value.get() == 1
    assert router.metrics.resume_recomputed_tokens._value.get() == 3 + 3 - 2  # 2 were cached there
    assert router.metrics.stream_errors._value.get() == 0


async def test_resumes_are_bounded_then_the_error_event_says_so(
    serve_app, start_router, free_ports, make_wire_pod
):
    pods = [make_wire_pod(die_after=2) for _ in range(3)]
    async with fleet(serve_app, start_router, free_ports, pods, maxResumes=1) as (url, router):
        _, raw = await stream(url, body())
    evs = events(raw)
    assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
    error = evs[-2]["error"]
    assert error["code"] == "stream_interrupted" and "maxResumes" in error["message"]
    text = "".join(c["text"] for e in evs[:-2] for c in e["choices"])
    assert text == full_text(4)  # two events from each pod, nothing repeated
    assert router.metrics.resumes._value.get() == 1
    assert sum(len(p.payloads) for p in pods) == 2  # the request and one continuation


async def test_a_stream_that_cannot_be_resumed_says_why(serve_app, start_router, free_ports, make_wire_pod):
    dying = make_wire_pod(die_after=2, why_not="requests with several choices cannot be resumed")
    other = make_wire_pod()
    async with fleet(serve_app, start_router, free_ports, [dying, other]) as (url, router):
        _, raw = await stream(url, body())
    error = events(raw)[-2]["error"]
    assert "several choices" in error["message"]
    assert other.payloads == [] and router.metrics.resumes._value.get() == 0


async def test_a_handed_back_stream_continues_and_the_pod_stays_healthy(
    serve_app, start_router, free_ports, make_wire_pod
):
    draining, other = make_wire_pod(handoff_after=4), make_wire_pod()
    async with fleet(serve_app, start_router, free_ports, [draining, other]) as (url, router):
        _, raw = await stream(url, body())
        ids, text, _, num_done = client_view(raw)
        assert text == full_text(8) and len(ids) == 1 and num_done == 1
        # Handing back is a pod shutting down as asked, not a failure that would eject it.
        assert all(router.fleet.available(ep) for ep in router.fleet.endpoints.by_id.values())


async def test_a_whole_response_is_assembled_across_the_break(
    serve_app, start_router, free_ports, make_wire_pod
):
    dying, healthy = make_wire_pod(die_after=5), make_wire_pod()
    async with (
        fleet(serve_app, start_router, free_ports, [dying, healthy]) as (url, _),
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
        s.post(url + "/v1/completions", json=body()) as r,
    ):
        assert r.status == 200 and r.content_type == "application/json"
        data = await r.json()
    assert dying.headers[0][RESUME_HEADER] == RESUME_WHOLE
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert data["choices"][0]["text"] == full_text(8) and data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 8


async def test_a_client_cannot_send_a_continuation(serve_app, start_router, free_ports, make_wire_pod):
    pod = make_wire_pod()
    forged = {
        "id": "x",
        "created": 1,
        "prompt_token_ids": [1],
        "output_token_ids": [],
        "num_delivered_chars": 0,
    }
    async with fleet(serve_app, start_router, free_ports, [pod]) as (url, _):
        _, raw = await stream(url, body(**{CONTINUATION_FIELD: forged}))
    assert client_view(raw)[1] == full_text(8)
    assert CONTINUATION_FIELD not in pod.payloads[0]


async def test_a_client_leaving_is_not_a_break_to_resume(serve_app, start_router, free_ports, make_wire_pod):
    slow, other = make_wire_pod(), make_wire_pod()
    slow.delay_between = 0.2
    async with fleet(serve_app, start_router, free_ports, [slow, other]) as (url, router):
        async with (
            aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
            s.post(url + "/v1/completions", json=body(max_tokens=30, stream=True)) as r,
        ):
            await r.content.readuntil(b"\n\n")  # the first event, then the client goes away
        await asyncio.sleep(1.0)
        assert router.metrics.resumes._value.get() == 0 and router.metrics.stream_errors._value.get() == 0
        assert all(router.fleet.available(ep) for ep in router.fleet.endpoints.by_id.values())
    assert len(slow.payloads) + len(other.payloads) == 1
