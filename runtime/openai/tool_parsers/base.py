"""ToolParser: how one model family writes tool calls in its output, both ways.

- reading: `find_start(text)` says where tool-call output begins (None: not yet), `complete_calls(region)`
  returns the calls already closed in it (streaming), `parse(text)` splits a whole output into content
  and calls;
- writing: `constraint(tools, forced, parallel)` is the grammar that makes the model emit exactly that
  format, used for `tool_choice: required` and a named function (so a forced call is always parseable).

Arguments are kept as JSON text (what OpenAI's `function.arguments` carries).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True, slots=True)
class ParseResult:
    content: str | None
    calls: tuple[ParsedCall, ...]


def call_from_json(obj: Any) -> ParsedCall | None:
    """{"name": ..., "arguments"|"parameters": {...}} -> ParsedCall; anything else -> None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode; keep it if it is JSON
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


class ToolParser:
    name: ClassVar[str]

    def find_start(self, text: str) -> int | None:
        raise NotImplementedError

    def holdback(self, text: str) -> int:
        """Trailing characters of `text` that could still turn out to start tool-call output."""
        return 0

    def complete_calls(self, region: str) -> list[ParsedCall]:
        return []

    def parse(self, text: str) -> ParseResult:
        raise NotImplementedError

    def constraint(self, tools: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
        """At least one call to one of `tools` (just one unless `parallel`), in this parser's format."""
        raise NotImplementedError
