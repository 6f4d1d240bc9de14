"""Pure translation of validated OpenAI requests into engine inputs (token ids + SamplingParams).

Everything here is synchronous and side-effect free so it can be unit-tested without a server or a model:
the tokenizer is passed in (anything with `encode`, `decode` and `apply_chat_template`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec
from tokenfleet.runtime.errors import InvalidRequest
from tokenfleet.runtime.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

M = TypeVar("M", bound=BaseModel)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = ..., **extra: Any
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt as the engine sees it; `text` is what `echo` prepends."""

    token_ids: list[int]
    text: str


def parse_request(model: type[M], body: bytes) -> M:
    """Validate a JSON body; any failure becomes InvalidRequest naming the first offending field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise InvalidRequest(f"Malformed JSON body: {first['msg']}") from None
        if first["type"] == "model_type" and not first["loc"]:
            raise InvalidRequest("The request body must be a JSON object.") from None
        # Union members add their type names to `loc`; the field path is what the user needs.
        details = "; ".join(f"{_loc(err['loc'])}: {err['msg']}" for err in errors[:3])
        param = str(first["loc"][0]) if first["loc"] else None
        raise InvalidRequest(f"Invalid request: {details}", param=param) from None


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "body"


# Sampling fields a model's generation defaults may supply (vLLM's `--generation-config auto`).
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def _sampling_value(req: SamplingFields, name: str, defaults: Mapping[str, float]) -> Any:
    """The request's value when it set the field, else the model's default, else OpenAI's neutral value."""
    if name in req.model_fields_set and getattr(req, name) is not None:
        return getattr(req, name)
    return defaults.get(name, _NEUTRAL[name])


def structured_output_spec(req: SamplingFields) -> GrammarSpec | None:
    """The grammar `response_format` / `structured_outputs` ask for (at most one of them may)."""
    specs: list[GrammarSpec] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        specs.append(GrammarSpec.json_object())
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise InvalidRequest("response_format json_schema needs `json_schema`", param="response_format")
        # Unset `strict` compiles strictly (no properties beyond the schema's unless it allows them), as
        # vLLM does through xgrammar: clients such as instructor send a schema without `strict` and expect
        # an answer that validates against it. Only an explicit `strict: false` opens the objects.
        strict = rf.json_schema.strict is not False
        specs.append(GrammarSpec.json_schema(rf.json_schema.json_schema, strict=strict))
    so = req.structured_outputs
    if so is not None:
        given = {k: v for k, v in so.model_dump(by_alias=True).items() if v is not None}
        if len(given) != 1:
            raise InvalidRequest(
                "structured_outputs takes exactly one of json, regex, choice, grammar, structural_tag",
                param="structured_outputs",
            )
        kind, value = next(iter(given.items()))
        if kind == "json":
            specs.append(GrammarSpec.json_schema(json.loads(value) if isinstance(value, str) else value))
        elif kind == "regex":
            specs.append(GrammarSpec.regex(value))
        elif kind == "choice":
            specs.append(GrammarSpec.choice(value))
        elif kind == "grammar":
            specs.append(GrammarSpec.grammar(value))
        else:
            specs.append(GrammarSpec.structural_tag(json.loads(value) if isinstance(value, str) else value))
    if len(specs) > 1:
        raise InvalidRequest(
            "set response_format or structured_outputs, not both", param="structured_outputs"
        )
    return specs[0] if specs else None


def _base_params(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: Mapping[str, float],
    grammar: GrammarSpec | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported", param="logit_bias")
    if req.prompt_logprobs is not None and req.stream:
        # As vLLM: the prompt's logprobs belong to the whole response, not to a stream of deltas.
        raise InvalidRequest("prompt_logprobs is not supported with stream=true", param="prompt_logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if max_tokens is None:
        # The model's / server's bound (`max_tokens` in the defaults, see `server/prompts.py`);
        # `fit_default_max_tokens` later shrinks it to the context the prompt leaves.
        default = defaults.get("max_tokens")
        max_tokens = None if default is None else int(default)
    # SamplingParams validates every range (n, temperature, top_p, max_tokens, ...) with `param` set.
    return SamplingParams(
        n=req.n,
        temperature=_sampling_value(req, "temperature", defaults),
        top_p=_sampling_value(req, "top_p", defaults),
        top_k=_sampling_value(req, "top_k", defaults),
        min_p=_sampling_value(req, "min_p", defaults),
        repetition_penalty=_sampling_value(req, "repetition_penalty", defaults),
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        structured_output=grammar,
    )


def completion_params(req: CompletionRequest, defaults: Mapping[str, float] | None = None) -> SamplingParams:
    if req.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("best_of different from n is not supported", param="best_of")
    max_tokens = req.max_tokens
    if max_tokens == 0:
        if not req.echo:
            raise InvalidRequest("max_tokens must be >= 1 (0 only with echo=true)", param="max_tokens")
        # Echo without generation (scoring a text): the engine samples one token, which the response drops
        # (as vLLM does); its prompt is what comes back.
        max_tokens = 1
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        if req.stream:
            raise InvalidRequest(
                "echo with logprobs (the prompt's logprobs) is not supported with stream=true", param="echo"
            )
        # The echoed prompt's tokens carry logprobs too: score the prompt with as many alternatives.
        prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
    return _base_params(
        req, max_tokens, req.logprobs, defaults or {}, structured_output_spec(req), prompt_logprobs
    )


def chat_params(
    req: ChatCompletionRequest,
    defaults: Mapping[str, float] | None = None,
    tool_constraint: GrammarSpec | None = None,
) -> SamplingParams:
    """`tool_constraint`: the grammar of a forced tool call (tool_choice required / named), if any."""
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = requested_max_tokens(req)
    grammar = structured_output_spec(req)
    if grammar is not None and tool_constraint is not None:
        raise InvalidRequest(
            "a forced tool call cannot be combined with response_format / structured_outputs",
            param="tool_choice",
        )
    return _base_params(
        req, max_tokens, logprobs, defaults or {}, grammar or tool_constraint, req.prompt_logprobs
    )


def requested_max_tokens(req: SamplingFields) -> int | None:
    """The output length the request itself asks for (chat: `max_completion_tokens` over `max_tokens`)."""
    value = getattr(req, "max_completion_tokens", None)
    return value if value is not None else req.max_tokens


def fit_default_max_tokens(
    params: SamplingParams, req: SamplingFields, prompt_lengths: list[int], max_model_len: int
) -> SamplingParams:
    """A default `max_tokens` (the request set none) shrinks to the context left after the longest prompt,
    as vLLM's does: a default must never turn a prompt that fits into a 400. One the request set stays
    (admission refuses it when prompt + max_tokens exceed the context, as OpenAI does)."""
    if requested_max_tokens(req) is not None or params.max_tokens is None or not prompt_lengths:
        return params
    room = max_model_len - max(prompt_lengths)
    if room < 1 or params.max_tokens <= room:
        return params  # fits, or the prompt alone fills the context (admission names that)
    return replace(params, max_tokens=room)


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """Parameters of engine request `choice` of an n-way request: n=1, and seed+i so choices differ. The
    choices share their prompt: only the first scores it (prompt logprobs)."""
    seed = None if params.seed is None else params.seed + choice
    if choice:
        return replace(params, n=1, seed=seed, prompt_logprobs=None)
    return replace(params, n=1, seed=seed)


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer) -> list[Prompt]:
    """A completions `prompt` is a string, a list of strings, a token list, or a list of token lists."""
    raw = req.prompt
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [list(raw)]  # type: ignore[arg-type]
    else:
        items = list(raw)  # type: ignore[arg-type]
    if not items:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            # As vLLM and the offline LLM do: a raw completion prompt gets the tokenizer's own special
            # tokens (e.g. BOS); chat prompts already carry them from the template.
            ids = tokenizer.encode(item, add_special_tokens=True)
            prompts.append(Prompt(ids, item))
        else:
            prompts.append(Prompt(list(item), tokenizer.decode(list(item))))
        if not prompts[-1].token_ids:
            raise InvalidRequest("prompt must contain at least one token", param="prompt")
    return prompts


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as chat templates expect them: plain-string content, `developer` folded into `system`."""
    out = []
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, list):
            texts = []
            for j, part in enumerate(msg.content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(
                        f"content part type {part.type!r} is not supported; only 'text' parts are",
                        param=f"messages.{i}.content.{j}.type",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = msg.content or ""
        # OpenAI renamed `system` to `developer` for newer models; the templates we load know `system`.
        role = "system" if msg.role == "developer" else msg.role
        entry: dict[str, Any] = {"role": role, "content": content}
        if msg.name:
            entry["name"] = msg.name
        if msg.tool_calls:
            # HF templates (Qwen, Hermes, Llama 3) render arguments as a mapping (`arguments | tojson`).
            entry["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": _arguments(tc.function.arguments, i)},
                }
                for tc in msg.tool_calls
            ]
        if msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        out.append(entry)
    return out


def _arguments(text: str, i: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise InvalidRequest(
            "tool call arguments must be JSON text", param=f"messages.{i}.tool_calls"
        ) from None


def render_chat(
    messages: list[dict], tokenizer: Tokenizer, add_generation_prompt: bool, tools: list[dict] | None
) -> Prompt:
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    # The template already contains the special tokens (BOS, role markers); do not add them twice.
    return Prompt(tokenizer.encode(text, add_special_tokens=False), text)


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer, tools: list[dict] | None = None) -> Prompt:
    return render_chat(chat_messages(req), tokenizer, req.add_generation_prompt, tools)
