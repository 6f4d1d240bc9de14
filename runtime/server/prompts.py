"""From a validated request to what the engine runs: the model's sampling defaults, the rendered prompt and
the context policy (`model.context_overflow`).

`reject` leaves an overlong prompt to the engine's admission check (a 400 naming the limit); `truncate`
fits it (runtime/openai/truncation.py), and the number of prompt tokens dropped is reported in the
response header `x-tokenfleet-prompt-tokens-dropped` and the `prompt_tokens_truncated` counter.
"""

from __future__ import annotations

from dataclasses import replace

from tokenfleet.runtime.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenfleet.runtime.openai.translate import Prompt, chat_messages, completion_prompts, render_chat
from tokenfleet.runtime.openai.truncation import fit_chat, fit_tokens, prompt_budget
from tokenfleet.runtime.server.state import ServerState

DROPPED_HEADER = "x-tokenfleet-prompt-tokens-dropped"


def generation_defaults(state: ServerState, engine) -> dict[str, float]:
    """The checkpoint's sampling defaults, unless `model.generation_config` is `none`, and the `max_tokens`
    of a request that sets none: the smaller of the checkpoint's `max_new_tokens` and the server's
    `model.default_max_tokens` (absent: up to the context, OpenAI's behaviour)."""
    model = state.config.model
    found: dict[str, float] = {}
    if model.generation_config != "none":
        loaded = getattr(getattr(engine, "core", None), "loaded", None)
        defaults = getattr(loaded, "generation_defaults", None)
        found = defaults.as_dict() if defaults is not None else {}
    bounds = [b for b in (found.get("max_tokens"), model.default_max_tokens) if b is not None]
    if bounds:
        found["max_tokens"] = min(bounds)
    return found


def _truncating(state: ServerState) -> bool:
    return state.config.model.context_overflow == "truncate"


def chat_prompt(
    state: ServerState, engine, req: ChatCompletionRequest, tools: list[dict] | None, max_tokens: int | None
) -> tuple[Prompt, int]:
    """The rendered chat prompt and how many of its tokens the context policy dropped."""
    tokenizer = engine.tokenizer
    messages = chat_messages(req)

    def render(msgs: list[dict]) -> tuple[list[int], str]:
        p = render_chat(msgs, tokenizer, req.add_generation_prompt, tools)
        return p.token_ids, p.text

    if not _truncating(state):
        ids, text = render(messages)
        return Prompt(ids, text), 0
    fitted = fit_chat(messages, render, prompt_budget(engine.max_model_len, max_tokens))
    if fitted.num_dropped_tokens:
        state.metrics.observe_truncated(fitted.num_dropped_tokens)
    return Prompt(fitted.token_ids, fitted.text), fitted.num_dropped_tokens


def completion_prompt_list(
    state: ServerState, engine, req: CompletionRequest, max_tokens: int | None
) -> tuple[list[Prompt], int]:
    tokenizer = engine.tokenizer
    prompts = completion_prompts(req, tokenizer)
    if not _truncating(state):
        return prompts, 0
    budget = prompt_budget(engine.max_model_len, max_tokens)
    bos = getattr(tokenizer, "bos_token_id", None)
    out, dropped = [], 0
    for p in prompts:
        ids, n = fit_tokens(p.token_ids, budget, bos)
        out.append(replace(p, token_ids=ids, text=tokenizer.decode(ids)) if n else p)
        dropped += n
    if dropped:
        state.metrics.observe_truncated(dropped)
    return out, dropped


def dropped_headers(num_dropped: int) -> dict[str, str]:
    return {DROPPED_HEADER: str(num_dropped)} if num_dropped else {}
