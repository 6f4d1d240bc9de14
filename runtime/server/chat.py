"""POST /v1/chat/completions, streaming and not: messages (and tools) go through the model's chat template;
with tools the output is split into content and tool calls by the model's tool-call parser."""

from __future__ import annotations

import time

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
from tokenfleet.runtime.openai.translate import chat_params, parse_request
from tokenfleet.runtime.server import sse
from tokenfleet.runtime.server.generation import ChoiceState, Generation
from tokenfleet.runtime.server.logprobs import TokenRenderer, chat_logprobs
from tokenfleet.runtime.server.prompts import chat_prompt, dropped_headers, generation_defaults
from tokenfleet.runtime.server.request_context import RequestContext, request_priority, usage_of
from tokenfleet.runtime.server.respond import respond


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
    req = parse_request(ChatCompletionRequest, await request.read())
    state.check_model(req.model)
    plan = tool_plan(req, engine.tokenizer)
    params = chat_params(req, generation_defaults(state, engine), plan.constraint)
    prompt, dropped = chat_prompt(state, engine, req, plan.tools, params.max_tokens)
    if params.structured_output is not None:
        await engine.compile_grammar(params.structured_output)
    gen = Generation(
        engine,
        state.metrics,
        ctx.engine_base_id,
        [prompt],
        params,
        request_priority(request, req.priority, "priority" in req.model_fields_set),
        req.cache_salt,
    )
    created = int(time.time())
    renderer = TokenRenderer(engine.tokenizer)

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
        return ChatCompletionResponse(
            id=ctx.response_id,
            created=created,
            model=state.model_name,
            choices=choices,
            usage=usage_of(gen.choices),
        )

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse.event(
            ChatCompletionChunk(
                id=ctx.response_id, created=created, model=state.model_name, choices=choices, usage=usage
            )
        )

    async def events():
        # OpenAI opens every choice with a role-only delta; clients key message assembly on it.
        for st in gen.choices:
            yield chunk([ChatChunkChoice(index=st.index, delta=DeltaMessage(role="assistant", content=""))])
        splitters = {
            st.index: ToolCallStream(plan.parser, plan.parallel) for st in gen.choices if plan.parser
        }
        async for st, out in gen.deltas():
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
                continue  # e.g. a token held back because it may start a stop string or a tool call
            lps = chat_logprobs(renderer, out.new_logprobs or []) if req.logprobs else None
            delta = DeltaMessage(content=text or None, tool_calls=calls or None)
            finish = None
            if out.finished:
                finish = _finish_reason(out.finish_reason, bool(splitter and splitter.calls))
            yield chunk([ChatChunkChoice(index=st.index, delta=delta, logprobs=lps, finish_reason=finish)])
        ctx.record(gen.choices)
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage_of(gen.choices))

    return await respond(request, ctx, gen, req.stream, events, body, dropped_headers(dropped))
