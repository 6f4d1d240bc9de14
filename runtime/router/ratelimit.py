"""Per-key rate limits: requests per minute and tokens per minute, as token buckets.

Each key has a request bucket and a token bucket, each holding at most one minute's allowance and refilled
continuously. A request is admitted when the request bucket has one unit and the token bucket is not in
debt; it then pays one request and its prompt tokens at once, and its completion tokens when they are known
(`charge_tokens`), which may push the bucket into debt: the next request waits until it is repaid. So a
limit holds over any minute even though output length is unknown up front. The refusal carries the seconds
until admission would succeed, for `Retry-After`. Time is passed in; no background task.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenfleet.runtime.router.config import Limit, RateLimits


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after: float = 0.0
    kind: str | None = None  # "requests" | "tokens" when refused


@dataclass(slots=True)
class Bucket:
    per_minute: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        rate = self.per_minute / 60.0
        self.level = min(self.per_minute, self.level + (now - self.updated) * rate)
        self.updated = now

    def seconds_until(self, needed: float) -> float:
        """Seconds until the level reaches `needed` (the level is current)."""
        missing = needed - self.level
        return 0.0 if missing <= 0 else missing / (self.per_minute / 60.0)


class RateLimiter:
    def __init__(self, limits: RateLimits, max_keys: int = 100_000) -> None:
        self._limits = limits
        self._buckets: dict[tuple[str, str], Bucket] = {}
        self._max_keys = max_keys

    def set_limits(self, limits: RateLimits) -> None:
        """New limits (a live policy change): buckets whose per-minute rate changed start over full."""
        self._limits = limits

    def limit_for(self, tier: str) -> Limit:
        return self._limits.tiers.get(tier, self._limits)

    def _bucket(self, key: str, kind: str, per_minute: float, now: float) -> Bucket:
        b = self._buckets.get((key, kind))
        if b is None or b.per_minute != per_minute:
            if len(self._buckets) >= self._max_keys:
                self._evict_full(now)
            b = Bucket(per_minute, per_minute, now)
            self._buckets[(key, kind)] = b
        b.refill(now)
        return b

    def _evict_full(self, now: float) -> None:
        # Buckets that refilled completely carry no information: dropping them is exact.
        for k, b in list(self._buckets.items()):
            b.refill(now)
            if b.level >= b.per_minute:
                del self._buckets[k]

    def check(self, key: str, tier: str, prompt_tokens: int, now: float) -> RateDecision:
        limit = self.limit_for(tier)
        req = tok = None
        if limit.requests_per_minute is not None:
            req = self._bucket(key, "requests", limit.requests_per_minute, now)
            if req.level < 1.0:
                return RateDecision(False, req.seconds_until(1.0), "requests")
        if limit.tokens_per_minute is not None:
            tok = self._bucket(key, "tokens", limit.tokens_per_minute, now)
            if tok.level < 0.0 or prompt_tokens > limit.tokens_per_minute:
                # A prompt larger than a whole minute's allowance could never pass: refuse with a full minute.
                wait = 60.0 if prompt_tokens > limit.tokens_per_minute else tok.seconds_until(0.0)
                return RateDecision(False, wait, "tokens")
        if req is not None:
            req.level -= 1.0
        if tok is not None:
            tok.level -= prompt_tokens
        return RateDecision(True)

    def charge_tokens(self, key: str, tier: str, tokens: int, now: float) -> None:
        limit = self.limit_for(tier)
        if limit.tokens_per_minute is None or tokens <= 0:
            return
        self._bucket(key, "tokens", limit.tokens_per_minute, now).level -= tokens


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
