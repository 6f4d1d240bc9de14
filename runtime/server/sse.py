"""Server-sent events in the OpenAI streaming format: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from pydantic import BaseModel
from pydantic_core import to_json

DONE = b"data: [DONE]\n\n"


async def open_stream(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            # Reverse proxies (nginx, some ingresses) buffer responses unless told not to.
            "X-Accel-Buffering": "no",
            **(headers or {}),
        },
    )
    await resp.prepare(request)
    return resp


def event(payload: BaseModel) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


_TEXT_MARK = "\x00tokenfleet-text\x00"  # serialised as "\u0000...": never in an id, a model name or a number
_TEXT_MARK_JSON = to_json(_TEXT_MARK)


class TextEvents:
    """A stream's most common event, a choice's new text and nothing else, without building models.

    Each event of a stream repeats the same envelope (id, created, model, nulls) around one string: pydantic
    validating and serialising three nested models took ~5-7 us per event, a tenth of what a served pod
    spends per event at 64 streams, under the GIL the engine's thread waits for. `build(index, text)` makes
    the event's model once per choice index, with a marker for the text; later events splice the text,
    serialised by pydantic's own JSON encoder (`to_json`), between the bytes around the marker, so every
    event is byte for byte what `event(build(index, text))` gives.
    """

    def __init__(self, build: Callable[[int, str], BaseModel]):
        self._build = build
        self._parts: dict[int, tuple[bytes, bytes] | None] = {}

    def event(self, index: int, text: str) -> bytes:
        if index not in self._parts:
            whole = self._build(index, _TEXT_MARK).model_dump_json().encode()
            head, _, tail = whole.partition(_TEXT_MARK_JSON)
            # A field of the envelope containing the marker too: serialise every event in full instead.
            parts = (b"data: " + head, tail + b"\n\n") if whole.count(_TEXT_MARK_JSON) == 1 else None
            self._parts[index] = parts
        parts = self._parts[index]
        if parts is None:
            return event(self._build(index, text))
        return parts[0] + to_json(text) + parts[1]
