"""The fidelity harness's simulated side: the trace it writes replays in the simulator with the `cpu` profile,
the pods' scheduler defaults and their KV block count (the real side needs pods: `python -m
tokenfleet.sim.fidelity`)."""

from __future__ import annotations

import itertools
import json

import pytest
from tokenfleet.sim.cost_model import CoreUsage, LinearCost
from tokenfleet.sim.fidelity import sim_run, write_trace
from tokenfleet.sim.model_profile import model_profile


def test_trace_replays_in_the_simulator_with_the_cpu_profile(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, n=12, rate=2.0, tenants=2, prefix=64, suffix=16, out=8, seed=3)
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 12 and {x["prefix_group"] for x in lines} <= {"tenant-0", "tenant-1"}
    assert all(a["t"] <= b["t"] for a, b in itertools.pairwise(lines))
    profile = tmp_path / "cpu.json"
    cores = CoreUsage(2, 1.6, 1.3)
    cost = LinearCost(0.03, 2e-4, 1e-3, 0.0, 1e-8, 2**30, model_profile("smollm2-135m"), "cpu", 0.02, cores)
    profile.write_text(cost.to_json())
    one = sim_run(trace, 1, 1, "round-robin", 2048, profile, shared_host=False)
    three = sim_run(trace, 1, 3, "prefix-affinity", 2048, profile, shared_host=False)
    for r in (one, three):
        assert 0 < r["ttft_p50"] < r["e2e_p50"]
    assert three["e2e_p50"] <= one["e2e_p50"]  # three pods (own cores) serve it no slower than one


def test_served_fit_separates_the_request_overhead_from_the_steps():
    """Time-to-first-token rows carry the request's overhead on top of their step; decode rows do not."""
    from tokenfleet.sim.calibrate import Timed, fit
    from tokenfleet.sim.cost_model import BatchShape

    model = model_profile("smollm2-135m")
    truth = LinearCost(0.05, 1e-3, 2e-3, 0.0, 2e-6, 2**30, model, "cpu", 0.03, per_kv_read_s=2e-5)
    rows = []
    for p in (32, 128, 384, 768):
        shape = BatchShape(p, 1, 1, p * (p + 1) / 2, p)
        rows.append(Timed(shape, truth.step_seconds(shape) + 0.03, True))
    for cached, new in ((256, 16), (1024, 32), (2048, 64)):  # prefix hits: context read, few tokens
        shape = BatchShape(new, 1, 1, new * cached + new * (new + 1) / 2, cached + new)
        rows.append(Timed(shape, truth.step_seconds(shape) + 0.03, True))
    for batch, ctx in ((1, 48), (4, 48), (12, 48), (24, 48), (6, 600)):
        shape = BatchShape(batch, batch, batch, batch * ctx, batch * ctx)
        rows.append(Timed(shape, truth.step_seconds(shape)))
    cost, err = fit(rows)
    assert err < 1e-6
    assert abs(cost.request_overhead_s - 0.03) < 1e-6 and abs(cost.base_s - 0.05) < 1e-6
    assert abs(cost.per_kv_read_s - 2e-5) < 1e-9


def test_small_batch_steps_keep_their_measured_excess_and_the_line_fits_the_rest(tmp_path):
    """A CPU runs two or three rows about one at a time and packs a matrix product from four on: steps of
    two and three decodes cost far more than a line through the others says. The fit leaves them out of
    the line and keeps each one's measured excess, which the profile carries to the simulator."""
    from tokenfleet.sim.calibrate import Timed, fit
    from tokenfleet.sim.cost_model import BatchShape

    model = model_profile("smollm2-135m")
    truth = LinearCost(0.05, 1e-3, 2e-3, 0.0, 2e-6, 2**30, model, "cpu", 0.03, per_kv_read_s=2e-5)
    jump = {2: 0.017, 3: 0.031}  # a 2- and 3-row step's excess, as measured on 2 cores
    rows = []
    for p in (32, 128, 384, 768):
        shape = BatchShape(p, 1, 1, p * (p + 1) / 2, p)
        rows.append(Timed(shape, truth.step_seconds(shape) + 0.03, True))
    for batch, ctx in ((1, 48), (2, 48), (3, 48), (4, 48), (12, 48), (24, 48), (6, 600)):
        shape = BatchShape(batch, batch, batch, batch * ctx, batch * ctx)
        rows.append(Timed(shape, truth.step_seconds(shape) + jump.get(batch, 0.0)))
    cost, err = fit(rows)
    assert err < 1e-6  # every row, the small batches included, predicted exactly
    assert abs(cost.base_s - 0.05) < 1e-6 and abs(cost.per_seq_s - 2e-3) < 1e-6
    assert cost.small_batch_extra_s[2] == pytest.approx(0.017) and cost.small_batch_extra_s[
        3
    ] == pytest.approx(0.031)
    two = BatchShape(2, 2, 2, 96, 96)
    assert cost.step_seconds(two) == pytest.approx(truth.step_seconds(two) + 0.017)
    # A mixed step of 40 tokens is on the line; the profile round-trips the excess.
    mixed = BatchShape(40, 3, 3, 2000, 400)
    assert cost.step_seconds(mixed) == pytest.approx(truth.step_seconds(mixed))
    path = tmp_path / "cpu.json"
    path.write_text(cost.to_json())
    assert LinearCost.load(path, model) == cost


def test_profile_round_trips_and_a_shared_host_stretches_concurrent_steps(tmp_path):
    """Engines on one host slow each other once their core demand passes the host's cores; a profile
    without the measured usage cannot say by how much, and says so."""
    import pytest
    from tokenfleet.sim.errors import SimInputError

    model = model_profile("smollm2-135m")
    cost = LinearCost(0.03, 2e-4, 1e-3, 0.0, 1e-8, 2**30, model, "cpu", 0.01, CoreUsage(2, 1.6, 1.3))
    path = tmp_path / "cpu.json"
    path.write_text(cost.to_json())
    assert LinearCost.load(path, model) == cost
    trace = tmp_path / "t.jsonl"
    write_trace(trace, n=30, rate=4.0, tenants=3, prefix=64, suffix=16, out=16, seed=5)
    alone = sim_run(trace, 1, 3, "round-robin", 2048, path, shared_host=False)
    shared = sim_run(trace, 1, 3, "round-robin", 2048, path, shared_host=True)
    assert shared["e2e_p50"] > alone["e2e_p50"] * 1.05
    one_alone = sim_run(trace, 1, 1, "round-robin", 2048, path, shared_host=False)
    one_shared = sim_run(trace, 1, 1, "round-robin", 2048, path, shared_host=True)
    assert one_shared == one_alone  # one engine has the host to itself
    bare = tmp_path / "bare.json"
    bare.write_text(LinearCost(0.03, 2e-4, 1e-3, 0.0, 1e-8, 2**30, model).to_json())
    with pytest.raises(SimInputError, match=r"fleet\.cpu_shared_host"):
        sim_run(trace, 1, 3, "round-robin", 2048, bare, shared_host=True)
