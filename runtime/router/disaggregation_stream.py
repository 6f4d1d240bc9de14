"""The streamed disaggregated flow: the client gets the prefill pod's first token at once, then the rest from
a decode pod that continues the same stream with the prompt's KV fetched by hash.

The prefill pod streams its one token with the resumable-stream annotations (runtime/openai/resume.py):
they give the response id, `created`, the prompt ids as its engine saw them, the token ids and the text the
client now holds. Its events go to the client as they come, except that a `length` finish (the prefill's
own `max_tokens: 1`) is cleared and its `[DONE]` held back. The decode pod then gets the client's request as
a continuation of that stream plus `kv_transfer_params` naming the prefill pod's hold (from the
`x-tokenfleet-kv-hold` header); it fetches the KV, and its events (the rest, the final usage, `[DONE]`) go
to the client with their annotations stripped. A decode pod that breaks mid-stream is resumed on another
decode pod like any stream (runtime/router/resume.py): a continuation of everything the client holds,
without KV (that pod computes what its own cache lacks), and on a prefill pod when no decode pod is left in
rotation (a node lost with the role's last pod). A prefill that ends the completion by itself (a
stop after one token, or a client `max_tokens` of 1) is passed through whole. When the prefill stream cannot be continued exactly (e.g.
`n` > 1) nothing is sent and the caller uses the unstreamed flow.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace

import aiohttp
from aiohttp import web
from tokenfleet.runtime.openai import kv_transfer as wire
from tokenfleet.runtime.openai.resume import (
    CONTINUATION_FIELD,
    RESUME_HEADER,
    RESUME_STREAM,
    Continuation,
    Progress,
    StreamStart,
    parse_annotation,
)
from tokenfleet.runtime.router.config import Retries
from tokenfleet.runtime.router.fleet import Fleet, PromptKey
from tokenfleet.runtime.router.model_routes import RouteTarget
from tokenfleet.runtime.router.resume import Sink, Splice, annotated_headers, follow
from tokenfleet.runtime.router.upstream import Outcome, Outgoing, Retry, response_headers, sse_error

log = logging.getLogger(__name__)

_DONE = b"data: [DONE]"


class _Client:
    """The client's stream, prepared on the first write."""

    def __init__(self, request: web.Request):
        self.request = request
        self.resp: web.StreamResponse | None = None

    async def write(self, data: bytes, headers: dict[str, str]) -> None:
        if self.resp is None:
            self.resp = web.StreamResponse(status=200, headers=headers)
            await self.resp.prepare(self.request)
        await self.resp.write(data)


def _client_max_tokens(payload: dict) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        if isinstance(payload.get(key), int):
            return payload[key]
    return None


async def stream(
    request: web.Request,
    fleet: Fleet,
    out: Outgoing,
    body: dict,
    prefill_targets: tuple[RouteTarget, ...],
    decode_targets: tuple[RouteTarget, ...],
    retries: Retries,
) -> tuple[web.StreamResponse, Outcome] | None:
    """`body`: the prefill pod's request. None when nothing reached the client (use the unstreamed flow)."""
    pick = fleet.pick(prefill_targets, out.prompt, out.session_key, frozenset())
    if pick is None:
        return None
    ep = pick.endpoint
    client = _Client(request)
    timeout = aiohttp.ClientTimeout(total=None, connect=retries.connect_timeout_seconds, sock_read=None)
    headers = {**out.headers, RESUME_HEADER: RESUME_STREAM}
    payload = {**body, "model": ep.model, "stream": True}
    ends_here = (_client_max_tokens(out.payload) or 2) <= 1
    start: StreamStart | None = None
    tokens: list[int] = []
    chars = 0
    finished = False
    fleet.acquire(ep)
    try:
        upstream = await asyncio.wait_for(
            fleet.session.post(ep.url + out.path, json=payload, headers=headers, timeout=timeout),
            retries.first_byte_timeout_seconds,
        )
        async with upstream:
            if upstream.status != 200 or upstream.content_type != "text/event-stream":
                return None
            hold_id = upstream.headers.get(wire.HOLD_HEADER)
            resp_headers = response_headers(upstream, pick)
            buf = b""
            while True:
                chunk = await asyncio.wait_for(upstream.content.readany(), retries.idle_timeout_seconds)
                if not chunk:
                    break
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    data = []
                    for line in event.split(b"\n"):
                        note = parse_annotation(line)
                        if isinstance(note, StreamStart):
                            start = note
                            if not start.resumable:
                                return None  # nothing sent yet: the unstreamed flow serves it
                        elif isinstance(note, Progress):
                            tokens.extend(note.token_ids)
                            chars = note.num_chars
                        elif line.startswith(b"data: ") and line != _DONE:
                            data.append(line[6:])
                    for raw in data:
                        obj = json.loads(raw)
                        for choice in obj.get("choices") or ():
                            reason = choice.get("finish_reason")
                            if reason == "length" and not ends_here:
                                choice["finish_reason"] = None
                            elif reason is not None:
                                finished = True  # a stop after one token: the completion is whole
                        await client.write(b"data: " + json.dumps(obj).encode() + b"\n\n", resp_headers)
        fleet.report(ep, True)
        fleet.record_route(pick)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
        log.warning("streamed prefill on %s failed: %s", ep.url, type(e).__name__)
        fleet.report(ep, False)
        if client.resp is None:
            return None
        if start is None:
            return await _end(
                client, sse_error(f"the prefill endpoint failed ({type(e).__name__})"), 502, ep.id
            )
        # It died after its first token reached the client, its hold with it: a decode pod continues the
        # stream from what the client holds and computes the prompt itself.
        hold_id = None
    finally:
        fleet.release(ep)
    if client.resp is None or start is None:
        return None
    if finished or ends_here:
        return await _end(client, _DONE + b"\n\n", 200, ep.id, len(tokens))
    continuation = Continuation(
        id=start.id,
        created=start.created,
        prompt_token_ids=start.prompt_token_ids,
        output_token_ids=tokens,
        num_delivered_chars=chars,
    )
    params = wire.DecodeParams(remote_url=ep.url, hold_id=hold_id, block_hashes=[]) if hold_id else None
    return await _decode(
        client, fleet, out, decode_targets, prefill_targets, start, continuation, params, retries
    )


async def _decode(
    client: _Client,
    fleet: Fleet,
    out: Outgoing,
    targets: tuple[RouteTarget, ...],
    fallback: tuple[RouteTarget, ...],
    start: StreamStart,
    continuation: Continuation,
    params: wire.DecodeParams | None,
    retries: Retries,
) -> tuple[web.StreamResponse, Outcome]:
    """Continue the stream on a decode pod, and on another decode pod (a continuation that computes what
    it lacks) if that one breaks: the client holds the prefill pod's token, so a broken decode stream is
    resumed like any other (resume.follow), never retried from the start. With no decode pod left in
    rotation, a `fallback` (prefill) pod continues it the same way: it is a whole engine too."""
    tried: set[str] = set()
    timeout = aiohttp.ClientTimeout(total=None, connect=retries.connect_timeout_seconds, sock_read=None)
    nobody = PromptKey(None, "", None)  # decode pods by load and KV usage: the KV comes with the request
    # Later resumes (resume.follow) take the first of these targets with a pod in rotation: decode first.
    decode_out = replace(out, targets=targets + fallback, prompt=nobody, session_key=None)
    splice = Splice(start=start, output_token_ids=list(continuation.output_token_ids), sent_any=True)
    splice.num_chars = continuation.num_delivered_chars
    for _ in range(retries.max_attempts):
        pick = fleet.pick(targets, nobody, None, frozenset(tried))
        send = params
        if pick is None:  # a prefill pod computes what it lacks; the hold is for decode pods
            pick, send = fleet.pick(fallback, nobody, None, frozenset(tried)), None
        if pick is None:
            break
        ep = pick.endpoint
        tried.add(ep.id)
        body = {
            **out.payload,
            "model": ep.model,
            "stream": True,
            CONTINUATION_FIELD: continuation.model_dump(),
        }
        if send is not None:
            body[wire.FIELD] = send.model_dump()
        fleet.acquire(ep)
        try:
            try:
                upstream = await asyncio.wait_for(
                    fleet.session.post(
                        ep.url + out.path, json=body, headers=annotated_headers(out), timeout=timeout
                    ),
                    retries.first_byte_timeout_seconds,
                )
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                log.warning("decode endpoint %s unreachable: %s", ep.url, type(e).__name__)
                fleet.report(ep, False)
                continue
            async with upstream:
                if upstream.status != 200:
                    if upstream.status >= 500:
                        fleet.report(ep, False)
                    continue
                fleet.record_route(pick)
                sink = Sink(client.request, {})
                sink.resp = client.resp  # prepared by the prefill stage: the same response goes on
                outcome = Outcome(200, 0, ep.id)
                ended = await follow(
                    client.request, fleet, decode_out, pick, upstream, sink, splice, outcome, retries
                )
        finally:
            fleet.release(ep)
        assert not isinstance(ended, Retry)  # the client already holds bytes (splice.sent_any)
        if ended is not None and ended.client_gone:
            return client.resp, outcome
        tail, status = (sse_error(ended.message), 502) if ended is not None else (None, 200)
        return await _end(client, tail, status, outcome.endpoint, outcome.completion_tokens)
    return await _end(
        client,
        sse_error("no decode or prefill endpoint could continue the stream"),
        502,
        None,
        len(splice.output_token_ids),
    )


async def _end(
    client: _Client, tail: bytes | None, status: int, endpoint: str | None, num_tokens: int = 0
) -> tuple[web.StreamResponse, Outcome]:
    assert client.resp is not None
    try:
        if tail:
            await client.resp.write(tail)
        await client.resp.write_eof()
    except (ConnectionResetError, RuntimeError):
        pass
    return client.resp, Outcome(status, num_tokens, endpoint)
