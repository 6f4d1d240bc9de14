"""Context overflow policy `truncate`: fit a prompt into the context window by dropping its oldest part.

Chat: the leading system message(s) stay, then as many of the most recent turns as fit; a turn starts at a
user message and holds what answers it (assistant messages, tool calls and tool results), so a tool result
never loses the call it answers and no message is ever cut. Completions: tokens are dropped from the left
(a leading BOS is kept). A prompt fits when it leaves room for `max_tokens` (or at least one token).
Both raise ContextLengthExceeded when nothing can be dropped to make it fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenfleet.runtime.errors import ContextLengthExceeded


@dataclass(frozen=True, slots=True)
class Fitted:
    token_ids: list[int]
    text: str
    num_dropped_tokens: int  # prompt tokens removed (0 when it fitted as it was)
    num_dropped_messages: int = 0


def prompt_budget(max_model_len: int, max_tokens: int | None) -> int:
    """The longest prompt that still leaves room for the output."""
    return max_model_len - (max_tokens if max_tokens is not None else 1)


def _turns(messages: Sequence[dict]) -> tuple[list[dict], list[list[dict]]]:
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    turns: list[list[dict]] = []
    for msg in messages[head:]:
        if msg["role"] == "user" or not turns:
            turns.append([msg])
        else:
            turns[-1].append(msg)
    return list(messages[:head]), turns


def fit_chat(
    messages: Sequence[dict],
    render: Callable[[list[dict]], tuple[list[int], str]],
    budget: int,
) -> Fitted:
    """Keep the system messages and the longest suffix of turns whose rendering fits `budget` tokens."""
    ids, text = render(list(messages))
    if len(ids) <= budget:
        return Fitted(ids, text, 0)
    system, turns = _turns(messages)
    system_ids, _ = render(system) if system else ([], "")
    if len(system_ids) > budget:
        raise ContextLengthExceeded(
            f"the system message alone is {len(system_ids)} tokens; the prompt may have at most {budget} "
            "(context length minus max_tokens)",
            param="messages",
        )

    def keep(k: int) -> tuple[list[int], str]:
        return render(system + [m for turn in turns[len(turns) - k :] for m in turn])

    # Fewer turns never render longer: binary search for the most recent turns that fit.
    lo, hi, best = 1, len(turns) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = keep(mid)
        if len(cand[0]) <= budget:
            best, lo = (mid, cand), mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise ContextLengthExceeded(
            f"the most recent turn does not fit in {budget} tokens next to the system message, and messages "
            "are never cut",
            param="messages",
        )
    k, (kept_ids, kept_text) = best
    dropped_messages = sum(len(t) for t in turns[: len(turns) - k])
    return Fitted(kept_ids, kept_text, len(ids) - len(kept_ids), dropped_messages)


def fit_tokens(token_ids: list[int], budget: int, bos_token_id: int | None) -> tuple[list[int], int]:
    """Completions: drop tokens from the left until `budget` is met; returns (kept ids, dropped count)."""
    if len(token_ids) <= budget:
        return token_ids, 0
    keep_bos = bos_token_id is not None and token_ids[:1] == [bos_token_id]
    if budget < 1 + keep_bos:
        raise ContextLengthExceeded(f"no room for a prompt: max_tokens leaves {budget}", param="max_tokens")
    kept = ([bos_token_id] if keep_bos else []) + token_ids[len(token_ids) - (budget - keep_bos) :]
    return kept, len(token_ids) - len(kept)
