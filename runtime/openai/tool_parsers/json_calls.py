"""Plain JSON format: the whole output is one call `{"name": ..., "arguments": {...}}` (or "parameters",
as Llama 3.x templates write it) or a JSON list of them; anything else is text."""

from __future__ import annotations

import json
from typing import Any

from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec
from tokenfleet.runtime.openai.tool_parsers.base import (
    ParseResult,
    ToolParser,
    call_from_json,
    parameters_schema,
)


class JsonToolParser(ToolParser):
    name = "json"

    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped[:1] in ("{", "["):
            return len(text) - len(stripped)
        return None

    def holdback(self, text: str) -> int:
        # Leading whitespace: the output may still turn out to be JSON.
        return len(text) if not text.strip() else 0

    def parse(self, text: str) -> ParseResult:
        if self.find_start(text) is None:
            return ParseResult(text, ())
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return ParseResult(text, ())
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_from_json(item) for item in items]
        if not calls or any(c is None for c in calls):
            return ParseResult(text, ())
        return ParseResult(None, tuple(c for c in calls if c is not None))

    def constraint(self, tools: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
        one_of = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": parameters_schema(t),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        call = one_of[0] if len(one_of) == 1 else {"anyOf": one_of}
        schema = {"type": "array", "minItems": 1, "items": call} if parallel else call
        return GrammarSpec.json_schema(schema)
