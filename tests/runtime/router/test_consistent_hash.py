"""Bounded-load consistent hashing: stickiness, the load bound, minimal movement."""

from __future__ import annotations

from collections import Counter

from tokenfleet.runtime.router.consistent_hash import BoundedLoadRing

NODES = [f"pod-{i}" for i in range(5)]
KEYS = [f"session-{i}" for i in range(2000)]


def test_lookup_is_deterministic_across_instances():
    a, b = BoundedLoadRing(NODES), BoundedLoadRing(reversed(NODES))
    assert [a.lookup(k) for k in KEYS[:200]] == [b.lookup(k) for k in KEYS[:200]]


def test_removing_a_node_moves_only_its_keys():
    full, fewer = BoundedLoadRing(NODES), BoundedLoadRing(NODES[:-1])
    moved = [k for k in KEYS if full.lookup(k) != fewer.lookup(k)]
    assert moved and all(full.lookup(k) == NODES[-1] for k in moved)


def test_load_never_exceeds_the_bound_when_keys_arrive():
    ring, eps = BoundedLoadRing(NODES), 0.25
    loads: Counter[str] = Counter()
    # Every request of a hot session arrives while the earlier ones are still running.
    for k in ["hot"] * 300 + KEYS[:200]:
        cap = ring.capacity(sum(loads.values()), eps)
        node = ring.lookup(k, loads, eps)
        assert loads[node] < cap
        loads[node] += 1
    assert max(loads.values()) <= ring.capacity(sum(loads.values()) - 1, eps)


def test_a_key_stays_on_its_node_until_that_node_is_full():
    ring = BoundedLoadRing(NODES)
    home = ring.lookup("k")
    assert ring.lookup("k", {n: 1 for n in NODES}, 0.25) == home
    spilled = ring.lookup("k", {home: 100} | {n: 0 for n in NODES if n != home}, 0.25)
    assert spilled != home


def test_empty_ring():
    assert BoundedLoadRing([]).lookup("x") is None
