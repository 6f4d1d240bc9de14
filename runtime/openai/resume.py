"""Resumable streams: what the router and a pod say to each other so a broken stream continues elsewhere.

The router asks for it with the `x-tokenfleet-resume` request header (`whole` on a non-streaming request:
the pod then streams it, with usage, and the router assembles the JSON object). The pod then adds, to each SSE event
it sends, one SSE comment line `: tokenfleet {json}` ahead of the event's `data:` line (the same event
block, so the annotation and the text it describes arrive together or not at all). The router strips these
lines; a client that somehow saw one would ignore it anyway (SSE comments carry no data).

- The first annotation of a stream (`StreamStart`) gives the response `id` and `created` the client sees,
  the prompt token ids exactly as the engine saw them (after the chat template and any truncation), and
  whether the stream can be continued exactly (and why not).
- Every later annotation (`Progress`) gives the token ids the event's engine delta produced and the
  cumulative number of characters of text the pod's detokenizer has released: everything the client holds.
- A pod that hands its streams back (drain deadline) ends them with the `handoff` annotation and no
  `data: [DONE]`.

To continue, the router re-sends the client's request with a `tokenfleet_continuation` member
(`Continuation`): the same sampling parameters, stop rules and `max_tokens`/`min_tokens` (the pod counts the
tokens already generated against them, as it would have), plus what the client already holds. The pod then
produces exactly the rest of the stream: no chat template, the detokenizer resumed from the generated ids,
a seeded generator advanced past the draws already made, and the same `id`, `created` and final usage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

RESUME_HEADER = "x-tokenfleet-resume"  # router -> pod: annotate the stream so it can be continued
RESUME_STREAM = "1"  # ... a streaming request
RESUME_WHOLE = "whole"  # ... a non-streaming one: answer it as an annotated stream with usage instead
CONTINUATION_FIELD = "tokenfleet_continuation"  # request body member carrying a Continuation
ANNOTATION_PREFIX = b": tokenfleet "


class Continuation(BaseModel):
    """Everything the client already received of a stream that broke (router -> pod, in the body)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200)
    created: int
    prompt_token_ids: list[int] = Field(min_length=1)
    output_token_ids: list[int] = Field(default_factory=list)  # none yet: the stream broke before a token
    num_delivered_chars: int = Field(ge=0)  # characters of output text the client already received


@dataclass(frozen=True, slots=True)
class StreamStart:
    id: str
    created: int
    prompt_token_ids: list[int]
    resumable: bool
    why_not: str | None = None

    def encode(self) -> bytes:
        body = {"id": self.id, "created": self.created, "prompt_token_ids": self.prompt_token_ids}
        body["resumable"] = self.resumable
        if self.why_not:
            body["why_not"] = self.why_not
        return _line(body)


@dataclass(frozen=True, slots=True)
class Progress:
    token_ids: list[int]
    num_chars: int  # cumulative characters of output text released so far
    num_cached_tokens: int | None = None  # on a continuation's first progress: tokens it did not recompute

    def encode(self) -> bytes:
        # `token_ids` first: the router recognises (PROGRESS_PREFIX) and counts these lines without parsing.
        body: dict = {"token_ids": self.token_ids, "num_chars": self.num_chars}
        if self.num_cached_tokens is not None:
            body["num_cached_tokens"] = self.num_cached_tokens
        return _line(body)


PROGRESS_PREFIX = ANNOTATION_PREFIX + b'{"token_ids":['


def count_token_ids(progress_line: bytes) -> int:
    """How many token ids a Progress line carries, without parsing it (the router's hot path)."""
    ids = progress_line[len(PROGRESS_PREFIX) : progress_line.index(b"]")]
    return ids.count(b",") + 1 if ids.strip() else 0


HANDOFF = ANNOTATION_PREFIX + b'{"handoff": true}\n\n'  # a whole event: the pod gives the stream back


def _line(body: dict) -> bytes:
    return ANNOTATION_PREFIX + json.dumps(body, separators=(",", ":")).encode() + b"\n"


Annotation = StreamStart | Progress | str  # str: "handoff"


def parse_annotation(line: bytes) -> Annotation | None:
    """One `: tokenfleet {...}` line (without its newline) -> what it says; None if it is not one."""
    if not line.startswith(ANNOTATION_PREFIX):
        return None
    try:
        body = json.loads(line[len(ANNOTATION_PREFIX) :])
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    if body.get("handoff"):
        return "handoff"
    if "prompt_token_ids" in body:
        return StreamStart(
            str(body["id"]),
            int(body["created"]),
            [int(t) for t in body["prompt_token_ids"]],
            bool(body.get("resumable", False)),
            body.get("why_not"),
        )
    if "token_ids" in body:
        cached = body.get("num_cached_tokens")
        return Progress(
            [int(t) for t in body["token_ids"]],
            int(body["num_chars"]),
            None if cached is None else int(cached),
        )
    return None


def split_event(block: bytes) -> tuple[list[Annotation], bytes]:
    """One SSE event block (without its blank line) -> its annotations and the block the client gets
    (b"" when nothing is left for the client)."""
    annotations: list[Annotation] = []
    kept: list[bytes] = []
    for line in block.split(b"\n"):
        a = parse_annotation(line)
        if a is not None:
            annotations.append(a)
        elif line.startswith(ANNOTATION_PREFIX):
            continue  # a malformed annotation is still never the client's
        elif line:
            kept.append(line)
    return annotations, b"\n".join(kept)
