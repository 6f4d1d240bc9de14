"""The fidelity harness's simulated side: the trace it writes replays in the simulator with the `cpu` profile,
the pods' scheduler defaults and their KV block count (the real side needs pods: `python -m
tokenfleet.sim.fidelity`)."""

from __future__ import annotations

import itertools
import json

from tokenfleet.sim.cost_model import LinearCost
from tokenfleet.sim.fidelity import sim_run, write_trace
from tokenfleet.sim.model_profile import model_profile


def test_trace_replays_in_the_simulator_with_the_cpu_profile(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, n=12, rate=2.0, tenants=2, prefix=64, suffix=16, out=8, seed=3)
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 12 and {x["prefix_group"] for x in lines} <= {"tenant-0", "tenant-1"}
    assert all(a["t"] <= b["t"] for a, b in itertools.pairwise(lines))
    profile = tmp_path / "cpu.json"
    cost = LinearCost(0.03, 2e-4, 1e-3, 0.0, 1e-8, 2**30, model_profile("smollm2-135m"))
    profile.write_text(cost.to_json())
    one = sim_run(trace, 1, 1, "round-robin", 2048, profile)
    three = sim_run(trace, 1, 3, "prefix-affinity", 2048, profile)
    for r in (one, three):
        assert 0 < r["ttft_p50"] < r["e2e_p50"]
    assert three["e2e_p50"] <= one["e2e_p50"]  # three pods serve the same trace no slower than one
