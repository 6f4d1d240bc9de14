"""Forward one admitted request: pick, send, retry before the first byte, then stream through unbuffered.

Retry rule: a connection failure, a timeout before the response headers, a 5xx, or a 429 from the pod
(its queue is full) sends the request to another endpoint, at most `retries.maxAttempts` attempts in all.
A pod's 503 `lora_slots_busy` (every LoRA adapter it holds has requests in flight, so it cannot load the
one asked for) is a placement miss, not ill health: the pod stays in rotation with no adapter room until
its next load report, and the request tries a pod with room. When no pod tried had one, the client gets
the 503 with Retry-After, and a place is made for the adapter's next requests: one pod's spare copy of
another adapter gets no new requests until it is idle (adapter_placement.AdapterDrains). A 503
`lora_source_unavailable` (the pod could not download an hf:// adapter now) is the request's trouble too:
the pod stays in rotation and another pod, which may hold the adapter already, is tried.
When the model's route has a fallback, the last attempt goes there: a primary that failed every attempt
before the first byte is passed over for it (a route's other endpoints are tried first, being the model
the client asked for).
Once the first byte has reached the client nothing can be retried: a stream that breaks then ends with an
SSE error event and `data: [DONE]`, so a client never waits on a dead pod. Non-streaming replies are read
whole before anything is sent (they are one JSON object), which keeps them retryable until complete.
Every wait has a bound: connect, first byte, and the silence between stream chunks.

With `retries.maxResumes` > 0 a stream that breaks after its first byte is not ended with an error but
continued on another endpoint (runtime/router/resume.py). What both send and return is in upstream.py.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aiohttp import web
from tokenfleet.runtime.errors import AdaptersBusy, AdapterUnavailable
from tokenfleet.runtime.openai.resume import RESUME_HEADER, RESUME_STREAM, RESUME_WHOLE
from tokenfleet.runtime.router import resume
from tokenfleet.runtime.router.assemble import can_assemble
from tokenfleet.runtime.router.config import Retries
from tokenfleet.runtime.router.fleet import Fleet, Pick
from tokenfleet.runtime.router.upstream import (
    Outcome,
    Outgoing,
    Retry,
    TokenMeter,
    body_for,
    error_body,
    response_headers,
    sse_error,
)

log = logging.getLogger(__name__)


def _count_sse_tokens(chunk: bytes) -> int:
    # One SSE event per generated token is what our pods (and vLLM) send; [DONE] and usage-only events are few.
    return chunk.count(b"data: ") - chunk.count(b"data: [DONE]")


async def forward(
    request: web.Request, fleet: Fleet, out: Outgoing, retries: Retries
) -> tuple[web.StreamResponse, Outcome]:
    result = await _attempts(request, fleet, out, retries)
    if isinstance(result, Retry) and result.reason == "lora_busy" and out.adapter is not None:
        # No pod tried had a place for the adapter: the client gets the pods' 503 with Retry-After now (shed,
        # not held: holding requests the fleet has no place for measured worse for everyone at high load),
        # and a place is made for the adapter's next requests.
        fleet.make_adapter_place(out.targets, out.adapter)
    if isinstance(result, Retry):
        resp = web.Response(status=result.status, body=result.body, content_type="application/json")
        if result.status in (429, 503):
            resp.headers["Retry-After"] = "1"
        return resp, Outcome(result.status)
    if result is None:
        body = error_body(
            "no healthy endpoint serves this model", "service_unavailable", "no_healthy_endpoint"
        )
        return web.json_response(body, status=503, headers={"Retry-After": "1"}), Outcome(503)
    return result


async def _attempts(
    request: web.Request, fleet: Fleet, out: Outgoing, retries: Retries
) -> tuple[web.StreamResponse, Outcome] | Retry | None:
    """Up to `retries.maxAttempts` tries on distinct endpoints: the response, the last attempt's `Retry`
    when every try failed before the first byte, or None when no endpoint could be tried."""
    tried: set[str] = set()
    last_error: Retry | None = None
    fallbacks = tuple(t for t in out.targets if t.fallback)
    for attempt in range(retries.max_attempts):
        targets = out.targets
        if attempt > 0 and attempt == retries.max_attempts - 1 and fallbacks:
            targets = fallbacks  # the primary failed every attempt so far: its fallback gets the last one
        pick = fleet.pick(targets, out.prompt, out.session_key, frozenset(tried))
        if pick is None:
            break
        if attempt > 0:
            fleet.metrics.retries.labels(last_error.reason if last_error else "unknown").inc()
        ep = pick.endpoint
        tried.add(ep.id)
        fleet.acquire(ep, out.adapter)
        try:
            result = await _attempt(request, fleet, out, pick, retries)
        finally:
            fleet.release(ep)
        if isinstance(result, Retry):
            last_error = result
            continue
        fleet.metrics.decisions.labels(pick.decision.reason).inc()
        fleet.metrics.prefix_match_blocks.observe(pick.decision.prefix_blocks)
        if pick.num_blocks:
            fleet.metrics.prefix_match_ratio.observe(min(pick.decision.prefix_blocks / pick.num_blocks, 1.0))
        return result
    return last_error


async def _attempt(
    request: web.Request, fleet: Fleet, out: Outgoing, pick: Pick, retries: Retries
) -> tuple[web.StreamResponse, Outcome] | Retry:
    """One try. Returns the response for the client, or a `Retry` when nothing was sent yet."""
    ep = pick.endpoint
    timeout = aiohttp.ClientTimeout(total=None, connect=retries.connect_timeout_seconds, sock_read=None)
    # Pods annotate resumable streams (resume.py); a whole response may come as one too, assembled here.
    whole = not out.stream and retries.max_resumes > 0 and can_assemble(out.path, out.payload)
    resumable = out.stream and retries.max_resumes > 0
    headers = out.headers
    if resumable or whole:
        headers = {**out.headers, RESUME_HEADER: RESUME_STREAM if resumable else RESUME_WHOLE}
    try:
        upstream = await asyncio.wait_for(
            fleet.session.post(ep.url + out.path, data=body_for(out, pick), headers=headers, timeout=timeout),
            retries.first_byte_timeout_seconds,
        )
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        fleet.report(ep, False)
        reason = "timeout" if isinstance(e, TimeoutError) else "connect"
        msg = f"endpoint {ep.url} unreachable: {type(e).__name__}"
        return Retry(
            502, json.dumps(error_body(msg, "upstream_error", "upstream_unreachable")).encode(), reason
        )
    async with upstream:
        if upstream.status >= 500 or upstream.status == 429:
            body = await _read_quietly(upstream, retries.idle_timeout_seconds)
            if upstream.status == 503 and _error_code(body) == AdaptersBusy.code:
                # The pod is up; it only has no place for this adapter now: not out of rotation (its other
                # requests are welcome), just no room until its next /load report says otherwise.
                fleet.adapter_busy(ep)
                return Retry(503, body, "lora_busy")
            if upstream.status == 503 and _error_code(body) == AdapterUnavailable.code:
                # The pod could not download the adapter (its Hub is failing): the pod is fine, and another
                # that fetched it earlier may serve it.
                return Retry(503, body, "lora_source")
            if upstream.status == 503:  # loading or draining: not ready, not failing (its probe says which)
                fleet.not_ready(ep)
            elif upstream.status >= 500:
                fleet.report(ep, False)
            return Retry(upstream.status, body, "overloaded" if upstream.status == 429 else "5xx")
        fleet.record_route(pick)
        assembling = whole and upstream.content_type == "text/event-stream"
        if (not out.stream and not assembling) or upstream.status != 200:
            return await _whole(fleet, pick, upstream, retries)
        if resumable or assembling:
            return await resume.stream(request, fleet, out, pick, upstream, retries, assembling)
        return await _stream(request, fleet, pick, upstream, retries, out.meter)


def _error_code(body: bytes) -> str | None:
    """The OpenAI-style error body's `code`, or None."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


async def _read_quietly(upstream: aiohttp.ClientResponse, timeout: float) -> bytes:
    try:
        return await asyncio.wait_for(upstream.read(), timeout)
    except (aiohttp.ClientError, TimeoutError):
        return json.dumps(error_body("upstream failed", "upstream_error")).encode()


async def _whole(
    fleet: Fleet, pick: Pick, upstream: aiohttp.ClientResponse, retries: Retries
) -> tuple[web.StreamResponse, Outcome] | Retry:
    try:
        body = await asyncio.wait_for(upstream.read(), retries.first_byte_timeout_seconds)
    except (aiohttp.ClientError, TimeoutError) as e:
        fleet.report(pick.endpoint, False)
        msg = f"endpoint {pick.endpoint.url} failed mid-response: {type(e).__name__}"
        return Retry(502, json.dumps(error_body(msg, "upstream_error", "upstream_failed")).encode(), "broken")
    fleet.report(pick.endpoint, True)
    tokens = 0
    if upstream.status == 200:
        try:
            tokens = int(json.loads(body).get("usage", {}).get("completion_tokens", 0))
        except (ValueError, AttributeError, TypeError):
            tokens = 0
    resp = web.Response(status=upstream.status, body=body, headers=response_headers(upstream, pick))
    return resp, Outcome(upstream.status, tokens, pick.endpoint.id)


async def _stream(
    request: web.Request,
    fleet: Fleet,
    pick: Pick,
    upstream: aiohttp.ClientResponse,
    retries: Retries,
    meter: TokenMeter | None,
) -> tuple[web.StreamResponse, Outcome]:
    resp = web.StreamResponse(status=upstream.status, headers=response_headers(upstream, pick))
    await resp.prepare(request)
    outcome = Outcome(upstream.status, 0, pick.endpoint.id)
    ended = False
    tail = b""  # the end marker may straddle two chunks
    try:
        while True:
            chunk = await asyncio.wait_for(upstream.content.readany(), retries.idle_timeout_seconds)
            if not chunk:
                break
            n = _count_sse_tokens(chunk)
            outcome.completion_tokens += n
            if meter is not None:
                meter.add(n)
            window = tail + chunk
            ended = ended or b"data: [DONE]" in window
            tail = window[-16:]
            await resp.write(chunk)
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
        fleet.report(pick.endpoint, False)
        fleet.metrics.stream_errors.inc()
        log.warning("stream from %s broke after the first byte: %s", pick.endpoint.url, type(e).__name__)
        await _write_quietly(resp, sse_error(f"the serving endpoint failed mid-stream ({type(e).__name__})"))
        return resp, outcome
    except ConnectionResetError:
        return resp, outcome  # the client left; leaving the context closes the upstream request, aborting it
    if not ended:
        # The pod closed cleanly but never finished the stream (e.g. killed between events).
        fleet.metrics.stream_errors.inc()
        await _write_quietly(resp, sse_error("the serving endpoint closed the stream early"))
    else:
        fleet.report(pick.endpoint, True)
    await _write_quietly(resp, None)
    return resp, outcome


async def _write_quietly(resp: web.StreamResponse, data: bytes | None) -> None:
    try:
        if data is not None:
            await resp.write(data)
        else:
            await resp.write_eof()
    except (ConnectionResetError, RuntimeError):
        pass
