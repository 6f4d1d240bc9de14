"""Stop strings over a growing text: find the earliest match, and how much text is safe to stream.

Pure functions over strings, so the rules are easy to test apart from any tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], new_start: int) -> tuple[int, str] | None:
    """Earliest (index, stop string) match that ends in text[new_start:] (the text added since last check).

    Matches that ended earlier were looked for then, so only the tail that can overlap new text is searched.
    Among stops found, the one starting first wins (it cuts the most text); ties go to the longer stop.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, new_start - len(stop) + 1))
        if index < 0:
            continue
        if best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1])):
            best = (index, stop)
    return best


def safe_length(text: str, stops: Sequence[str]) -> int:
    """Length of the prefix of `text` that no future text can turn into part of a stop string.

    A stop string that later completes must start in a suffix of `text` that is a proper prefix of it; so
    everything before the earliest such suffix is safe. Holding back only that suffix (instead of a blind
    max_stop_len - 1 characters) keeps streaming latency low: "Hello" is sent at once with stop "\\n\\n".
    """
    safe = len(text)
    for stop in stops:
        # Try the longest candidate first: the earliest start that could still grow into `stop`.
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                safe = min(safe, len(text) - length)
                break
    return safe
