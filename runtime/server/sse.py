"""Server-sent events in the OpenAI streaming format: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel

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
