"""Tool-call parsers, chosen by name from a registry (`TOOL_PARSERS`), or from the chat template."""

from __future__ import annotations

from tokenfleet.runtime.openai.tool_parsers.base import ParsedCall, ParseResult, ToolParser
from tokenfleet.runtime.openai.tool_parsers.hermes import HermesToolParser
from tokenfleet.runtime.openai.tool_parsers.json_calls import JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    JsonToolParser.name: JsonToolParser,
}


def parser_for_template(chat_template: str) -> ToolParser:
    """The format the model was trained on, as its template renders earlier calls."""
    if "<tool_call>" in chat_template:
        return HermesToolParser()
    return JsonToolParser()


__all__ = ["TOOL_PARSERS", "ParseResult", "ParsedCall", "ToolParser", "parser_for_template"]
