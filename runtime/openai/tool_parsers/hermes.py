"""Hermes / Qwen format: each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
after optional free text (Hermes-2-Pro, Qwen2 / Qwen2.5 / Qwen3 chat templates)."""

from __future__ import annotations

import json
import re
from typing import Any

from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec
from tokenfleet.runtime.openai.tool_parsers.base import (
    ParsedCall,
    ParseResult,
    ToolParser,
    call_from_json,
    parameters_schema,
)

START = "<tool_call>"
END = "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)


def _load(body: str) -> ParsedCall | None:
    try:
        return call_from_json(json.loads(body))
    except json.JSONDecodeError:
        return None


class HermesToolParser(ToolParser):
    name = "hermes"

    def find_start(self, text: str) -> int | None:
        i = text.find(START)
        return None if i < 0 else i

    def holdback(self, text: str) -> int:
        for n in range(min(len(START) - 1, len(text)), 0, -1):
            if START.startswith(text[-n:]):
                return n
        return 0

    def complete_calls(self, region: str) -> list[ParsedCall]:
        return [c for m in _BLOCK.finditer(region) if (c := _load(m.group(1))) is not None]

    def parse(self, text: str) -> ParseResult:
        start = self.find_start(text)
        if start is None:
            return ParseResult(text, ())
        region = text[start:]
        calls = self.complete_calls(region)
        # A model may stop (EOS) right after the JSON without closing the last block.
        tail = region[region.rfind(START) :] if END not in region[region.rfind(START) :] else ""
        if tail and (c := _load(tail[len(START) :].strip())) is not None:
            calls.append(c)
        if not calls:  # not a tool call after all: the whole output is text
            return ParseResult(text, ())
        content = text[:start].strip()
        return ParseResult(content or None, tuple(calls))

    def constraint(self, tools: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
        tags = [
            {
                "type": "tag",
                "begin": START + '\n{"name": ' + json.dumps(t["function"]["name"]) + ', "arguments": ',
                # Bounded whitespace: a weak model must not wander off into blank space forever.
                "content": {
                    "type": "json_schema",
                    "json_schema": parameters_schema(t),
                    "max_whitespace_cnt": 1,
                },
                "end": "}\n" + END,
            }
            for t in tools
        ]
        return GrammarSpec.structural_tag(
            {
                "type": "structural_tag",
                "format": {
                    "type": "tags_with_separator",
                    "tags": tags,
                    "separator": "\n",
                    "at_least_one": True,
                    "stop_after_first": not parallel,
                },
            }
        )
