"""POST /v1/chat/completions, streaming and not: messages go through the model's chat template."""

from __future__ import annotations

import time

from aiohttp import web
from tokenfleet.runtime.errors import TokenfleetError
from tokenfleet.runtime.server import sse
from tokenfleet.runtime.server.errors import from_exception, sse_error_event
from tokenfleet.runtime.server.generation import Generation
from tokenfleet.runtime.server.logprobs import TokenRenderer, chat_logprobs
from tokenfleet.runtime.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    Usage,
)
from tokenfleet.runtime.server.request_context import RequestContext, request_priority, usage_of
from tokenfleet.runtime.openai.translate import chat_params, chat_prompt, parse_request


async def handle(request: web.Request) -> web.StreamResponse:
    ctx = RequestContext.of(request)
    ctx.prefix = "chatcmpl"
    engine = ctx.state.require_engine()
    req = parse_request(ChatCompletionRequest, await request.read())
    ctx.state.check_model(req.model)
    params = chat_params(req)
    prompt = chat_prompt(req, engine.tokenizer)
    gen = Generation(
        engine,
        ctx.state.metrics,
        ctx.engine_base_id,
        [prompt],
        params,
        request_priority(request, req.priority, "priority" in req.model_fields_set),
        req.cache_salt,
    )
    created = int(time.time())
    try:
        await gen.submit()
        if req.stream:
            return await _stream(request, ctx, TokenRenderer(engine.tokenizer), gen, req, created)
        async for _ in gen.deltas():
            pass
        ctx.record(gen.choices)
        choices = [
            ChatChoice(
                index=st.index,
                message=AssistantMessage(content="".join(st.text)),
                logprobs=chat_logprobs(TokenRenderer(engine.tokenizer), st.logprobs)
                if req.logprobs
                else None,
                finish_reason=st.finish_reason,
            )
            for st in gen.choices
        ]
        body = ChatCompletionResponse(
            id=ctx.response_id,
            created=created,
            model=ctx.state.model_name,
            choices=choices,
            usage=usage_of(gen.choices),
        )
        return web.Response(text=body.model_dump_json(), content_type="application/json")
    finally:
        await gen.close()


async def _stream(
    request,
    ctx: RequestContext,
    renderer: TokenRenderer,
    gen: Generation,
    req: ChatCompletionRequest,
    created,
):
    resp = await sse.open_stream(request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse.event(
            ChatCompletionChunk(
                id=ctx.response_id, created=created, model=ctx.state.model_name, choices=choices, usage=usage
            )
        )

    try:
        try:
            # OpenAI opens every choice with a role-only delta; clients key message assembly on it.
            for st in gen.choices:
                await resp.write(
                    chunk([ChatChunkChoice(index=st.index, delta=DeltaMessage(role="assistant", content=""))])
                )
            async for st, out in gen.deltas():
                if not out.new_text and not out.finished and not out.new_logprobs:
                    continue  # e.g. a token held back because it may start a stop string
                lps = chat_logprobs(renderer, out.new_logprobs or []) if req.logprobs else None
                delta = DeltaMessage(content=out.new_text) if out.new_text else DeltaMessage()
                finish = out.finish_reason if out.finished else None
                await resp.write(
                    chunk([ChatChunkChoice(index=st.index, delta=delta, logprobs=lps, finish_reason=finish)])
                )
            ctx.record(gen.choices)
            if include_usage:
                await resp.write(chunk([], usage_of(gen.choices)))
        except TokenfleetError as e:  # e.g. the engine died mid-stream: the status line is already sent
            ctx.log_fields["error"] = str(e)
            await resp.write(sse_error_event(from_exception(e)))
        await resp.write(sse.DONE)
    except ConnectionResetError:  # the client went away; the caller's finally aborts what is left
        ctx.disconnected = True
    return resp
