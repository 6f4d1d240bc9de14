"""POST /v1/completions (legacy text completions), streaming and not."""

from __future__ import annotations

from dataclasses import replace

from aiohttp import web
from tokenfleet.runtime.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from tokenfleet.runtime.openai.translate import completion_params, fit_default_max_tokens, parse_request
from tokenfleet.runtime.server import sse
from tokenfleet.runtime.server.logprobs import (
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_out,
    with_top,
)
from tokenfleet.runtime.server.prompts import completion_prompt_list, dropped_headers, generation_defaults
from tokenfleet.runtime.server.request_context import RequestContext, usage_of
from tokenfleet.runtime.server.respond import respond
from tokenfleet.runtime.server.resume import StreamWire
from tokenfleet.runtime.server.start_generation import start_generation


async def handle(request: web.Request) -> web.StreamResponse:
    ctx = RequestContext.of(request)
    state = ctx.state
    engine = state.require_engine()
    wire, raw = StreamWire.read(request, await request.read())
    req = parse_request(CompletionRequest, raw)
    lora = state.check_model(req.model)
    served = lora or state.model_name  # the response names the model (or adapter) that served it
    params = completion_params(req, generation_defaults(state, engine))
    prompts, dropped = completion_prompt_list(state, engine, req, params.max_tokens)
    continued = wire.prompt(req.stream)
    if continued is not None:  # the prompt ids as the first pod's engine had them; the text for `echo`
        prompts, dropped = [replace(prompts[0], token_ids=continued[0].token_ids)], 0
    params = fit_default_max_tokens(params, req, [len(p.token_ids) for p in prompts], engine.max_model_len)
    gen, response_id, created, why_not, renderer = await start_generation(
        request, ctx, wire, req, prompts, params, tools=False, lora=lora
    )

    def response(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=response_id, created=created, model=served, choices=choices, usage=usage)

    # Echo without generation (max_tokens 0): the engine sampled one token; it is not part of the answer.
    echo_only = req.max_tokens == 0

    def body() -> CompletionResponse:
        choices = []
        for st in gen.choices:
            prompt = prompts[st.prompt_index]
            scored = gen.prompt_logprobs(st.prompt_index)
            echo = prompt.text if req.echo else ""
            lps = None
            if req.logprobs is not None:
                lps = completion_logprobs(renderer, [] if echo_only else st.logprobs, len(echo))
                if req.echo and scored is not None:
                    prompt_part = echo_logprobs(renderer, prompt.token_ids, with_top(scored, req.logprobs))
                    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(prompt_part, name).extend(getattr(lps, name))
                    lps = prompt_part
            prompt_lps = None
            if req.prompt_logprobs is not None and scored is not None:
                prompt_lps = prompt_logprobs_out(renderer, with_top(scored, req.prompt_logprobs))
            choices.append(
                CompletionChoice(
                    index=st.index,
                    text=echo + ("" if echo_only else "".join(st.text)),
                    logprobs=lps,
                    finish_reason="length" if echo_only else st.finish_reason,
                    prompt_logprobs=prompt_lps,
                )
            )
        return response(choices, usage())

    def usage() -> Usage:
        counted = usage_of(gen.choices)
        if echo_only:  # nothing generated reached the client
            return counted.model_copy(update={"completion_tokens": 0, "total_tokens": counted.prompt_tokens})
        return counted

    text_events = sse.TextEvents(lambda index, text: response([CompletionChoice(index=index, text=text)]))

    async def events():
        offsets = [0] * len(gen.choices)  # running character offsets, for logprobs' text_offset
        start = wire.start(response_id, created, prompts[0].token_ids, why_not)
        if wire.continuation is not None:  # the client already has the echo and this much text
            offsets[0] = wire.continuation.num_delivered_chars + (len(prompts[0].text) if req.echo else 0)
        elif req.echo:
            for st in gen.choices:
                text = prompts[st.prompt_index].text
                offsets[st.index] = len(text)
                yield start + sse.event(response([CompletionChoice(index=st.index, text=text)]))
                start = b""
        if start:
            yield wire.alone(start)
        async for st, out in gen.deltas():
            progress = wire.progress(out.new_token_ids, out.new_text, out.num_cached_tokens)
            if echo_only:  # the echo went out first; the token sampled after it is not part of the answer
                if out.finished:
                    choice = CompletionChoice(index=st.index, text="", finish_reason="length")
                    yield progress + sse.event(response([choice]))
                elif progress:
                    yield wire.alone(progress)
                continue
            if not out.new_text and not out.finished and not out.new_logprobs:
                if progress:  # the router still learns the token ids
                    yield wire.alone(progress)
                continue  # e.g. a token held back because it may start a stop string
            lps = None
            if req.logprobs is not None:
                lps = completion_logprobs(renderer, out.new_logprobs or [], offsets[st.index])
                offsets[st.index] += sum(len(t) for t in lps.tokens)
            if lps is None and not out.finished:  # the common event: its envelope serialised once
                yield progress + text_events.event(st.index, out.new_text)
                continue
            finish = out.finish_reason if out.finished else None
            choice = CompletionChoice(index=st.index, text=out.new_text, logprobs=lps, finish_reason=finish)
            yield progress + sse.event(response([choice]))
        ctx.record(gen.choices)
        if req.stream_options and req.stream_options.include_usage:
            yield sse.event(response([], usage()))

    events = wire.handed_off(request, events)
    return await respond(request, ctx, gen, req.stream, events, body, dropped_headers(dropped))
