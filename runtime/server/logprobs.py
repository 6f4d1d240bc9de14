"""Engine TokenLogprobs -> the two OpenAI logprob shapes (legacy completions, and chat).

A token can hold part of a multi-byte UTF-8 character, so its text alone cannot say what it is; OpenAI's
chat shape adds the token's raw `bytes`. For byte-level BPE vocabularies (GPT-2 style, as GGUF llama
models use) those bytes come from the vocabulary entry through the byte-to-unicode table; for other
vocabularies we fall back to the UTF-8 of the decoded text.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from tokenfleet.runtime.engine.offline_outputs import position_logprobs
from tokenfleet.runtime.engine.outputs import TokenLogprobs
from tokenfleet.runtime.openai.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)

# JSON has no -inf; OpenAI-compatible servers report impossible tokens with a large negative number.
_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if value > _FLOOR else _FLOOR


@functools.cache
def byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _is_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend", None), "decoder", None)
    return decoder is not None and type(decoder).__name__ == "ByteLevel"


class TokenRenderer:
    """Token id -> (text, bytes), memoised per response (a few dozen distinct ids at most)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _decode(self, token_id: int) -> str:
        try:  # show special tokens (`<|im_end|>`) rather than an empty string
            return self._tokenizer.decode([token_id], skip_special_tokens=False)
        except TypeError:  # tokenizers without the keyword
            return self._tokenizer.decode([token_id])

    def render(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text = self._decode(token_id)
        raw = list(text.encode("utf-8"))
        if self._byte_level:
            piece = self._tokenizer.id_to_token(token_id)
            table = byte_level_decoder()
            if piece is not None and all(ch in table for ch in piece):
                raw = [table[ch] for ch in piece]
        self._cache[token_id] = (text, raw)
        return text, raw

    def text(self, token_id: int) -> str:
        return self.render(token_id)[0]


def completion_logprobs(
    renderer: TokenRenderer, logprobs: list[TokenLogprobs], text_start: int = 0
) -> CompletionLogprobs:
    """Parallel lists; `text_offset` is each token's character offset in the returned text."""
    out = CompletionLogprobs()
    offset = text_start
    for lp in logprobs:
        tok = renderer.text(lp.token_id)
        out.tokens.append(tok)
        out.token_logprobs.append(_lp(lp.logprob))
        out.top_logprobs.append({renderer.text(tid): _lp(v) for tid, v in lp.top})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def with_top(scored: Sequence[TokenLogprobs], k: int) -> list[TokenLogprobs]:
    """The entries with at most `k` alternatives each (a prompt scored once for echo and prompt_logprobs
    holds the larger of the two)."""
    return [e if len(e.top) <= k else dataclasses.replace(e, top=e.top[:k]) for e in scored]


def echo_logprobs(
    renderer: TokenRenderer, prompt_token_ids: Sequence[int], scored: Sequence[TokenLogprobs]
) -> CompletionLogprobs:
    """The echoed prompt's tokens in the legacy shape: the first has no logprob (null, as in OpenAI's and
    vLLM's echo), each later one its logprob given the tokens before it. `text_offset` starts at 0."""
    out = completion_logprobs(renderer, list(scored), len(renderer.text(prompt_token_ids[0])))
    out.tokens.insert(0, renderer.text(prompt_token_ids[0]))
    out.token_logprobs.insert(0, None)
    out.top_logprobs.insert(0, None)
    out.text_offset.insert(0, 0)
    return out


def prompt_logprobs_out(renderer: TokenRenderer, scored: Sequence[TokenLogprobs]) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token {token id: logprob, rank,
    decoded_token} for the token itself and its top alternatives."""
    out: PromptLogprobs = [None]
    for entry in scored:
        position = position_logprobs(entry, renderer.text)
        out.append(
            {
                str(tid): PromptLogprob(logprob=_lp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
                for tid, lp in position.items()
            }
        )
    return out


def chat_logprobs(renderer: TokenRenderer, logprobs: list[TokenLogprobs]) -> ChatLogprobs:
    content = []
    for lp in logprobs:
        tok, raw = renderer.render(lp.token_id)
        top = []
        for tid, v in lp.top:
            alt, alt_raw = renderer.render(tid)
            top.append(TopLogprob(token=alt, logprob=_lp(v), bytes=alt_raw))
        content.append(TokenLogprob(token=tok, logprob=_lp(lp.logprob), bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)
