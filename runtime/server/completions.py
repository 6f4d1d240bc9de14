"""POST /v1/completions (legacy text completions), streaming and not."""

from __future__ import annotations

import time

from aiohttp import web
from tokenfleet.runtime.errors import TokenfleetError
from tokenfleet.runtime.server import sse
from tokenfleet.runtime.server.errors import from_exception, sse_error_event
from tokenfleet.runtime.server.generation import Generation
from tokenfleet.runtime.server.logprobs import TokenRenderer, completion_logprobs
from tokenfleet.runtime.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from tokenfleet.runtime.server.request_context import RequestContext, request_priority, usage_of
from tokenfleet.runtime.openai.translate import completion_params, completion_prompts, parse_request


async def handle(request: web.Request) -> web.StreamResponse:
    ctx = RequestContext.of(request)
    engine = ctx.state.require_engine()
    req = parse_request(CompletionRequest, await request.read())
    ctx.state.check_model(req.model)
    params = completion_params(req)
    prompts = completion_prompts(req, engine.tokenizer)
    gen = Generation(
        engine,
        ctx.state.metrics,
        ctx.engine_base_id,
        prompts,
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
        renderer = TokenRenderer(engine.tokenizer)
        choices = []
        for st in gen.choices:
            echo = prompts[st.prompt_index].text if req.echo else ""
            lps = None
            if req.logprobs is not None:
                lps = completion_logprobs(renderer, st.logprobs, len(echo))
            choices.append(
                CompletionChoice(
                    index=st.index, text=echo + "".join(st.text), logprobs=lps, finish_reason=st.finish_reason
                )
            )
        body = CompletionResponse(
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
    req: CompletionRequest,
    created: int,
):
    resp = await sse.open_stream(request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    offsets = [0] * len(gen.choices)  # running character offsets, for logprobs' text_offset

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return sse.event(
            CompletionResponse(
                id=ctx.response_id, created=created, model=ctx.state.model_name, choices=choices, usage=usage
            )
        )

    try:
        try:
            if req.echo:
                for st in gen.choices:
                    text = gen.prompts[st.prompt_index].text
                    offsets[st.index] = len(text)
                    await resp.write(chunk([CompletionChoice(index=st.index, text=text)]))
            async for st, out in gen.deltas():
                if not out.new_text and not out.finished and not out.new_logprobs:
                    continue  # e.g. a token held back because it may start a stop string
                lps = None
                if req.logprobs is not None:
                    lps = completion_logprobs(renderer, out.new_logprobs or [], offsets[st.index])
                    offsets[st.index] += sum(len(t) for t in lps.tokens)
                finish = out.finish_reason if out.finished else None
                await resp.write(
                    chunk(
                        [
                            CompletionChoice(
                                index=st.index, text=out.new_text, logprobs=lps, finish_reason=finish
                            )
                        ]
                    )
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
