"""GrammarCompiler: GrammarSpec -> xgrammar CompiledGrammar, compiled once per spec and kept in a bounded LRU.

The token vocabulary xgrammar matches against is built from our own tokenizer (the one the engine decodes
with), never fetched from a model hub: byte-level BPE tokens are given in their byte-level spelling, and
special tokens other than the stop tokens are given as empty strings, which xgrammar treats as never
allowed (a `<|im_start|>` must not appear inside a JSON string just because its characters would fit).

Compilation can take from a millisecond (a regex) to a second (a large schema on a 150k vocabulary): the
server compiles in a worker thread before submitting (`AsyncEngine.compile_grammar`), so by the time the
engine thread asks for the grammar of a new request it is a cache hit. The cache is thread-safe.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec
from tokenfleet.runtime.engine.structured_output.state import GrammarState
from tokenfleet.runtime.errors import InvalidRequest
from tokenizers import decoders

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar is imported on first use (the first constrained request), not at start-up: importing it
# (with transformers) is ~0.6 s of every server's cold start.

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256


def build_tokenizer_info(tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer` (runtime.model.tokenizer.Tokenizer) for logits of width `vocab_size`."""
    import xgrammar as xgr

    backend = tokenizer.backend
    by_id = {i: tok for tok, i in backend.get_vocab(with_added_tokens=True).items()}
    stops = sorted(i for i in tokenizer.eos_token_ids if i < vocab_size)
    hidden = set(tokenizer.special_token_ids) - set(stops)
    encoded = ["" if i in hidden else by_id.get(i, "") for i in range(max(by_id, default=-1) + 1)]
    if isinstance(backend.decoder, decoders.ByteLevel):
        vocab_type = xgr.VocabType.BYTE_LEVEL
    elif "<0x0A>" in by_id.values():
        vocab_type = xgr.VocabType.BYTE_FALLBACK
    else:
        vocab_type = xgr.VocabType.RAW
    add_prefix_space = vocab_type is xgr.VocabType.BYTE_FALLBACK
    return xgr.TokenizerInfo(
        encoded[:vocab_size],
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=add_prefix_space,
    )


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and logs

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        # Built on first use: a server that never sees a constrained request never pays for it.
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                start = time.perf_counter()
                info = build_tokenizer_info(self._tokenizer, self.vocab_size)
                # Our own LRU keys on GrammarSpec; xgrammar's cache would only hold the same grammars twice.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
                logger.info("grammar tokenizer info built in %.2fs", time.perf_counter() - start)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (raises InvalidRequest when the spec is not a valid grammar)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = _compile(self._xgr_compiler(), spec)
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, spec: GrammarSpec | None) -> GrammarState | None:
        """A fresh matcher for one request (None for unconstrained output)."""
        return None if spec is None else GrammarState(self.compile(spec), self.vocab_size)

    def __len__(self) -> int:
        return len(self._cache)


def _choice_grammar(options: list[str]) -> str:
    if not options or not all(isinstance(o, str) for o in options):
        raise InvalidRequest("choice must be a non-empty list of strings", param="structured_outputs.choice")
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def _compile(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    try:
        if spec.kind == "json_schema":
            # Compact separators: no whitespace for the model to wander off into.
            return compiler.compile_json_schema(
                spec.value, any_whitespace=False, separators=(",", ":"), strict_mode=spec.strict
            )
        if spec.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_grammar(_choice_grammar(json.loads(spec.value)))
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.value)
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(spec.value)
    except InvalidRequest:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors for bad input
        raise InvalidRequest(f"invalid {spec.kind} constraint: {e}", param=_PARAMS[spec.kind]) from None
    raise InvalidRequest(f"unknown constraint kind {spec.kind!r}")


_PARAMS = {
    "json_schema": "response_format",
    "json_object": "response_format",
    "regex": "structured_outputs.regex",
    "choice": "structured_outputs.choice",
    "grammar": "structured_outputs.grammar",
    "structural_tag": "tools",
}
