"""Workload generators: the statistics they promise, from a fixed seed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from tokenfleet.sim.workload import Workload, WorkloadSpec


def arrivals(**kw):
    return list(Workload(WorkloadSpec(**kw)).arrivals())


def gaps(reqs) -> np.ndarray:
    t = np.array([r.arrival for r in reqs])
    return np.diff(t)


def test_poisson_rate_and_gamma_burstiness():
    poisson = arrivals(rate=50, duration_s=80, system_prompt_tokens=0, user_tokens=2, output_tokens=2)
    assert len(poisson) == pytest.approx(50 * 80, rel=0.05)
    g = gaps(poisson)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.05)
    bursty = arrivals(
        arrival="gamma",
        burstiness=3.0,
        rate=50,
        duration_s=80,
        system_prompt_tokens=0,
        user_tokens=2,
        output_tokens=2,
    )
    assert len(bursty) == pytest.approx(50 * 80, rel=0.2)
    g = gaps(bursty)
    assert g.std() / g.mean() == pytest.approx(3.0, rel=0.2)


def test_diurnal_rate_follows_the_sine():
    reqs = arrivals(
        arrival="diurnal",
        rate=40,
        diurnal_period_s=50,
        diurnal_amplitude=0.8,
        duration_s=200,
        system_prompt_tokens=0,
        user_tokens=2,
        output_tokens=2,
    )
    phase = np.array([r.arrival % 50 for r in reqs])
    high, low = ((phase > 0) & (phase < 25)).sum(), ((phase > 25) & (phase < 50)).sum()
    # Mean rate (1 + 0.8 * 2/pi) vs (1 - 0.8 * 2/pi) over each half: about 3.1x.
    assert high / low == pytest.approx((1 + 1.6 / np.pi) / (1 - 1.6 / np.pi), rel=0.15)


def test_tenants_share_system_prompts_with_zipf_popularity():
    reqs = arrivals(rate=50, duration_s=60, num_tenants=10, zipf_s=1.2, system_prompt_tokens=64, seed=7)
    counts = Counter(r.tenant for r in reqs)
    assert counts["t0"] > 2 * counts["t5"] > 0
    t0 = [r for r in reqs if r.tenant == "t0"]
    assert all(r.prompt[:64] == t0[0].prompt[:64] for r in t0)
    assert t0[0].prompt[64:] != t0[1].prompt[64:]
    assert t0[0].prompt[:64] != next(r for r in reqs if r.tenant == "t1").prompt[:64]


def test_lengths_long_documents_and_priorities():
    reqs = arrivals(
        rate=100,
        duration_s=40,
        system_prompt_tokens=0,
        user_tokens=100,
        output_tokens=50,
        long_doc_fraction=0.1,
        long_doc_tokens=3000,
        high_priority_fraction=0.25,
    )
    out = np.array([len(r.output) for r in reqs])
    assert out.mean() == pytest.approx(50, rel=0.1)
    long = sum(len(r.prompt) > 2000 for r in reqs) / len(reqs)
    assert long == pytest.approx(0.1, abs=0.03)
    high = sum(r.priority == 0 for r in reqs) / len(reqs)
    assert high == pytest.approx(0.25, abs=0.04)


def test_session_turns_extend_prompt_and_answer_then_end():
    w = Workload(
        WorkloadSpec(rate=5, duration_s=20, session_fraction=1.0, turns_mean=3, think_time_s=2.0, seed=3)
    )
    first = next(iter(w.arrivals()))
    assert first.session is not None
    turns, prev = 1, first
    while (nxt := w.follow_up(prev, finished_at=prev.arrival + 1.0)) is not None:
        assert nxt.prompt[: len(prev.prompt) + len(prev.output)] == prev.prompt + prev.output
        assert (
            nxt.arrival >= prev.arrival + 1.0 and nxt.session == first.session and nxt.turn == prev.turn + 1
        )
        turns, prev = turns + 1, nxt
        assert turns < 50
    capped = Workload(
        WorkloadSpec(rate=5, duration_s=5, session_fraction=1.0, turns_mean=50, max_prompt_tokens=900, seed=3)
    )
    prev = next(iter(capped.arrivals()))
    while (nxt := capped.follow_up(prev, prev.arrival)) is not None:
        prev = nxt
    assert len(prev.prompt) <= 900


def test_same_seed_same_tokens():
    a, b = arrivals(seed=11, duration_s=5), arrivals(seed=11, duration_s=5)
    assert [(r.arrival, r.prompt, r.output) for r in a] == [(r.arrival, r.prompt, r.output) for r in b]


def test_named_tenants_send_at_their_own_rates_lengths_priorities_and_start():
    tenants = (
        {"name": "A", "rate": 80, "user_tokens": 50, "output_tokens": 20, "priority": 10},
        {"name": "B", "rate": 8, "system_prompt_tokens": 32, "user_tokens": 200, "output_tokens": 5,
         "priority": -10, "start_s": 20},
    )  # fmt: skip
    reqs = arrivals(tenants=tenants, duration_s=60, length_sigma=0.0, seed=4)
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)
    assert len({r.request_id for r in reqs}) == len(reqs)
    a = [r for r in reqs if r.tenant == "A"]
    b = [r for r in reqs if r.tenant == "B"]
    assert len(a) + len(b) == len(reqs)
    assert len(a) == pytest.approx(80 * 60, rel=0.05)
    assert len(b) == pytest.approx(8 * 40, rel=0.15) and min(r.arrival for r in b) >= 20
    assert {(len(r.prompt), len(r.output), r.priority) for r in a} == {(50, 20, 10)}
    assert {(len(r.prompt), len(r.output), r.priority) for r in b} == {(232, 5, -10)}
    assert all(r.prompt[:32] == b[0].prompt[:32] for r in b) and b[0].prompt[32:] != b[1].prompt[32:]
    assert all(r.session is None for r in reqs)


def test_a_tenants_requests_do_not_depend_on_the_others():
    b = {"name": "B", "rate": 5, "user_tokens": 40}
    alone = arrivals(tenants=(b,), duration_s=20, seed=2)
    beside = [
        r for r in arrivals(tenants=({"name": "A", "rate": 50}, b), duration_s=20, seed=2) if r.tenant == "B"
    ]
    assert [(r.arrival, r.prompt, r.output) for r in alone] == [
        (r.arrival, r.prompt, r.output) for r in beside
    ]
    other_seed = arrivals(tenants=(b,), duration_s=20, seed=3)
    assert [r.arrival for r in other_seed] != [r.arrival for r in alone]


def test_named_tenants_refuse_the_zipf_mix_fields_and_repeated_names():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="rate is the Zipf mix's"):
        WorkloadSpec(rate=5, tenants=({"name": "A", "rate": 1},))
    with pytest.raises(ValidationError, match="session_fraction"):
        WorkloadSpec(session_fraction=0.5, tenants=({"name": "A", "rate": 1},))
    with pytest.raises(ValidationError, match="repeat"):
        WorkloadSpec(tenants=({"name": "A", "rate": 1}, {"name": "A", "rate": 2}))
    # The generator's own fields still apply to the streams.
    WorkloadSpec(duration_s=5, arrival="gamma", length_sigma=0.2, seed=1, tenants=({"name": "A", "rate": 1},))
