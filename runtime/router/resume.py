"""Resumed streams: a stream that breaks after its first byte continues on another pod, invisibly.

The router asks every pod to annotate its stream (runtime/openai/resume.py): the prompt ids as the engine
saw them, then the token ids behind each event. It strips the annotations and keeps, per stream, what the
client holds (`Splice`). When the stream breaks before `data: [DONE]` (connection lost, pod gone, idle
timeout, or the pod handing it back at its drain deadline), the router sends a continuation to another
healthy pod: the client's request plus the prompt ids, the tokens already generated and the characters of
text delivered. That pod produces exactly the rest, with the same `id` and `created` and a usage that
counts the whole completion, so the client sees one stream and one `[DONE]`. When no pod is in rotation at
that moment (a rollout's or a lost node's replacements not probed yet), the stream is held, as a queued
request is, up to `queueTimeoutSeconds`, and continued on the first pod that comes in.

At most `retries.maxResumes` continuations per request; after that, or for a stream the pod declared not
resumable (several choices, tool-call parsing, ...), the client gets the error event as before, naming why.

Non-streaming requests that can be resumed are streamed from the pod and assembled here
(runtime/router/assemble.py): a pod dying mid-generation costs a continuation, not a failed request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from tokenfleet.runtime.openai.resume import (
    ANNOTATION_PREFIX,
    CONTINUATION_FIELD,
    PROGRESS_PREFIX,
    RESUME_HEADER,
    RESUME_STREAM,
    Continuation,
    Progress,
    StreamStart,
    count_token_ids,
    parse_annotation,
    split_event,
)
from tokenfleet.runtime.router.assemble import Assembler
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
# How often a stream with no endpoint to continue on looks again (the probes run every second or so).
ENDPOINT_WAIT_STEP_S = 0.2

_DONE = b"data: [DONE]"
_STREAM_HEADERS = {"content-type", "cache-control", "x-accel-buffering"}


@dataclass(slots=True)
class Splice:
    """What the client holds of one stream, from the annotations of the events it was sent."""

    start: StreamStart | None = None
    # The Progress lines of the events the client got, kept as bytes and parsed only when a continuation
    # needs them (`fold`): most streams never break, and parsing every event would double the router's cost.
    progress: list[bytes] = field(default_factory=list)
    num_folded: int = 0
    output_token_ids: list[int] = field(default_factory=list)  # of the folded lines
    num_chars: int = 0
    num_resumes: int = 0
    done: bool = False
    sent_any: bool = False  # the client has bytes of this response: a break can no longer be a retry
    num_events: int = 0  # data events sent (a pod that does not annotate: about one per token)
    resume_base: int = 0  # prompt + generated tokens handed to the latest continuation
    cached_on_resume: int | None = None  # how many of them its pod found in its prefix cache
    expect_cached: bool = False  # the next Progress line is a continuation's first: it says what was cached

    def fold(self) -> None:
        for line in self.progress[self.num_folded :]:
            p = parse_annotation(line)
            if isinstance(p, Progress):
                self.output_token_ids.extend(p.token_ids)
                self.num_chars = p.num_chars
        self.num_folded = len(self.progress)

    def num_tokens(self) -> int:
        return len(self.output_token_ids) + sum(count_token_ids(x) for x in self.progress[self.num_folded :])

    def continuation(self) -> Continuation:
        assert self.start is not None
        self.fold()
        return Continuation(
            id=self.start.id,
            created=self.start.created,
            prompt_token_ids=self.start.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            num_delivered_chars=self.num_chars,
        )


@dataclass(frozen=True, slots=True)
class Break:
    """Why a stream ended before its `[DONE]`."""

    reason: str  # broken | closed | timeout | handoff | client_gone
    detail: str


@dataclass(frozen=True, slots=True)
class Unfinished:
    """How a followed stream ended short of its `[DONE]`: the client left, or why it could not go on."""

    client_gone: bool
    message: str = ""


class Sink:
    """Where relayed events go: the client's response (prepared on the first event)."""

    def __init__(self, request: web.Request, headers: dict[str, str]):
        self._request = request
        self._headers = headers
        self.resp: web.StreamResponse | None = None

    async def write(self, data: bytes) -> None:
        if self.resp is None:
            self.resp = web.StreamResponse(status=200, headers=self._headers)
            await self.resp.prepare(self._request)
        await self.resp.write(data)

    async def close(self, tail: bytes | None) -> None:
        if self.resp is None:
            return
        try:
            if tail:
                await self.resp.write(tail)
            await self.resp.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass


def annotated_headers(out: Outgoing) -> dict[str, str]:
    return {**out.headers, RESUME_HEADER: RESUME_STREAM}


async def relay(
    upstream: aiohttp.ClientResponse,
    sink,
    splice: Splice,
    idle_timeout: float,
    meter: TokenMeter | None = None,
) -> Break | None:
    """Pass one pod's stream on, keeping `splice` in step (and `meter`, one token per event). None when it
    reached [DONE].

    Whole events only: an annotation and the text it describes reach the client together or not at all
    (the events complete in one read are written at once, and what they say is applied once written), so
    after a break `splice` is exactly what the client holds.
    """
    buf = b""
    handoff = False
    try:
        while True:
            chunk = await asyncio.wait_for(upstream.content.readany(), idle_timeout)
            if not chunk:
                break
            *blocks, buf = (buf + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
            out: list[bytes] = []
            progress: list[bytes] = []
            for block in blocks:
                # Pods put their annotation lines first in an event block: peel them off.
                while block.startswith(ANNOTATION_PREFIX):
                    line, _, block = block.partition(b"\n")
                    if line.startswith(PROGRESS_PREFIX):
                        progress.append(line)
                        continue
                    a = parse_annotation(line)
                    if a == "handoff":
                        handoff = True
                    elif isinstance(a, StreamStart):
                        splice.start = splice.start or a
                client_block = block
                if b"\n" + ANNOTATION_PREFIX in client_block:  # one further down: the general parse
                    annotations, client_block = split_event(client_block)
                    progress.extend(a.encode().rstrip(b"\n") for a in annotations if isinstance(a, Progress))
                if not client_block:
                    continue
                out.append(client_block)
                if client_block.strip() == _DONE:
                    splice.done = True
                    break
                splice.num_events += 1
            if out:
                if meter is not None:  # generated: service given, whether or not the client still reads
                    meter.add(len(out) - 1 if splice.done else len(out))  # [DONE] is no token
                try:
                    await sink.write(b"\n\n".join(out) + b"\n\n")
                except ConnectionResetError:
                    return Break("client_gone", "the client went away")
                splice.sent_any = True
            if progress:  # kept once the events reached the client
                if splice.expect_cached:
                    first = parse_annotation(progress[0])
                    if isinstance(first, Progress) and first.num_cached_tokens is not None:
                        splice.cached_on_resume = first.num_cached_tokens
                    splice.expect_cached = False
                splice.progress.extend(progress)
            if splice.done:
                return None
    except TimeoutError:
        return Break("timeout", "the serving endpoint went silent mid-stream")
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
        return Break("broken", f"the serving endpoint failed mid-stream ({type(e).__name__})")
    if handoff:
        return Break("handoff", "the serving endpoint handed the stream back while shutting down")
    return Break("closed", "the serving endpoint closed the stream early")


async def stream(
    request: web.Request,
    fleet: Fleet,
    out: Outgoing,
    pick: Pick,
    upstream: aiohttp.ClientResponse,
    retries: Retries,
    assemble: bool = False,
) -> tuple[web.StreamResponse, Outcome] | Retry:
    """Relay `upstream` (a 200 stream from `pick`) to the client, resuming it on other pods when it breaks.
    With `assemble`, the client asked for one JSON object: the events are collected and answered whole.
    A `Retry` when it broke before the client got anything (the caller tries another endpoint)."""
    headers = response_headers(upstream, pick)
    sink: Sink | Assembler = (
        Assembler(out.path.endswith("/chat/completions")) if assemble else Sink(request, headers)
    )
    splice = Splice()
    outcome = Outcome(200, 0, pick.endpoint.id)
    ended = await follow(request, fleet, out, pick, upstream, sink, splice, outcome, retries)
    if isinstance(ended, Retry):
        return ended
    if ended is not None and ended.client_gone:  # leaving closes the upstream request: aborted on the pod
        return getattr(sink, "resp", None) or web.Response(status=499), outcome
    failure = ended.message if ended is not None else None
    if isinstance(sink, Assembler):
        if failure is not None or not sink.complete:
            message = failure or "the serving endpoint reported an error"
            body = sink.error or error_body(message, "upstream_error", "upstream_failed")
            outcome.status = 502
            return web.json_response(body, status=502), outcome
        kept = {k: v for k, v in headers.items() if k.lower() not in _STREAM_HEADERS}
        return web.Response(body=sink.body(), headers=kept, content_type="application/json"), outcome
    await sink.close(sse_error(failure) if failure is not None else None)
    assert sink.resp is not None
    return sink.resp, outcome


async def follow(
    request: web.Request,
    fleet: Fleet,
    out: Outgoing,
    pick: Pick,
    upstream: aiohttp.ClientResponse,
    sink,
    splice: Splice,
    outcome: Outcome,
    retries: Retries,
) -> Unfinished | Retry | None:
    """Relay `upstream` into `sink` and, each time the stream breaks, continue it on another of
    `out.targets` from what `splice` says the client holds. `splice` may start with what an earlier stage
    already delivered (the prefill pod's token of a disaggregated stream). Returns None at `[DONE]`, a
    `Retry` when nothing reached the client, else how it ended short (the client left, or why it could not
    be continued: the caller sends the error event). `outcome` gets the serving endpoint and the completion
    tokens."""
    tried = {pick.endpoint.id}
    brk = await relay(upstream, sink, splice, retries.idle_timeout_seconds, out.meter)
    _judge(fleet, pick, brk)
    failure: str | None = None
    while brk is not None:
        if brk.reason == "client_gone":
            outcome.completion_tokens = splice.num_tokens()
            return Unfinished(client_gone=True)
        if not splice.sent_any:  # nothing reached the client: an ordinary retry from the start
            body = error_body(brk.detail, "upstream_error", "upstream_failed")
            return Retry(502, json.dumps(body).encode(), "broken")
        log.warning("stream %s from %s broke (%s)", _sid(splice), pick.endpoint.url, brk.reason)
        why = _why_not(splice, retries)
        if why is not None:
            reason = "not_resumable" if splice.start is None or not splice.start.resumable else "exhausted"
            fleet.metrics.resume_failures.labels(reason).inc()
            failure = f"{brk.detail}; {why}"
            break
        result = await _continue(request, fleet, out, splice, tried, retries)
        if result is None:
            fleet.metrics.resume_failures.labels("no_endpoint").inc()
            failure = f"{brk.detail}; no other endpoint could continue the stream"
            break
        pick, upstream = result
        outcome.endpoint = pick.endpoint.id
        try:
            brk = await relay(upstream, sink, splice, retries.idle_timeout_seconds, out.meter)
        finally:
            upstream.release()
            fleet.release(pick.endpoint)
        _judge(fleet, pick, brk)
        if splice.cached_on_resume is not None:  # what the continuation had to compute again
            fleet.metrics.resume_recomputed_tokens.inc(max(splice.resume_base - splice.cached_on_resume, 0))
            splice.cached_on_resume = None
    outcome.completion_tokens = splice.num_tokens() if splice.start else splice.num_events
    if failure is None:
        return None
    fleet.metrics.stream_errors.inc()
    return Unfinished(client_gone=False, message=failure)


def _sid(splice: Splice) -> str:
    return splice.start.id if splice.start else "?"


def _judge(fleet: Fleet, pick: Pick, brk: Break | None) -> None:
    # A hand-off is a pod shutting down as asked, not a failure; anything else counts against its health.
    if brk is None:
        fleet.report(pick.endpoint, True)
    elif brk.reason not in ("handoff", "client_gone"):
        fleet.report(pick.endpoint, False)


def _why_not(splice: Splice, retries: Retries) -> str | None:
    if splice.start is None:
        return "the stream cannot be resumed (the endpoint did not describe it)"
    if not splice.start.resumable:
        return splice.start.why_not or "the stream cannot be resumed"
    if splice.num_resumes >= retries.max_resumes:
        return f"it was already resumed {splice.num_resumes} time(s), the most allowed (retries.maxResumes)"
    return None


async def _continue(
    request: web.Request, fleet: Fleet, out: Outgoing, splice: Splice, tried: set[str], retries: Retries
) -> tuple[Pick, aiohttp.ClientResponse] | None:
    """Send the continuation to another endpoint (each try counts as a resume); the 200 stream and its
    endpoint (acquired: the caller releases it), or None when no endpoint took it."""
    continuation = splice.continuation()
    while splice.num_resumes < retries.max_resumes:
        pick = fleet.pick(out.targets, out.prompt, out.session_key, frozenset(tried))
        if pick is None and len(tried) > 1:
            tried.clear()  # every endpoint was tried once: the original ones may be back (a restarted pod)
            pick = fleet.pick(out.targets, out.prompt, out.session_key, frozenset())
        if pick is None:
            pick = await _wait_for_endpoint(fleet, out)
        if pick is None:
            return None
        splice.num_resumes += 1
        fleet.metrics.resumes.inc()
        ep = pick.endpoint
        tried.add(ep.id)
        payload = {**json.loads(body_for(out, pick)), CONTINUATION_FIELD: continuation.model_dump()}
        payload["stream"] = True
        if not out.stream:  # an assembled whole response: its final event must carry the usage
            payload["stream_options"] = {"include_usage": True}
        fleet.acquire(ep)
        upstream = None
        try:
            timeout = aiohttp.ClientTimeout(
                total=None, connect=retries.connect_timeout_seconds, sock_read=None
            )
            upstream = await asyncio.wait_for(
                fleet.session.post(
                    ep.url + out.path,
                    data=json.dumps(payload).encode(),
                    headers=annotated_headers(out),
                    timeout=timeout,
                ),
                retries.first_byte_timeout_seconds,
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            fleet.report(ep, False)
            fleet.release(ep)
            fleet.metrics.resume_failures.labels("unreachable").inc()
            log.warning("continuation to %s failed: %s", ep.url, type(e).__name__)
            continue
        if upstream.status != 200:
            body = await _read_quietly(upstream)
            if upstream.status >= 500:
                fleet.report(ep, False)
            upstream.release()
            fleet.release(ep)
            fleet.metrics.resume_failures.labels(str(upstream.status)).inc()
            log.warning("continuation to %s refused: %d %s", ep.url, upstream.status, body[:200])
            continue
        fleet.record_route(pick)
        splice.resume_base = len(continuation.prompt_token_ids) + len(continuation.output_token_ids)
        splice.expect_cached = True
        return pick, upstream
    return None


async def _wait_for_endpoint(fleet: Fleet, out: Outgoing) -> Pick | None:
    """No endpoint in rotation right now — a rollout's new pods not probed yet while the old ones hand
    their streams back, a lost node's replacements still starting: the stream is held as a queued request
    is, up to the queue timeout, and continued on the first endpoint that comes into rotation."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + fleet.config.routing.queue_timeout_seconds
    while loop.time() < deadline:
        await asyncio.sleep(ENDPOINT_WAIT_STEP_S)
        pick = fleet.pick(out.targets, out.prompt, out.session_key, frozenset())
        if pick is not None:
            return pick
    return None


async def _read_quietly(upstream: aiohttp.ClientResponse) -> bytes:
    try:
        return await asyncio.wait_for(upstream.read(), 5.0)
    except (aiohttp.ClientError, TimeoutError):
        return b""
