"""Scorer maths, the hot-spot guard, and each strategy's choice on hand-built candidate lists."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.router.config import Balance, RoutingSpec, Weights
from tokenfleet.runtime.router.scoring import (
    STRATEGIES,
    Candidate,
    RouteQuery,
    combined_scores,
    is_imbalanced,
    make_strategy,
    queue_scores,
)


def spec(**kw) -> RoutingSpec:
    return RoutingSpec.model_validate(kw)


def test_queue_scores_are_min_max_normalised():
    assert queue_scores([0, 5, 10]) == [1.0, 0.5, 0.0]
    assert queue_scores([3, 3]) == [1.0, 1.0]


def test_combined_score_is_the_weighted_sum():
    cands = [Candidate("a", load=0, kv_usage=0.5, prefix_blocks=4), Candidate("b", load=4, kv_usage=0.0)]
    scores = combined_scores(cands, RouteQuery(num_blocks=8), Weights(prefix=3, queue=2, kv_usage=1))
    assert scores == pytest.approx([3 * 0.5 + 2 * 1.0 + 1 * 0.5, 0 + 0 + 1.0])


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([0, 8], False),  # spread 8 is not above absolute 8
        ([0, 9], True),
        ([10, 19], False),  # 19 <= 2 * 10: relative threshold not passed
        ([10, 21], True),
        ([5], False),
    ],
)
def test_hotspot_thresholds(loads, expected):
    assert is_imbalanced(loads, Balance(absolute=8, relative=2.0)) is expected


def test_prefix_affinity_prefers_the_cached_pod_while_balanced():
    s = make_strategy(spec(strategy="prefix-affinity"))
    cands = [Candidate("a", load=3, prefix_blocks=60), Candidate("b", load=0), Candidate("c", load=1)]
    d = s.choose(RouteQuery(num_blocks=64), cands)
    assert (d.endpoint_id, d.reason, d.prefix_blocks) == ("a", "prefix_hit", 60)


def test_hotspot_guard_lets_load_win():
    s = make_strategy(spec(strategy="prefix-affinity", balance={"absolute": 4, "relative": 1.5}))
    cands = [
        Candidate("a", load=20, prefix_blocks=64),
        Candidate("b", load=2),
        Candidate("c", load=2, prefix_blocks=1),
    ]
    d = s.choose(RouteQuery(num_blocks=64), cands)
    # Load decides; among the least loaded the longer prefix breaks the tie.
    assert (d.endpoint_id, d.reason) == ("c", "hotspot_guard")


def test_queue_can_outweigh_a_short_prefix():
    s = make_strategy(spec(strategy="prefix-affinity", weights={"prefix": 1, "queue": 2, "kvUsage": 0}))
    cands = [Candidate("a", load=6, prefix_blocks=2), Candidate("b", load=0)]
    assert s.choose(RouteQuery(num_blocks=64), cands).endpoint_id == "b"


def test_least_load_ignores_prefix_and_uses_kv_usage():
    s = make_strategy(spec(strategy="least-load"))
    cands = [
        Candidate("a", load=1, kv_usage=0.1, prefix_blocks=64),
        Candidate("b", load=0, kv_usage=0.9),
        Candidate("c", load=0, kv_usage=0.2),
    ]
    d = s.choose(RouteQuery(num_blocks=64), cands)
    assert (d.endpoint_id, d.reason) == ("c", "load")


def test_round_robin_cycles_in_a_stable_order():
    s = make_strategy(spec(strategy="round-robin"))
    cands = [Candidate("b", 0), Candidate("a", 5), Candidate("c", 0)]
    assert [s.choose(RouteQuery(), cands).endpoint_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_session_affinity_sticks_and_falls_back_without_a_key():
    s = make_strategy(spec(strategy="session-affinity"))
    cands = [Candidate(x, load=1) for x in "abcd"]
    first = s.choose(RouteQuery(session_key="user-42"), cands)
    assert first.reason == "session"
    assert all(s.choose(RouteQuery(session_key="user-42"), cands) == first for _ in range(5))
    no_key = s.choose(RouteQuery(num_blocks=4), [Candidate("a", 0, prefix_blocks=4), Candidate("b", 0)])
    assert (no_key.endpoint_id, no_key.reason) == ("a", "prefix_hit")


def test_registry_covers_every_configurable_strategy():
    from typing import get_args

    from tokenfleet.runtime.router.config import Strategy

    assert set(STRATEGIES) == set(get_args(Strategy))


def _route_tenants(strategy, tenants: list[int], num_pods: int = 3, blocks: int = 60):
    """Route a tenant sequence; each pod caches a tenant's prefix once it served it (as its KV events say).

    Returns (requests per pod, prefix hits)."""
    cached: dict[str, set[int]] = {f"p{i}": set() for i in range(num_pods)}
    served = dict.fromkeys(cached, 0)
    hits = 0
    for t in tenants:
        cands = [Candidate(p, load=0, prefix_blocks=blocks if t in held else 0) for p, held in cached.items()]
        d = strategy.choose(RouteQuery(num_blocks=blocks + 2), cands)
        hits += t in cached[d.endpoint_id]
        cached[d.endpoint_id].add(t)
        served[d.endpoint_id] += 1
    return served, hits


# Six tenants with Zipf-like weights 12:6:4:3:2:2 in a fixed interleaving (no randomness): uneven enough
# that pure affinity piles the big tenants onto single pods.
UNEVEN = [t for rnd in range(12) for t, n in enumerate((12, 6, 4, 3, 2, 2)) if rnd < n]


def test_unbounded_affinity_skews_the_work_on_uneven_tenants():
    served, hits = _route_tenants(make_strategy(spec(balance={"maxRatio": None})), UNEVEN)
    counts = sorted(served.values())
    assert counts[-1] / counts[0] > 1.5  # the problem the work bound solves
    assert hits == len(UNEVEN) - 6  # one miss per tenant, then every request hits


def test_work_bound_keeps_max_over_min_within_the_ratio_and_most_hits():
    served, hits = _route_tenants(make_strategy(spec(balance={"maxRatio": 1.4})), UNEVEN)
    counts = sorted(served.values())
    assert counts[-1] / counts[0] <= 1.5, served
    # Overflow of a big tenant goes to one second pod that then holds it too: few extra misses.
    assert hits >= len(UNEVEN) - 6 - 4, hits


def test_work_bound_acts_while_queues_are_short_and_says_so():
    s = make_strategy(spec(balance={"maxRatio": 1.4}))
    reasons = []
    for _ in range(6):  # one tenant only; every pod idle (load 0): the queue guard would never fire
        cands = [Candidate("a", load=0, prefix_blocks=60), Candidate("b", load=0), Candidate("c", load=0)]
        reasons.append(s.choose(RouteQuery(num_blocks=62), cands).reason)
    assert reasons[0] == "prefix_hit" and "work_bound" in reasons


def test_work_bound_at_sixteen_pods():
    tenants = [t for rnd in range(40) for t, n in enumerate(range(40, 0, -1)) if rnd < n // 2 + 1]
    served, _ = _route_tenants(make_strategy(spec(balance={"maxRatio": 1.4})), tenants, num_pods=16)
    counts = sorted(served.values())
    assert counts[-1] / counts[0] <= 1.5, served


def test_a_live_update_keeps_the_history():
    s = make_strategy(spec(strategy="prefix-affinity"))
    s.choose(RouteQuery(num_blocks=4), [Candidate("a", load=0), Candidate("b", load=0)])
    same = make_strategy(spec(strategy="prefix-affinity", weights={"prefix": 5}), s)
    assert same is s and s.spec.weights.prefix == 5 and s.work.count("a") + s.work.count("b") == 1
    other = make_strategy(spec(strategy="round-robin"), s)
    assert other is not s


def test_work_reported_by_the_pods_is_counted_the_same_by_every_router():
    from tokenfleet.runtime.router.scoring import WorkBound

    now = [0.0]
    a, b = WorkBound(64, clock=lambda: now[0]), WorkBound(64, clock=lambda: now[0])
    a.record("p0", reported=True)  # router a sent a request to p0: counted until p0 reports it
    assert (a.count("p0"), b.count("p0")) == (1, 0)
    for router in (a, b):  # p0 announces that request; p1 one that another router sent
        router.observed("p0")
        router.observed("p1")
    assert [(r.count("p0"), r.count("p1")) for r in (a, b)] == [(1, 1), (1, 1)]
    a.record("p1", reported=True)
    a.record("p1", reported=True)
    now[0] = 60.0  # a busy pod may schedule a request long after it arrived: still counted meanwhile
    assert a.count("p1") == 3
    a.settle("p1", in_flight=1)  # one of the two ended here unannounced (it failed): it stops counting
    assert a.count("p1") == 2
    a.observed("p1")  # the other one is announced: counted once, from the pod's event
    assert (a.count("p1"), b.count("p1")) == (2, 1)


def test_ties_go_to_the_same_pod_from_every_router():
    key = bytes(range(16))
    cands = [Candidate(f"p{i}", load=0) for i in range(4)]
    picks = {make_strategy(spec()).choose(RouteQuery(8, None, key), cands).endpoint_id for _ in range(3)}
    assert len(picks) == 1
    spread = {make_strategy(spec()).choose(RouteQuery(8, None, bytes([k]) * 16), cands).endpoint_id
              for k in range(32)}  # fmt: skip
    assert len(spread) == 4  # different prefixes still spread over the pods


@pytest.mark.parametrize("name", ["prefix-affinity", "least-load", "session-affinity"])
def test_a_strategy_ages_its_work_bound_on_the_clock_it_is_given(name):
    """A simulation runs the router's strategies on a virtual clock: unannounced decisions stop counting
    after the backstop on *that* clock, whatever the wall clock did (session affinity included, whose
    requests without a session key go through its prefix-affinity fallback)."""
    now = [0.0]
    s = make_strategy(spec(strategy=name), clock=lambda: now[0])
    assert s.work is not None
    s.choose(RouteQuery(num_blocks=4), [Candidate("a", load=0, reports_work=True)])
    assert s.work.count("a") == 1  # provisional: the pod has not announced it yet
    now[0] = 299.0
    assert s.work.count("a") == 1
    now[0] = 301.0  # past the 300 s backstop on the given clock
    assert s.work.count("a") == 0
    assert make_strategy(spec(strategy="round-robin"), clock=lambda: now[0]).work is None
