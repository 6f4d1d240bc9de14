"""Pure translation of validated OpenAI requests into engine inputs (token ids + SamplingParams).

Everything here is synchronous and side-effect free so it can be unit-tested without a server or a model:
the tokenizer is passed in (anything with `encode`, `decode` and `apply_chat_template`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.errors import InvalidRequest
from tokenfleet.runtime.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

M = TypeVar("M", bound=BaseModel)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = ...) -> str: ...


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


def _base_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported", param="logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    # SamplingParams validates every range (n, temperature, top_p, max_tokens, ...) with `param` set.
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
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
        skip_special_tokens=req.skip_special_tokens,
    )


def completion_params(req: CompletionRequest) -> SamplingParams:
    if req.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("best_of different from n is not supported", param="best_of")
    if req.echo and req.logprobs is not None:
        raise InvalidRequest("echo together with logprobs (prompt logprobs) is not supported", param="echo")
    return _base_params(req, req.max_tokens, req.logprobs)


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    if req.tools:
        raise InvalidRequest("tools are not supported by this server", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise InvalidRequest("only response_format {'type': 'text'} is supported", param="response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return _base_params(req, max_tokens, logprobs)


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """Parameters of engine request `choice` of an n-way request: n=1, and seed+i so choices differ."""
    seed = None if params.seed is None else params.seed + choice
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
        entry = {"role": role, "content": content}
        if msg.name:
            entry["name"] = msg.name
        out.append(entry)
    return out


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer) -> Prompt:
    text = tokenizer.apply_chat_template(chat_messages(req), add_generation_prompt=req.add_generation_prompt)
    # The template already contains the special tokens (BOS, role markers); do not add them twice.
    return Prompt(tokenizer.encode(text, add_special_tokens=False), text)
