"""IncrementalDetokenizer: token ids in, text deltas out — never broken UTF-8, stop strings across tokens.

Decoding the whole sequence every step costs O(length) per token. Instead (as HF TGI and vLLM do) a short
window is decoded: `prefix_offset..read_offset` is text already emitted, kept as context so tokenizers that
drop a leading space at the start of a decode (SentencePiece's "▁") or merge bytes across tokens decode the
new tokens exactly as they would inside the full sequence; the delta is decode(window) minus
decode(context). While the window's text ends with U+FFFD the last token(s) hold an incomplete UTF-8
character (byte-level BPE splits emoji and CJK across tokens), so nothing is emitted until it completes.

Stop strings are searched in the cumulative text, so they match across token boundaries. Text that might
still become the start of a stop string is held back, so a client never receives text that is then cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.stop_checker import find_stop, safe_length

# Prompt tokens decoded as context for the first output tokens (vLLM uses the same number).
INITIAL_CONTEXT_TOKENS = 5
# Token ids before the context window are dropped once this many pile up (memory stays O(window)).
_TRIM_AT = 64
_REPLACEMENT = "\ufffd"


class SupportsDecode(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Per-request state. Call `update(new_ids)` each step; `flush()` once when the request ends otherwise
    (EOS, max_tokens, abort) to release held-back text.

    `output_text` is the cumulative text (truncated at a stop string); `stop_reason` the stop string that
    ended it; `finished` is True after a stop string or a flush, and later updates are ignored.
    """

    def __init__(self, tokenizer: SupportsDecode, prompt_token_ids: Sequence[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = tuple(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._ids: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached
        self._num_output_tokens = 0
        self._num_emitted = 0  # characters of output_text already returned
        self.output_text = ""
        self.stop_reason: str | None = None
        self.finished = False

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now safe to send (possibly "")."""
        if self.finished or not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        previous_len = len(self.output_text)
        self.output_text += self._decode_new(allow_incomplete=False)
        return self._check_and_release(previous_len, final=False)

    def resume(self, output_token_ids: Sequence[int], num_delivered_chars: int) -> None:
        """Continue a stream begun elsewhere: replay its output tokens one by one (as they were produced,
        so the window and a stop string's held-back text are as they were there), then count the first
        `num_delivered_chars` characters as already sent. Text after them (held back there) comes next."""
        for token_id in output_token_ids:
            self.update([token_id])
        self._num_emitted = min(num_delivered_chars, len(self.output_text))

    def flush(self) -> str:
        """The request ended for another reason: release everything held back (an incomplete character
        decodes to U+FFFD, as the full decode would show it). Idempotent."""
        if self.finished:
            return ""
        previous_len = len(self.output_text)
        self.output_text += self._decode_new(allow_incomplete=True)
        return self._check_and_release(previous_len, final=True)

    # ---- internals ------------------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, *, allow_incomplete: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text):
            if window_text == self._prefix_text:
                # The new tokens add no text (e.g. skipped special tokens): nothing is pending any more,
                # and the context's decode is unchanged, so the cache stays valid.
                self._read_offset = len(self._ids)
            return ""
        if window_text.endswith(_REPLACEMENT) and not allow_incomplete:
            return ""  # an incomplete UTF-8 character: wait for the token(s) that complete it
        delta = window_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _check_and_release(self, previous_len: int, *, final: bool) -> str:
        # Like EOS (banned until min_tokens outputs exist), a stop string only counts after min_tokens.
        if self._stops and self._num_output_tokens > self._min_tokens:
            match = find_stop(self.output_text, self._stops, previous_len)
            if match is not None:
                index, stop = match
                end = index + len(stop) if self._include_stop else index
                assert end >= self._num_emitted, "emitted text that a stop string then cut"
                self.output_text = self.output_text[:end]
                self.stop_reason = stop
                final = True
        if final:
            self.finished = True
            safe = len(self.output_text)
        elif self._include_stop or not self._stops:
            # With the stop string kept in the output, emitted text is never cut: a match ends in new text.
            safe = len(self.output_text)
        else:
            safe = max(self._num_emitted, safe_length(self.output_text, self._stops))
        delta = self.output_text[self._num_emitted : safe]
        self._num_emitted = safe
        return delta
