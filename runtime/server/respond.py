"""The skeleton /v1/completions and /v1/chat/completions share: submit, then either stream SSE events or
collect the whole response, and always abort what is left on the way out (disconnects free KV at once)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from aiohttp import web
from pydantic import BaseModel
from tokenfleet.runtime.errors import TokenfleetError
from tokenfleet.runtime.server import sse
from tokenfleet.runtime.server.errors import from_exception, sse_error_event
from tokenfleet.runtime.server.generation import Generation
from tokenfleet.runtime.server.request_context import RequestContext


async def respond(
    request: web.Request,
    ctx: RequestContext,
    gen: Generation,
    stream: bool,
    events: Callable[[], AsyncIterator[bytes]],
    body: Callable[[], BaseModel],
    headers: dict[str, str],
) -> web.StreamResponse:
    """`events()` yields the SSE events of a streamed response; `body()` builds the whole one once every
    choice has finished."""
    try:
        await gen.submit()  # admission errors still become a proper HTTP status
        if stream:
            return await _stream(request, ctx, events(), headers)
        async for _ in gen.deltas():
            pass
        ctx.record(gen.choices)
        return web.Response(text=body().model_dump_json(), content_type="application/json", headers=headers)
    finally:
        await gen.close()


async def _stream(
    request: web.Request, ctx: RequestContext, events: AsyncIterator[bytes], headers: dict[str, str]
) -> web.StreamResponse:
    resp = await sse.open_stream(request, headers)
    try:
        try:
            async for event in events:
                await resp.write(event)
        except TokenfleetError as e:  # e.g. the engine died mid-stream: the status line is already sent
            ctx.log_fields["error"] = str(e)
            await resp.write(sse_error_event(from_exception(e)))
        await resp.write(sse.DONE)
    except ConnectionResetError:  # the client went away; respond()'s finally aborts what is left
        ctx.disconnected = True
    return resp
