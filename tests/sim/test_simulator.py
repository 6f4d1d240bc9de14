"""The simulator end to end: determinism, conservation, routing and cache behaviour, autoscaling, preemption."""

from __future__ import annotations

import json

import pytest
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra
from tokenfleet.sim.api import simulate
from tokenfleet.sim.config import parse_config
from tokenfleet.sim.cost_model import LinearCost
from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.model_profile import model_profile
from tokenfleet.sim.results import to_json
from tokenfleet.sim.router import SimRouter
from tokenfleet.sim.workload import Workload, WorkloadSpec


def small(**kw) -> dict:
    base = {
        "model": "8b",
        "fleet": {"gpu": "h100", "replicas": 3},
        "workload": {"rate": 8, "duration_s": 20, "num_tenants": 6, "system_prompt_tokens": 256, "seed": 1},
    }
    for key, value in kw.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def simulation(config):
    """The Simulation that `simulate` would run, kept for a test to look inside."""
    from tokenfleet.sim.api import build_cost, build_model, build_workload
    from tokenfleet.sim.simulator import Simulation

    model = build_model(config)
    return Simulation(
        config, build_workload(config), build_cost(config, model), model.name, model.max_model_len
    )


def run(**kw) -> dict:
    return simulate(parse_config(small(**kw)))


def test_same_seed_gives_byte_identical_json_and_another_seed_does_not():
    kw = {"workload": {"session_fraction": 0.3, "arrival": "gamma"}}
    a, b = to_json(run(**kw)), to_json(run(**kw))
    assert a == b
    c = to_json(run(workload={"session_fraction": 0.3, "arrival": "gamma", "seed": 2}))
    assert c != a


def test_every_request_finishes_with_exactly_its_tokens():

    config = parse_config(small(workload={"session_fraction": 0.5, "turns_mean": 3, "think_time_s": 1.0}))
    sim = simulation(config)
    r = sim.run()
    rq = r["requests"]
    assert rq["arrived"] > 160  # first turns + follow-ups
    assert rq["finished"] == rq["arrived"] and rq["unfinished"] == 0 and rq["rejected"] == 0
    # Tokens the replicas produced (one per sampled position) == the requests' own output lengths.
    produced = sum(p.replica.generation_tokens_total for p in sim.pods.values())
    assert produced == sim.collector.output_tokens and rq["cut_short"] == 0
    assert r["latency_s"]["ttft"]["p50"] > 0 and r["latency_s"]["tpot"]["p50"] > 0
    assert r["latency_s"]["e2e"]["p50"] > r["latency_s"]["ttft"]["p50"]
    # Follow-up turns extend their own prefix: sessions hit the cache beyond the shared system prompts.
    assert r["cache"]["prefix_hit_rate"] > 0.3


def test_prefix_affinity_hits_the_cache_more_than_round_robin():
    rr = run(routing={"strategy": "round-robin", "maxInFlightPerEndpoint": 1024}, fleet={"replicas": 4})
    pa = run(routing={"strategy": "prefix-affinity", "maxInFlightPerEndpoint": 1024}, fleet={"replicas": 4})
    assert pa["cache"]["prefix_hit_rate"] > rr["cache"]["prefix_hit_rate"] + 0.02
    assert pa["routing"].get("prefix_hit", 0) > 0
    assert rr["routing"] == {"round_robin": rr["requests"]["arrived"]}


def test_router_hashes_are_the_replicas_own():
    """The router hashes a prompt once and hands the hashes to the replica: they must be the engine's."""
    router = SimRouter(parse_config(small()).routing, 16, "llama-3-8b", lambda: 0.0)
    sreq = next(iter(Workload(WorkloadSpec(seed=3, system_prompt_tokens=100)).arrivals()))
    router.hash_prompt(sreq)
    assert sreq.block_hashes == block_hashes_for(sreq.prompt, 16, hash_extra("llama-3-8b"))
    assert len(sreq.block_hashes) == len(sreq.prompt) // 16


def test_tiny_kv_cache_preempts_and_still_finishes_everything():
    model = model_profile("8b")
    cost = LinearCost(
        0.01, 1e-5, 1e-4, 0.0, 0.0, kv_cache_bytes=600 * 16 * model.kv_bytes_per_token, model=model
    )
    config = parse_config(small(fleet={"replicas": 1}, workload={"rate": 4, "output_tokens": 400}))
    r = simulate(config, cost=cost)
    assert r["preemptions"] > 0 and r["requests"]["preempted"] > 0
    assert r["requests"]["unfinished"] == 0
    assert r["fleet"]["kv_blocks_per_replica"] == 600


def test_autoscaling_follows_a_burst_and_loses_nothing_on_scale_down():
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 6,
        "targets": {"waitingRequestsPerReplica": 2, "kvCacheUsage": 0.6},
        "scaleDown": {"stabilizationWindowSeconds": 30, "maxStep": 2, "cooldownSeconds": 10},
    }
    r = run(
        fleet={"replicas": 1},
        autoscaling=autoscaling,
        autoscale_interval_s=5,
        cold_start_s=20,
        run_until_s=400,
        workload={"rate": 80, "duration_s": 10, "output_tokens": 200, "user_tokens": 400},  # 2x one H100
    )
    events = r["fleet"]["scale_events"]
    ups = [e for e in events if e[2] > e[1]]
    downs = [e for e in events if e[2] < e[1]]
    assert ups and downs
    assert r["fleet"]["replicas_peak"] > 1
    assert r["requests"]["unfinished"] == 0 and r["requests"]["finished"] == r["requests"]["arrived"]
    assert r["timeline"]["replicas"][-1] == 1  # back to minReplicas after the burst


def test_scale_to_zero_and_back_serves_the_first_request_after_the_cold_start(tmp_path):
    # The request after the scale-to-zero waits in the router's queue for the cold start (30 s) plus up to
    # one autoscale interval: a queue deadline of 60 s covers it, the default 30 s does not (next test).
    trace = tmp_path / "t.jsonl"
    lines = [{"t": i * 0.5, "prompt_tokens": 200, "output_tokens": 20} for i in range(10)]
    lines.append({"t": 300.0, "prompt_tokens": 200, "output_tokens": 20})
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    autoscaling = {
        "minReplicas": 0,
        "maxReplicas": 2,
        "targets": {"waitingRequestsPerReplica": 4},
        "scaleToZeroAfterSeconds": 60,
        "scaleDown": {"stabilizationWindowSeconds": 10},
    }
    r = run(
        fleet={"replicas": 1},
        autoscaling=autoscaling,
        autoscale_interval_s=5,
        cold_start_s=30,
        trace=str(trace),
        routing={"queueTimeoutSeconds": 60},
    )
    events = r["fleet"]["scale_events"]
    assert any(e[2] == 0 for e in events), events
    back = [e for e in events if e[1] == 0 and e[2] == 1]
    assert back and back[0][0] >= 300.0
    assert r["requests"]["finished"] == 11
    assert r["latency_s"]["ttft"]["max"] >= 30.0  # the late request waited for the cold start, and was served


def test_with_a_warm_tier_scale_to_zero_sleeps_and_the_late_request_waits_only_for_the_wake(tmp_path):
    """The same story as above with `idle: sleep`: the pod sleeps instead of leaving, the late request wakes
    it at once (the router's wake on demand, not the next decision), and its wait is the wake, not a cold
    start. The sleeper holds its GPU: it counts in replica-seconds to the end."""
    trace = tmp_path / "t.jsonl"
    lines = [{"t": i * 0.5, "prompt_tokens": 200, "output_tokens": 20} for i in range(10)]
    lines.append({"t": 300.0, "prompt_tokens": 200, "output_tokens": 20})
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    autoscaling = {
        "minReplicas": 0,
        "maxReplicas": 2,
        "targets": {"waitingRequestsPerReplica": 4},
        "scaleToZeroAfterSeconds": 60,
        "scaleDown": {"stabilizationWindowSeconds": 10},
        "idle": "sleep",
    }

    config = parse_config(
        small(
            fleet={"replicas": 1},
            autoscaling=autoscaling,
            autoscale_interval_s=5,
            cold_start_s=30,
            wake_s=2.0,
            trace=str(trace),
            run_until_s=320,
        )
    )
    sim = simulation(config)
    r = sim.run()
    assert list(sim.pods) == ["replica-0"]  # the one pod slept and woke: no pod was ever created
    events = r["fleet"]["scale_events"]
    assert any(e[2] == 0 for e in events), events
    assert r["requests"]["finished"] == 11 and r["requests"]["rejected"] == 0
    assert 2.0 <= r["latency_s"]["ttft"]["max"] < 5.0  # the wake, not the 30 s cold start
    assert r["fleet"]["replica_seconds"] >= 300.0  # asleep, it still held its GPU


def test_a_warm_tier_wakes_sleepers_before_it_creates_pods_and_sleepers_leave_first():
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "targets": {"waitingRequestsPerReplica": 2, "kvCacheUsage": 0.6},
        "scaleDown": {"stabilizationWindowSeconds": 30, "maxStep": 2, "cooldownSeconds": 10},
        "idle": "sleep",
        "warmPoolSize": 2,
    }

    config = parse_config(
        small(
            fleet={"replicas": 1},
            start_asleep=2,
            autoscaling=autoscaling,
            autoscale_interval_s=5,
            # Periodic decisions only: the burst outgrows the pool before it is all awake, so a pod is created.
            demand_interval_s=None,
            cold_start_s=20,
            wake_s=1.0,
            run_until_s=300,
            workload={"rate": 80, "duration_s": 10, "output_tokens": 200, "user_tokens": 400},
        )
    )
    sim = simulation(config)
    r = sim.run()
    assert r["requests"]["unfinished"] == 0 and r["requests"]["finished"] == r["requests"]["arrived"]
    ups = [e for e in r["fleet"]["scale_events"] if e[2] > e[1]]
    assert ups and max(e[2] for e in ups) > 3  # past the two sleepers: a pod was created too
    created = [n for n in sim.pods if n not in ("replica-0", "replica-1", "replica-2")]
    assert created, list(sim.pods)
    # Back to one awake pod and a full pool: whichever pods they are, 1 awake and 2 asleep hold GPUs at the
    # end, and every other pod left (sleepers first when the count fell, then the idlest awake ones).
    asleep = [p for p in sim.pods.values() if p.asleep and p.retired == sim.now]
    awake = [p for p in sim.pods.values() if not p.asleep and not p.draining and p.retired == sim.now]
    assert (len(awake), len(asleep)) == (1, 2), {
        n: (p.asleep, p.draining, p.retired) for n, p in sim.pods.items()
    }
    assert r["timeline"]["replicas"][-1] == 3 and r["timeline"]["ready"][-1] == 1


def test_demand_between_decisions_starts_capacity_within_seconds_of_a_burst():
    # The operator reads the routers every second and decides at once when the pods' queues exceed the
    # target; with decisions a minute apart, that is the difference between seconds and a minute.
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "targets": {"waitingRequestsPerReplica": 2},
        "scaleDown": {"stabilizationWindowSeconds": 600},
    }

    def run(demand: float | None) -> dict:
        config = parse_config(
            small(
                fleet={"replicas": 1},
                autoscaling=autoscaling,
                autoscale_interval_s=60,
                demand_interval_s=demand,
                cold_start_s=5,
                run_until_s=90,
                workload={"rate": 80, "duration_s": 20, "output_tokens": 200, "user_tokens": 400},
            )
        )
        return simulation(config).run()

    on, off = run(1.0), run(None)
    ups = [e for e in on["fleet"]["scale_events"] if e[2] > e[1]]
    assert ups and ups[0][0] <= 3.0 and "waiting_requests_per_replica" in ups[0][3], ups
    assert off["fleet"]["scale_events"] == []  # the next decision, at 60 s, finds the burst over
    assert on["latency_s"]["ttft"]["p99"] < off["latency_s"]["ttft"]["p99"] / 2


def test_sleeping_replicas_at_the_start_need_the_warm_tier():
    with pytest.raises(SimInputError, match="start_asleep"):
        parse_config(small(start_asleep=1))


def test_a_request_waiting_longer_than_the_queue_deadline_for_a_cold_start_gets_503(tmp_path):
    """As in the router: a waiter whose deadline passes while no endpoint is ready is answered 503."""
    trace = tmp_path / "t.jsonl"
    lines = [{"t": t, "prompt_tokens": 200, "output_tokens": 20} for t in (0.0, 300.0)]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    autoscaling = {
        "minReplicas": 0,
        "maxReplicas": 1,
        "targets": {"waitingRequestsPerReplica": 4},
        "scaleToZeroAfterSeconds": 60,
        "scaleDown": {"stabilizationWindowSeconds": 10},
    }

    config = parse_config(
        small(
            fleet={"replicas": 1},
            autoscaling=autoscaling,
            autoscale_interval_s=5,
            cold_start_s=30,
            trace=str(trace),
            routing={"queueTimeoutSeconds": 20},
        )
    )
    sim = simulation(config)
    r = sim.run()
    assert r["requests"]["finished"] == 1 and r["requests"]["rejected"] == 1
    assert r["requests"]["unfinished"] == 0
    assert sim.collector.rejected == ["router 503: waited 20s, no ready endpoint"]


def test_kv_events_feed_the_routers_exact_index():

    config = parse_config(small(fleet={"replicas": 2}))
    sim = simulation(config)
    sim.run()
    for name, pod in sim.pods.items():
        held = sim.router.exact.num_blocks(name)
        assert held > 0
        assert held == sum(1 for b in pod.replica.kv.pool.blocks if b.block_hash is not None)


def test_disaggregated_fleet_moves_kv_and_keeps_long_prefills_off_the_decodes():
    from tokenfleet.sim.api import build_cost, build_model, build_workload
    from tokenfleet.sim.simulator import Simulation

    workload = {
        "rate": 12,
        "duration_s": 6,
        "system_prompt_tokens": 1000,
        "long_doc_fraction": 0.5,
        "long_doc_tokens": 6000,
        "max_prompt_tokens": 8000,
        "output_tokens": 30,
    }
    aggregated = run(fleet={"replicas": 4}, workload=workload)
    config = parse_config(
        small(fleet={"replicas": 4}, workload=workload, disaggregation={"prefill_replicas": 2})
    )
    model = build_model(config)
    sim = Simulation(
        config,
        build_workload(config),
        build_cost(config, model),
        model.name,
        model.max_model_len,
        model.kv_bytes_per_token,
    )
    r = sim.run()
    rq = r["requests"]
    assert rq["finished"] == rq["arrived"] == aggregated["requests"]["arrived"] and rq["cut_short"] == 0
    dis = r["disaggregation"]
    assert dis["transfers"] == rq["finished"]  # every request with more than one token moved its KV
    assert dis["blocks_sent"] > 0 and dis["transfer_s"]["p50"] > 0
    served = r["load"]["per_replica_served"]
    assert set(served) == {"prefill-0", "prefill-1", "decode-2", "decode-3"}
    assert sum(served[n] for n in ("decode-2", "decode-3")) == rq["finished"]
    for pod in sim.pods.values():  # nothing held, nothing in use: every hold was fetched and released
        assert pod.replica.kv.usage == 0.0
    for holds in sim.handoffs._holds.values():
        assert len(holds) == 0
    # A long prompt never shares a step with decodes: the decode pods' inter-token gaps stay short (the
    # client's gap between the prefill pod's token and the decode pod's first one included).
    assert r["latency_s"]["itl"]["p99"] < 0.5 * aggregated["latency_s"]["itl"]["p99"]
    assert r["latency_s"]["tpot"]["p99"] < 0.7 * aggregated["latency_s"]["tpot"]["p99"]
    # The client's TTFT is the prefill phase's: its parts are that phase's and add up to it.
    parts = sim.collector.ttft_parts
    assert min(parts.router_queue) >= 0 and min(parts.pod_queue) >= 0 and min(parts.prefill) > 0
    for queued, waited, prefill, ttft in zip(
        parts.router_queue, parts.pod_queue, parts.prefill, sim.collector.ttft, strict=True
    ):
        assert abs(queued + waited + prefill - ttft) < 1e-9
    assert to_json(r) == to_json(
        Simulation(
            config,
            build_workload(config),
            build_cost(config, model),
            model.name,
            model.max_model_len,
            model.kv_bytes_per_token,
        ).run()
    )


def test_work_bound_keeps_a_dominant_tenant_from_skewing_load():
    """One tenant with most of the traffic: unbounded affinity piles it up; the work bound (fed by the pods'
    announcements of the requests they start) spreads it."""
    workload = {"rate": 20, "num_tenants": 3, "zipf_s": 2.0, "system_prompt_tokens": 2000}

    def spread(balance: dict) -> tuple[float, dict]:
        r = run(
            fleet={"replicas": 4},
            routing={"strategy": "prefix-affinity", "balance": balance},
            workload=workload,
        )
        served = r["load"]["per_replica_served"].values()
        return max(served) / min(served), r["routing"]

    unbounded, _ = spread({"maxRatio": None})
    bounded, reasons = spread({})
    assert reasons.get("work_bound", 0) > 0
    assert bounded <= 1.3 < unbounded


def test_a_decode_phase_passes_the_in_flight_limit_as_in_the_router_so_no_hold_expires():
    from tokenfleet.sim.api import build_cost, build_model, build_workload
    from tokenfleet.sim.simulator import Simulation

    config = parse_config(
        small(
            fleet={"replicas": 2},
            # The decode pod is past its limit of 2 at once: a decode phase goes there anyway, as the live
            # router's `Fleet.pick` sends an admitted request past the limit rather than fail it.
            routing={"maxInFlightPerEndpoint": 2},
            disaggregation={"prefill_replicas": 1, "hold_seconds": 0.05},
            workload={"rate": 10, "duration_s": 5, "output_tokens": 200},
        )
    )
    model = build_model(config)
    sim = Simulation(
        config,
        build_workload(config),
        build_cost(config, model),
        model.name,
        model.max_model_len,
        model.kv_bytes_per_token,
    )
    r = sim.run()
    assert r["requests"]["finished"] == r["requests"]["arrived"] and r["requests"]["cut_short"] == 0
    dis = r["disaggregation"]
    # No decode phase waited in the router, so no hold expired before its fetch.
    assert dis["fallbacks_to_recompute"] == 0 and dis["transfers"] == r["requests"]["finished"]
    for pod in sim.pods.values():
        assert pod.replica.kv.usage == 0.0  # expired holds were released, fetched ones freed


def test_router_index_follows_the_pods_cache_through_evictions():
    from tokenfleet.sim.api import build_workload
    from tokenfleet.sim.simulator import Simulation

    model = model_profile("8b")
    cost = LinearCost(
        0.01, 1e-5, 1e-4, 0.0, 0.0, kv_cache_bytes=400 * 16 * model.kv_bytes_per_token, model=model
    )
    config = parse_config(small(fleet={"replicas": 2}, workload={"rate": 6, "output_tokens": 100}))
    sim = Simulation(config, build_workload(config), cost, model.name, 4096)
    r = sim.run()
    computed = r["cache"]["prompt_tokens"] - r["cache"]["cached_tokens"] + r["requests"]["finished"] * 100
    assert computed > 2 * 2 * 400 * 16  # the pods computed far more KV than their caches hold: evictions
    for name, pod in sim.pods.items():
        cached = {b.block_hash for b in pod.replica.kv.pool.blocks if b.block_hash is not None}
        assert sim.router.exact.blocks(name) == cached


def test_tensor_parallel_decode_pods_compute_the_prompt_themselves():
    r = run(
        model="8b",
        fleet={"gpu": "h100", "replicas": 2, "tp": 2},
        disaggregation={"prefill_replicas": 1},
        workload={"rate": 4, "duration_s": 4},
    )
    dis = r["disaggregation"]
    assert r["requests"]["finished"] == r["requests"]["arrived"]
    assert dis["blocks_sent"] == 0 and dis["fallbacks_to_recompute"] == dis["transfers"] > 0


def test_request_overhead_delays_every_request_by_exactly_that_and_loses_none(tmp_path):
    """A served profile's per-request overhead: an isolated request's TTFT and E2E grow by exactly it;
    under load nothing is lost, and a fleet scaled down while requests are on their way still serves them."""
    trace = tmp_path / "t.jsonl"
    lines = [{"t": i * 5.0, "prompt_tokens": 100, "output_tokens": 10} for i in range(4)]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    model = model_profile("8b")
    fast = LinearCost(0.01, 1e-4, 1e-3, 0.0, 0.0, kv_cache_bytes=2**34, model=model)
    slow = LinearCost(0.01, 1e-4, 1e-3, 0.0, 0.0, kv_cache_bytes=2**34, model=model, request_overhead_s=0.05)
    config = parse_config(small(fleet={"replicas": 1}, trace=str(trace)))
    a, b = simulate(config, cost=fast)["latency_s"], simulate(config, cost=slow)["latency_s"]
    for figure in ("ttft", "e2e"):
        assert abs(b[figure]["p50"] - a[figure]["p50"] - 0.05) < 1e-6
    assert abs(b["tpot"]["p50"] - a["tpot"]["p50"]) < 1e-9
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "targets": {"waitingRequestsPerReplica": 2},
        "scaleDown": {"stabilizationWindowSeconds": 5, "maxStep": 2, "cooldownSeconds": 2},
    }
    busy = parse_config(
        small(
            fleet={"replicas": 1},
            autoscaling=autoscaling,
            autoscale_interval_s=1,
            cold_start_s=2,
            run_until_s=120,
            workload={"rate": 200, "duration_s": 10, "output_tokens": 50},
        )
    )
    r = simulate(busy, cost=LinearCost(0.01, 1e-4, 1e-3, 0.0, 0.0, 2**34, model, request_overhead_s=0.2))
    assert [e for e in r["fleet"]["scale_events"] if e[2] < e[1]]  # it did scale down
    assert r["requests"]["unfinished"] == 0 and r["requests"]["finished"] == r["requests"]["arrived"]
