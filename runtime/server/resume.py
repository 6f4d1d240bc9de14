"""The pod's half of resumable streams (the wire is runtime/openai/resume.py).

- `StreamWire`: when the router asks, annotate each SSE event with the token ids it carries (and, on the
  first event, the prompt ids as the engine saw them); when the request is a continuation, take it out of
  the body and turn it into the engine's `ResumeFrom`, the stream's id and `created`.
- `Handoff`: on SIGTERM the pod drains; once the drain deadline passes, streams the router can resume end
  with the handoff annotation (and no `data: [DONE]`) instead of being cut, so the router continues them
  on another pod. Streams of clients that did not ask are cut as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from pydantic import ValidationError
from tokenfleet.runtime.engine.request import ResumeFrom
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.errors import InvalidRequest
from tokenfleet.runtime.openai.resume import (
    CONTINUATION_FIELD,
    HANDOFF,
    RESUME_HEADER,
    RESUME_STREAM,
    RESUME_WHOLE,
    Continuation,
    Progress,
    StreamStart,
)
from tokenfleet.runtime.openai.translate import Prompt


class StreamWire:
    """Per HTTP request: the router's annotations and, for a continuation, where the stream stands."""

    def __init__(self, annotate: bool, continuation: Continuation | None):
        self.annotate = annotate
        self.continuation = continuation
        self._num_chars = continuation.num_delivered_chars if continuation else 0
        self._first_progress = True

    @staticmethod
    def read(request: web.Request, body: bytes) -> tuple[StreamWire, bytes]:
        """The wire state and the body the handler validates: without the continuation member, and for a
        non-streaming request the router will assemble (`whole`), turned into a stream with usage."""
        asked = request.headers.get(RESUME_HEADER)
        annotate = asked in (RESUME_STREAM, RESUME_WHOLE)
        if CONTINUATION_FIELD.encode() not in body and asked != RESUME_WHOLE:
            return StreamWire(annotate, None), body
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            return StreamWire(annotate, None), body  # parse_request reports it
        continuation = None
        if CONTINUATION_FIELD in payload:
            try:
                continuation = Continuation.model_validate(payload.pop(CONTINUATION_FIELD))
            except ValidationError as e:
                message = f"invalid {CONTINUATION_FIELD}: {e.errors()[0]['msg']}"
                raise InvalidRequest(message, CONTINUATION_FIELD) from e
        if asked == RESUME_WHOLE and not payload.get("stream"):
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
        return StreamWire(annotate, continuation), json.dumps(payload).encode()

    # ---- continuation --------------------------------------------------------------------------------

    def prompt(self, stream: bool) -> tuple[Prompt, int] | None:
        """A continuation's prompt as the first pod's engine saw it, and 0 tokens dropped (None for a fresh
        request). Only streams continue: the router assembles whole responses from the stream itself."""
        c = self.continuation
        if c is None:
            return None
        if not stream:
            raise InvalidRequest("a continuation must be streamed", param="stream")
        return Prompt(list(c.prompt_token_ids), ""), 0

    def resume_from(self, params: SamplingParams, engine) -> ResumeFrom | None:
        """The engine's view of the continuation (None for a fresh request); refuses one that could not
        be the continuation of this request (already past its max_tokens, or ids outside the vocabulary)."""
        c = self.continuation
        if c is None:
            return None
        tokenizer = getattr(engine, "tokenizer", None)
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if callable(vocab_size):
            vocab_size = vocab_size()
        if params.n != 1:
            raise InvalidRequest("a continuation has exactly one choice", param="n")
        if params.max_tokens is not None and len(c.output_token_ids) >= params.max_tokens:
            raise InvalidRequest("the continuation already holds max_tokens tokens", param=CONTINUATION_FIELD)
        if vocab_size is not None and any(
            not 0 <= t < vocab_size for t in (*c.prompt_token_ids, *c.output_token_ids)
        ):
            raise InvalidRequest(
                "a continuation token id is outside the vocabulary", param=CONTINUATION_FIELD
            )
        return ResumeFrom(tuple(c.output_token_ids), c.num_delivered_chars)

    def response_id(self, own: str) -> str:
        return self.continuation.id if self.continuation else own

    def created(self, now: int) -> int:
        return self.continuation.created if self.continuation else now

    # ---- annotations ---------------------------------------------------------------------------------

    def start(
        self, response_id: str, created: int, prompt_token_ids: list[int], why_not: str | None
    ) -> bytes:
        """The first annotation (b"" when the router did not ask)."""
        if not self.annotate:
            return b""
        return StreamStart(response_id, created, list(prompt_token_ids), why_not is None, why_not).encode()

    def progress(self, token_ids: list[int], text: str, num_cached_tokens: int) -> bytes:
        """The annotation of one engine delta: its token ids and the text released so far."""
        if not self.annotate:
            return b""
        self._num_chars += len(text)
        cached = None
        if self._first_progress and self.continuation is not None:
            cached = num_cached_tokens  # what the continuation did not have to recompute
        self._first_progress = False
        return Progress(list(token_ids), self._num_chars, cached).encode()

    def handed_off(self, request: web.Request, events: Callable[[], AsyncIterator[bytes]]):
        """`events` for `respond`: when the router can resume this stream, it ends with the handoff marker
        at the drain deadline instead of being cut."""
        handoff = request.app.get(HANDOFF_KEY)
        if not self.annotate or handoff is None:
            return events
        return lambda: handoff.guard(events())

    @staticmethod
    def alone(annotation: bytes) -> bytes:
        """An annotation as an event of its own (a delta with nothing for the client, e.g. held-back text)."""
        return annotation + b"\n" if annotation else b""


def speculative(state) -> bool:
    """Whether this pod decodes speculatively (its seeded draws then depend on the proposals)."""
    return state.config.speculative.method != "none"


def why_not_resumable(
    params: SamplingParams, num_prompts: int, *, tools: bool, speculative: bool
) -> str | None:
    """Why a stream of this request could not be continued exactly on another pod (None: it can)."""
    if params.n != 1 or num_prompts != 1:
        return "requests with several choices (n > 1 or several prompts) cannot be resumed"
    if tools:
        return "tool-call parsing state cannot be carried to another pod"
    if speculative and params.seed is not None and not params.greedy:
        return "seeded sampling with speculative decoding cannot be replayed exactly"
    return None


class HandedOff(ConnectionResetError):
    """Raised into the response writer once a stream is handed back: for this pod the stream's reader is
    gone, so it ends without `data: [DONE]` and its engine request is aborted like a disconnect's."""


class Handoff:
    """The drain deadline's signal to resumable streams (one per app)."""

    def __init__(self) -> None:
        self._fired: asyncio.Event | None = None
        self._live = 0
        self._none_live: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._fired is None:
            self._fired = asyncio.Event()
        return self._fired

    @property
    def live(self) -> int:
        return self._live

    async def hand_off(self, timeout: float) -> int:
        """Tell every live resumable stream to hand back; wait (up to `timeout`) until they did. Returns
        how many were handed back."""
        count = self._live
        self._event().set()
        if self._live:
            self._none_live = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._none_live.wait(), timeout)
        return count

    async def guard(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Pass `events` through until the hand-off, then end the stream with the handoff marker."""
        fired = self._event()
        self._live += 1
        waiter = asyncio.ensure_future(fired.wait())
        it = events.__aiter__()
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                await asyncio.wait({nxt, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if nxt.done():
                    try:
                        event = nxt.result()
                    except StopAsyncIteration:
                        return
                    yield event
                    continue
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                    await nxt
                yield HANDOFF
                raise HandedOff("the stream was handed back to the router at the drain deadline")
        finally:
            waiter.cancel()
            self._live -= 1
            if self._live == 0 and self._none_live is not None:
                self._none_live.set()


HANDOFF_KEY = web.AppKey("tokenfleet.handoff", Handoff)
