"""Tool calling, request side: what a chat request's `tools` / `tool_choice` mean for this model.

Pure: the caller says whether the model's chat template renders tools, and which parser reads the model's
format. `plan_tools` validates the request and returns the ToolPlan the handler follows: the tools to
render, the parser for the output (None: output is text), and the grammar forcing a call (`required`, or
a named function) in the model's own format.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec
from tokenfleet.runtime.errors import InvalidRequest
from tokenfleet.runtime.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    NamedToolChoice,
    ToolCall,
)
from tokenfleet.runtime.openai.tool_parsers import ParsedCall, ToolParser


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # rendered by the chat template; None = no tools
    parser: ToolParser | None  # None: the output is plain content
    constraint: GrammarSpec | None  # forces a call: tool_choice required / named
    parallel: bool


NO_TOOLS = ToolPlan(None, None, None, True)


def plan_tools(req: ChatCompletionRequest, supports_tools: bool, parser: ToolParser) -> ToolPlan:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs a non-empty `tools` list", param="tool_choice")
        return NO_TOOLS
    if not supports_tools:
        raise InvalidRequest(
            "this model's chat template does not support tools (it never renders a `tools` variable); "
            "describe the tools in a message, or serve a model whose template supports them",
            param="tools",
        )
    tools = [t.model_dump(mode="json", exclude_none=True) for t in req.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool function names must be unique", param="tools")
    parallel = req.parallel_tool_calls
    if choice == "none":
        return ToolPlan(tools, None, None, parallel)
    if choice is None or choice == "auto":
        return ToolPlan(tools, parser, None, parallel)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not in `tools`", param="tool_choice")
        return ToolPlan(tools, parser, parser.constraint([tools[names.index(name)]], False), False)
    return ToolPlan(tools, parser, parser.constraint(tools, parallel), parallel)  # required


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_out(calls: list[ParsedCall] | tuple[ParsedCall, ...]) -> list[ToolCall]:
    return [
        ToolCall(id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def tool_call_delta(index: int, call: ParsedCall) -> DeltaToolCall:
    """A whole call in one streamed piece (OpenAI clients concatenate `arguments` over pieces)."""
    return DeltaToolCall(
        index=index,
        id=new_call_id(),
        type="function",
        function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
    )
