"""Structured outputs: grammars (JSON schema, regex, choice, EBNF, structural tags) enforced with xgrammar
token bitmasks in the sampler. `spec` is plain data (GrammarSpec, and vLLM's StructuredOutputsParams that
becomes one); `compiler` and `state` need xgrammar."""

from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec, StructuredOutputsParams

__all__ = ["GrammarSpec", "StructuredOutputsParams"]
