"""The part of a generation request that chat and completions share once their prompts and sampling
parameters are known: compile the grammar, build the engine requests (`Generation`), and fix the
response's identity (id, created, whether the stream can be resumed elsewhere)."""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

from aiohttp import web
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.openai.translate import Prompt
from tokenfleet.runtime.server.generation import Generation
from tokenfleet.runtime.server.logprobs import TokenRenderer
from tokenfleet.runtime.server.request_context import RequestContext, request_priority, request_tenant
from tokenfleet.runtime.server.resume import StreamWire, speculative, why_not_resumable


class Started(NamedTuple):
    """Unpacked by the handlers in one line."""

    gen: Generation
    response_id: str
    created: int
    why_not_resumable: str | None  # None: a broken stream can be continued exactly on another pod
    renderer: TokenRenderer  # token ids -> text, for logprobs


async def start_generation(
    request: web.Request,
    ctx: RequestContext,
    wire: StreamWire,
    req,
    prompts: list[Prompt],
    params: SamplingParams,
    tools: bool,
    lora: str | None = None,
) -> Started:
    """`req`: the validated chat or completion request (its `priority` and `cache_salt`). A bad grammar
    raises here, before any engine request exists (a 400)."""
    state = ctx.state
    engine = state.require_engine()
    if lora is not None:  # read from its path first if it is not in host memory (files: off the loop)
        await asyncio.to_thread(state.lora.ensure_loaded, lora)
    if params.structured_output is not None:
        await engine.compile_grammar(params.structured_output)
    gen = Generation(
        engine,
        state.metrics,
        ctx.engine_base_id,
        prompts,
        params,
        request_priority(request, req.priority, "priority" in req.model_fields_set),
        req.cache_salt,
        wire.resume_from(params, engine),
        request_tenant(request),
        lora,
    )
    return Started(
        gen=gen,
        response_id=wire.response_id(ctx.response_id),
        created=wire.created(int(time.time())),
        why_not_resumable=why_not_resumable(
            params, len(prompts), tools=tools, speculative=speculative(state)
        ),
        renderer=TokenRenderer(engine.tokenizer),
    )
