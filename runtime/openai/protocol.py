"""Pydantic models of the OpenAI API surface we serve: requests (validated strictly) and responses.

Requests are parsed with `model_validate_json` in strict mode: a string where a number belongs is a 400,
as with OpenAI, rather than silently coerced. Unknown fields are ignored (clients and SDKs send fields
we do not act on, e.g. `service_tier`), but fields whose meaning we cannot honour are rejected by name in
`unsupported_fields` instead of being dropped silently. vLLM's sampling extensions (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `priority`, `cache_salt`, ...) are
accepted so existing vLLM clients work unmodified.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

NonNegInt = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    # `schema` would shadow a BaseModel attribute; the wire name stays `schema`.
    json_schema: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` (the successor of its guided_* fields): exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions. Range checks live in SamplingParams."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    # Constrained output: OpenAI's response_format, and vLLM's `structured_outputs` extension.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM extension: each prompt token's logprob (+ this many alternatives), returned as `prompt_logprobs`.
    prompt_logprobs: int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 only with echo: the prompt alone comes back (scored, with logprobs)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    """A tool call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    # Unknown roles fail here with a 400 naming `messages.N.role`.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool


class FunctionDefinition(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True


# --- responses -------------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    """The legacy completions shape: parallel lists, one entry per token (with `echo`, the prompt's tokens
    first; its first token has no logprob, null, as nothing precedes it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's Logprob as its server writes it in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs`: null for the first prompt token, then {token id: PromptLogprob} per prompt token
# (the token itself and the top alternatives).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class _OmitsNoPromptLogprobs(_Response):
    """`prompt_logprobs` (a vLLM extension) appears only when asked for."""

    @model_serializer(mode="wrap")
    def _omit_empty_prompt_logprobs(self, handler):
        data = handler(self)
        if data.get("prompt_logprobs") is None:
            data.pop("prompt_logprobs", None)
        return data


class CompletionChoice(_OmitsNoPromptLogprobs):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob]


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class _OmitsNoToolCalls(_Response):
    """`tool_calls` is left out rather than sent as null when there are none (as OpenAI does)."""

    @model_serializer(mode="wrap")
    def _omit_empty_tool_calls(self, handler):
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class AssistantMessage(_OmitsNoToolCalls):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_OmitsNoPromptLogprobs):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    # One prompt for all the choices: vLLM puts its logprobs beside them.
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """One streamed piece of tool call `index`: the first carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_OmitsNoToolCalls):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenfleet"
    max_model_len: int
    # vLLM's fields: where the weights come from, and for a LoRA adapter the model it runs on.
    root: str | None = None
    parent: str | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
