"""GrammarSpec: what a request constrains its output to, as plain data (no xgrammar import).

It travels inside SamplingParams from the HTTP layer to the engine, and is the key of the compiled-grammar
cache, so it is frozen, hashable and canonical: JSON values are stored as compact strings (key order kept: it is the order JSON is generated in) so
two requests with the same schema written differently share one compiled grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

from tokenfleet.runtime.errors import InvalidRequest

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: GrammarKind
    # json_schema / structural_tag: canonical JSON; regex / grammar (EBNF): the source; choice: a JSON list;
    # json_object: "".
    value: str = ""
    # json_schema only: strict (OpenAI `strict: true`): no properties beyond the schema's.
    strict: bool = True

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool, strict: bool = True) -> GrammarSpec:
        return GrammarSpec("json_schema", canonical_json(schema), strict)

    @staticmethod
    def json_object() -> GrammarSpec:
        return GrammarSpec("json_object")

    @staticmethod
    def regex(pattern: str) -> GrammarSpec:
        return GrammarSpec("regex", pattern)

    @staticmethod
    def choice(options: list[str]) -> GrammarSpec:
        return GrammarSpec("choice", json.dumps(list(options), ensure_ascii=False))

    @staticmethod
    def grammar(ebnf: str) -> GrammarSpec:
        return GrammarSpec("grammar", ebnf)

    @staticmethod
    def structural_tag(tag: dict[str, Any]) -> GrammarSpec:
        return GrammarSpec("structural_tag", canonical_json(tag))


def canonical_json(value: Any) -> str:
    # Key order inside a JSON schema's `properties` is the order the output is generated in: keep it.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """vLLM's offline spelling of a constraint (`SamplingParams(structured_outputs=...)`): exactly one of
    the fields, turned into the GrammarSpec the engine runs by `to_spec`."""

    json: str | dict[str, Any] | None = None  # a JSON schema (text or mapping)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None

    def to_spec(self) -> GrammarSpec:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {given or 'none'}",
                param="structured_outputs",
            )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            return GrammarSpec.json_schema(json.loads(value) if isinstance(value, str) else value)
        if kind == "regex":
            return GrammarSpec.regex(value)
        if kind == "choice":
            return GrammarSpec.choice(value)
        if kind == "grammar":
            return GrammarSpec.grammar(value)
        if kind == "json_object":
            return GrammarSpec.json_object()
        return GrammarSpec.structural_tag(json.loads(value) if isinstance(value, str) else value)
