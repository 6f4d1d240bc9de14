"""Longest cached prefix per endpoint, from events (exact) or from routing history (approximate)."""

from __future__ import annotations

from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra
from tokenfleet.runtime.router.prefix_index import ApproximatePrefixIndex, ExactPrefixIndex

EXTRA = hash_extra("m")
H = block_hashes_for(list(range(80)), 16, EXTRA)  # 5 chained blocks


def test_exact_longest_leading_match():
    idx = ExactPrefixIndex()
    idx.stored("a", H[:4])
    idx.stored("b", H[:2])
    idx.stored("c", H[1:])  # holds later blocks but not the first: unusable
    assert idx.match(H, ["a", "b", "c", "d"]) == {"a": 4, "b": 2, "c": 0, "d": 0}


def test_removal_cuts_the_chain_and_clear_forgets():
    idx = ExactPrefixIndex()
    idx.stored("a", H)
    idx.removed("a", [H[2]])
    assert idx.match(H, ["a"]) == {"a": 2}
    idx.clear("a")
    assert idx.match(H, ["a"]) == {"a": 0}
    assert idx.num_blocks("a") == 0


def test_replace_is_a_resync():
    idx = ExactPrefixIndex()
    idx.stored("a", H)
    idx.stored("b", H[:1])
    idx.replace("a", H[:3])
    assert idx.match(H, ["a", "b"]) == {"a": 3, "b": 1}
    assert idx.num_blocks("a") == 3


def test_different_salt_never_matches():
    other = block_hashes_for(list(range(80)), 16, hash_extra("m", "tenant-2"))
    idx = ExactPrefixIndex()
    idx.stored("a", H)
    assert idx.match(other, ["a"]) == {"a": 0}


def test_approximate_records_routes_and_evicts_least_recent():
    idx = ApproximatePrefixIndex(capacity_blocks=6)
    idx.record("a", H[:4])
    idx.record("b", H[:2])  # refreshes H0, H1: now the most recent
    assert idx.match(H, ["a", "b"]) == {"a": 4, "b": 2}
    other = block_hashes_for(list(range(100, 164)), 16, EXTRA)
    idx.record("c", other[:3])  # 7 entries > 6: the oldest (H2) goes, cutting a's chain
    assert len(idx) == 6
    assert idx.match(H, ["a", "b"]) == {"a": 2, "b": 2}
    idx.forget("a")
    assert idx.match(H, ["a", "b"]) == {"a": 0, "b": 2}
    idx.forget("c")  # entries held by nobody else go with it; b's shared ones stay
    assert len(idx) == 2 and idx.match(other, ["c"]) == {"c": 0}
    idx.forget("a")  # nothing left of a: a no-op
    assert idx.match(H, ["b"]) == {"b": 2}


def test_recent_routes_bridge_the_event_lag_then_expire():
    from tokenfleet.runtime.router.prefix_index import RecentRoutes

    now = [0.0]
    recent = RecentRoutes(capacity_blocks=100, ttl_s=10.0, clock=lambda: now[0])
    recent.record("pod-a", [b"h0", b"h1", b"h2"])
    assert recent.match([b"h0", b"h1", b"x"], ["pod-a", "pod-b"]) == {"pod-a": 2, "pod-b": 0}
    now[0] = 15.0  # one rotation: still remembered (older generation)
    assert recent.match([b"h0", b"h1"], ["pod-a"]) == {"pod-a": 2}
    recent.record("pod-b", [b"h0"])
    now[0] = 26.0  # second rotation: pod-a's route (recorded at t=0) is gone, pod-b's (t=15) remains
    assert recent.match([b"h0", b"h1"], ["pod-a", "pod-b"]) == {"pod-a": 0, "pod-b": 1}
    now[0] = 60.0  # idle past 2 * ttl: everything expired at once
    assert recent.match([b"h0"], ["pod-b"]) == {"pod-b": 0}
    recent.record("pod-a", [b"h0"])
    recent.forget("pod-a")
    assert recent.match([b"h0"], ["pod-a"]) == {"pod-a": 0}


def test_an_eviction_reported_by_a_pod_ends_its_recent_routes():
    from tokenfleet.runtime.router.prefix_index import ExactPrefixIndex, RecentRoutes

    recent = RecentRoutes(capacity_blocks=100, ttl_s=30.0)
    exact = ExactPrefixIndex(on_removal=recent.forget)
    recent.record("pod-a", [b"r0"])
    recent.record("pod-b", [b"r0"])
    exact.stored("pod-a", [b"e0"])
    assert recent.match([b"r0"], ["pod-a"]) == {"pod-a": 1}  # a store says nothing about other prefixes
    exact.removed("pod-a", [b"e0"])
    assert recent.match([b"r0"], ["pod-a", "pod-b"]) == {"pod-a": 0, "pod-b": 1}


def test_match_counts_each_endpoints_leading_run_over_random_holdings():
    """Against the definition: endpoint e's count is the longest i such that it holds H[0..i-1]."""
    import random

    rng = random.Random(7)
    hashes = block_hashes_for(list(range(16 * 12)), 16, EXTRA)
    endpoints = [f"e{i}" for i in range(6)]
    for _ in range(200):
        idx = ExactPrefixIndex()
        held = {e: {h for h in hashes if rng.random() < 0.85} for e in endpoints}
        for e, blocks in held.items():
            idx.stored(e, blocks)
        expected = {}
        for e in endpoints:
            n = 0
            while n < len(hashes) and hashes[n] in held[e]:
                n += 1
            expected[e] = n
        asked = rng.sample(endpoints, rng.randint(1, len(endpoints)))
        assert idx.match(hashes, asked) == {e: expected[e] for e in asked}
        assert idx.match([], asked) == dict.fromkeys(asked, 0)
