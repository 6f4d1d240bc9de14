"""Per-key request and token buckets; Retry-After is the time until admission would succeed."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.router.config import RateLimits
from tokenfleet.runtime.router.ratelimit import RateLimiter, retry_after_header


def test_requests_per_minute_and_retry_after():
    rl = RateLimiter(RateLimits(requests_per_minute=2))
    assert rl.check("k", "default", 0, 0.0).allowed
    assert rl.check("k", "default", 0, 0.0).allowed
    d = rl.check("k", "default", 0, 0.0)
    assert (d.allowed, d.kind) == (False, "requests")
    assert d.retry_after == pytest.approx(30.0)  # 2/min refills one request every 30 s
    assert rl.check("other", "default", 0, 0.0).allowed  # keys are independent
    assert rl.check("k", "default", 0, 30.0).allowed


def test_tokens_per_minute_counts_completion_debt():
    rl = RateLimiter(RateLimits(tokens_per_minute=600))
    assert rl.check("k", "default", 100, 0.0).allowed
    rl.charge_tokens("k", "default", 800, 1.0)  # the reply was long: the bucket is 300 tokens in debt
    d = rl.check("k", "default", 10, 1.0)
    assert (d.allowed, d.kind) == (False, "tokens")
    assert d.retry_after == pytest.approx(300 / 10 - 1.0, abs=0.01)  # 10 tokens/s refill
    assert rl.check("k", "default", 10, 31.0).allowed


def test_a_prompt_larger_than_the_minute_allowance_is_refused():
    rl = RateLimiter(RateLimits(tokens_per_minute=100))
    d = rl.check("k", "default", 101, 0.0)
    assert not d.allowed and d.retry_after == 60.0


def test_tiers_override_the_default():
    limits = RateLimits.model_validate(
        {"requestsPerMinute": 1, "tiers": {"gold": {"requestsPerMinute": 100}}}
    )
    rl = RateLimiter(limits)
    assert all(rl.check("g", "gold", 0, 0.0).allowed for _ in range(50))
    assert rl.check("d", "default", 0, 0.0).allowed
    assert not rl.check("d", "default", 0, 0.0).allowed


def test_retry_after_header_is_a_whole_positive_number():
    assert retry_after_header(0.2) == "1"
    assert retry_after_header(29.01) == "30"
