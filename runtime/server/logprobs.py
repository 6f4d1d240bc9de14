"""Engine TokenLogprobs -> the two OpenAI logprob shapes (legacy completions, and chat)."""

from __future__ import annotations

from tokenfleet.runtime.engine.outputs import TokenLogprobs
from tokenfleet.runtime.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

# JSON has no -inf; OpenAI-compatible servers report impossible tokens with a large negative number.
_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if value > _FLOOR else _FLOOR


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, logprobs: list[TokenLogprobs], text_start: int = 0) -> CompletionLogprobs:
    """Parallel lists; `text_offset` is each token's character offset in the returned text."""
    out = CompletionLogprobs()
    offset = text_start
    for lp in logprobs:
        tok = token_text(tokenizer, lp.token_id)
        out.tokens.append(tok)
        out.token_logprobs.append(_lp(lp.logprob))
        out.top_logprobs.append({token_text(tokenizer, tid): _lp(v) for tid, v in lp.top})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def chat_logprobs(tokenizer, logprobs: list[TokenLogprobs]) -> ChatLogprobs:
    content = []
    for lp in logprobs:
        tok = token_text(tokenizer, lp.token_id)
        top = []
        for tid, v in lp.top:
            alt = token_text(tokenizer, tid)
            top.append(TopLogprob(token=alt, logprob=_lp(v), bytes=list(alt.encode("utf-8"))))
        content.append(
            TokenLogprob(
                token=tok, logprob=_lp(lp.logprob), bytes=list(tok.encode("utf-8")), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)
