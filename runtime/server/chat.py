"""POST /v1/chat/completions, streaming and not: messages (and tools) go through the model's chat template;
with tools the output is split into content and tool calls by the model's tool-call parser."""

from __future__ import annotations

from aiohttp import web
from tokenfleet.runtime.model.chat_template import template_supports_tools
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
from tokenfleet.runtime.openai.tool_parsers import parser_for_template
from tokenfleet.runtime.openai.tool_stream import ToolCallStream
from tokenfleet.runtime.openai.tools import ToolPlan, plan_tools, tool_call_delta, tool_calls_out
from tokenfleet.runtime.openai.translate import chat_params, fit_default_max_tokens, parse_request
from tokenfleet.runtime.server import sse
from tokenfleet.runtime.server.generation import ChoiceState
from tokenfleet.runtime.server.logprobs import chat_logprobs, prompt_logprobs_out
from tokenfleet.runtime.server.prompts import chat_prompt, dropped_headers, generation_defaults
from tokenfleet.runtime.server.request_context import RequestContext, usage_of
from tokenfleet.runtime.server.respond import respond
from tokenfleet.runtime.server.resume import StreamWire
from tokenfleet.runtime.server.start_generation import start_generation


def tool_plan(req: ChatCompletionRequest, tokenizer) -> ToolPlan:
    template = getattr(tokenizer, "chat_template", None) or ""
    return plan_tools(
        req, bool(template) and template_supports_tools(template), parser_for_template(template)
    )


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    # OpenAI reports a turn that ended by calling tools as "tool_calls".
    return "tool_calls" if made_calls and reason == "stop" else reason


async def handle(request: web.Request) -> web.StreamResponse:
    ctx = RequestContext.of(request)
    ctx.prefix = "chatcmpl"
    state = ctx.state
    engine = state.require_engine()
    wire, raw = StreamWire.read(request, await request.read())
    req = parse_request(ChatCompletionRequest, raw)
    lora = state.check_model(req.model)
    served = lora or state.model_name  # the response names the model (or adapter) that served it
    plan = tool_plan(req, engine.tokenizer)
    params = chat_params(req, generation_defaults(state, engine), plan.constraint)
    # A continuation carries the prompt as the first pod's engine saw it: no template, no truncation.
    prompt, dropped = wire.prompt(req.stream) or chat_prompt(
        state, engine, req, plan.tools, params.max_tokens
    )
    params = fit_default_max_tokens(params, req, [len(prompt.token_ids)], engine.max_model_len)
    gen, response_id, created, why_not, renderer = await start_generation(
        request, ctx, wire, req, [prompt], params, tools=plan.parser is not None, lora=lora
    )

    def message(st: ChoiceState) -> tuple[AssistantMessage, bool]:
        text = "".join(st.text)
        if plan.parser is None:
            return AssistantMessage(content=text), False
        parsed = plan.parser.parse(text)
        calls = parsed.calls if plan.parallel else parsed.calls[:1]
        return AssistantMessage(content=parsed.content, tool_calls=tool_calls_out(calls) or None), bool(calls)

    def body() -> ChatCompletionResponse:
        choices = []
        for st in gen.choices:
            msg, made_calls = message(st)
            lps = chat_logprobs(renderer, st.logprobs) if req.logprobs else None
            reason = _finish_reason(st.finish_reason, made_calls)
            choices.append(ChatChoice(index=st.index, message=msg, logprobs=lps, finish_reason=reason))
        scored = gen.prompt_logprobs(0) if req.prompt_logprobs is not None else None
        return ChatCompletionResponse(
            id=response_id,
            created=created,
            model=served,
            choices=choices,
            usage=usage_of(gen.choices),
            prompt_logprobs=None if scored is None else prompt_logprobs_out(renderer, scored),
        )

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse.event(
            ChatCompletionChunk(id=response_id, created=created, model=served, choices=choices, usage=usage)
        )

    text_events = sse.TextEvents(
        lambda index, text: ChatCompletionChunk(
            id=response_id,
            created=created,
            model=served,
            choices=[ChatChunkChoice(index=index, delta=DeltaMessage(content=text))],
        )
    )

    async def events():
        start = wire.start(response_id, created, prompt.token_ids, why_not)
        if wire.continuation is not None and start:  # the client already has the opening delta
            yield wire.alone(start)
        # OpenAI opens every choice with a role-only delta; clients key message assembly on it.
        for st in gen.choices if wire.continuation is None else ():
            role = DeltaMessage(role="assistant", content="")
            yield start + chunk([ChatChunkChoice(index=st.index, delta=role)])
            start = b""
        splitters = {
            st.index: ToolCallStream(plan.parser, plan.parallel) for st in gen.choices if plan.parser
        }
        async for st, out in gen.deltas():
            progress = wire.progress(out.new_token_ids, out.new_text, out.num_cached_tokens)
            text, calls = out.new_text, []
            splitter = splitters.get(st.index)
            if splitter is not None:
                first = len(splitter.calls)
                text, calls = splitter.feed(out.new_text)
                if out.finished:
                    rest, more = splitter.finish()
                    text, calls = text + rest, calls + more
                calls = [tool_call_delta(first + i, c) for i, c in enumerate(calls)]
            if not text and not calls and not out.finished and not out.new_logprobs:
                if progress:  # the router still learns the token ids
                    yield wire.alone(progress)
                continue  # e.g. a token held back because it may start a stop string or a tool call
            lps = chat_logprobs(renderer, out.new_logprobs or []) if req.logprobs else None
            if text and not calls and lps is None and not out.finished:  # the common event, pre-serialised
                yield progress + text_events.event(st.index, text)
                continue
            delta = DeltaMessage(content=text or None, tool_calls=calls or None)
            finish = None
            if out.finished:
                finish = _finish_reason(out.finish_reason, bool(splitter and splitter.calls))
            yield progress + chunk(
                [ChatChunkChoice(index=st.index, delta=delta, logprobs=lps, finish_reason=finish)]
            )
        ctx.record(gen.choices)
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage_of(gen.choices))

    events = wire.handed_off(request, events)
    return await respond(request, ctx, gen, req.stream, events, body, dropped_headers(dropped))
