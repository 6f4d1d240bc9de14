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


def test_usage_is_shared_by_key_digest_and_charged_to_the_peers_buckets():
    a, b = RateLimiter(RateLimits(requests_per_minute=4)), RateLimiter(RateLimits(requests_per_minute=4))
    for _ in range(3):
        assert a.check("secret-key", "default", 10, 0.0).allowed
    report = a.usage_report(0.0)
    assert "secret-key" not in str(report)  # keys travel only as digests
    ((digest, usage),) = report.items()
    assert usage == {"tier": "default", "requests": 3.0, "tokens": 30.0}
    b.charge_remote(digest, usage["tier"], usage["requests"], usage["tokens"], 0.0)
    assert b.check("secret-key", "default", 10, 0.0).allowed  # the fleet's fourth
    assert not b.check("secret-key", "default", 10, 0.0).allowed
    assert a.usage_report(200.0) == {}  # idle keys are dropped (a peer then takes a new figure as all new)


def test_openai_rate_limit_headers():
    rl = RateLimiter(RateLimits(requests_per_minute=2, tokens_per_minute=600))
    headers = dict(rl.check("k", "default", 100, 0.0).headers)
    assert headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "500",
        "x-ratelimit-reset-tokens": "10s",
    }
    assert dict(rl.check("k", "default", 1, 0.0).headers)["x-ratelimit-remaining-requests"] == "0"
    refused = rl.check("k", "default", 1, 0.5)
    assert not refused.allowed and dict(refused.headers)["x-ratelimit-reset-requests"] == "59.5s"
    assert RateLimiter(RateLimits()).check("k", "default", 1, 0.0).headers == ()
