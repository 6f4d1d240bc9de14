"""Per-key rate limits: requests per minute and tokens per minute, as token buckets.

Each key has a request bucket and a token bucket, each holding at most one minute's allowance and refilled
continuously. A request is admitted when the request bucket has one unit and the token bucket is not in
debt; it then pays one request and its prompt tokens at once, and its completion tokens when they are known
(`charge_tokens`), which may push the bucket into debt: the next request waits until it is repaid. So a
limit holds over any minute even though output length is unknown up front. The refusal carries the seconds
until admission would succeed, for `Retry-After`. Time is passed in; no background task.

Active-active routers hold one quota between them: each counts what it admitted per key (`usage`, cumulative)
and every other router charges those spends to its own buckets (`charge_remote`, quota_peers.py), so each
router's buckets follow the whole fleet's spending, a poll interval late. Keys are kept only as digests:
neither the buckets nor the shared usage hold an API key.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from tokenfleet.runtime.router.config import Limit, RateLimits


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after: float = 0.0
    kind: str | None = None  # "requests" | "tokens" when refused
    headers: tuple[tuple[str, str], ...] = ()  # OpenAI's x-ratelimit-* for the limits that apply


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


# A key's shared usage is dropped after this long without spending (a peer seeing it again from zero takes
# the new figure as its whole spend: counters only go down when they restart).
USAGE_IDLE_SECONDS = 120.0


def key_digest(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


@dataclass(slots=True)
class Usage:
    """What this router admitted for one key since it started (or since the key was last idle)."""

    tier: str
    requests: float = 0.0
    tokens: float = 0.0
    updated: float = 0.0


class RateLimiter:
    def __init__(self, limits: RateLimits, max_keys: int = 100_000) -> None:
        self._limits = limits
        self._buckets: dict[tuple[str, str], Bucket] = {}
        self._max_keys = max_keys
        self.usage: dict[str, Usage] = {}  # by key digest

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
        key = key_digest(key)
        limit = self.limit_for(tier)
        req = tok = None
        if limit.requests_per_minute is not None:
            req = self._bucket(key, "requests", limit.requests_per_minute, now)
            if req.level < 1.0:
                return RateDecision(False, req.seconds_until(1.0), "requests", _headers(req, tok))
        if limit.tokens_per_minute is not None:
            tok = self._bucket(key, "tokens", limit.tokens_per_minute, now)
            if tok.level < 0.0 or prompt_tokens > limit.tokens_per_minute:
                # A prompt larger than a whole minute's allowance could never pass: refuse with a full minute.
                wait = 60.0 if prompt_tokens > limit.tokens_per_minute else tok.seconds_until(0.0)
                return RateDecision(False, wait, "tokens", _headers(req, tok))
        if req is not None:
            req.level -= 1.0
        if tok is not None:
            tok.level -= prompt_tokens
        if req is not None or tok is not None:
            self._record(key, tier, 1.0, prompt_tokens, now)
        return RateDecision(True, headers=_headers(req, tok))

    def charge_tokens(self, key: str, tier: str, tokens: int, now: float) -> None:
        key = key_digest(key)
        limit = self.limit_for(tier)
        if limit.tokens_per_minute is None or tokens <= 0:
            return
        self._bucket(key, "tokens", limit.tokens_per_minute, now).level -= tokens
        self._record(key, tier, 0.0, tokens, now)

    def charge_remote(self, digest: str, tier: str, requests: float, tokens: float, now: float) -> None:
        """Another router admitted `requests` and spent `tokens` for the key with this digest."""
        limit = self.limit_for(tier)
        if limit.requests_per_minute is not None and requests > 0:
            self._bucket(digest, "requests", limit.requests_per_minute, now).level -= requests
        if limit.tokens_per_minute is not None and tokens > 0:
            self._bucket(digest, "tokens", limit.tokens_per_minute, now).level -= tokens

    def _record(self, digest: str, tier: str, requests: float, tokens: float, now: float) -> None:
        u = self.usage.get(digest)
        if u is None:
            u = self.usage[digest] = Usage(tier)
        u.tier, u.requests, u.tokens, u.updated = tier, u.requests + requests, u.tokens + tokens, now

    def usage_report(self, now: float) -> dict[str, dict]:
        """The cumulative usage peers read (idle keys dropped first)."""
        for digest in [d for d, u in self.usage.items() if now - u.updated > USAGE_IDLE_SECONDS]:
            del self.usage[digest]
        return {
            d: {"tier": u.tier, "requests": u.requests, "tokens": u.tokens} for d, u in self.usage.items()
        }


def _headers(req: Bucket | None, tok: Bucket | None) -> tuple[tuple[str, str], ...]:
    """OpenAI's rate-limit headers: the limit, what is left now, and how long until the bucket is full."""
    out: list[tuple[str, str]] = []
    for kind, b in (("requests", req), ("tokens", tok)):
        if b is not None:
            out += [
                (f"x-ratelimit-limit-{kind}", str(int(b.per_minute))),
                (f"x-ratelimit-remaining-{kind}", str(max(int(b.level), 0))),
                (f"x-ratelimit-reset-{kind}", _duration(b.seconds_until(b.per_minute))),
            ]
    return tuple(out)


def _duration(seconds: float) -> str:
    """As OpenAI writes its reset durations: `250ms`, `6s`, `1.5s`."""
    if seconds < 1.0:
        return f"{round(seconds * 1000)}ms"
    return f"{seconds:.1f}".removesuffix(".0") + "s"


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
