"""LoRA adapters in the simulator: exact adapter-keyed prefix hashing, placement keeping an adapter on its
pods, the pod's adapter bound (with nothing lost while a request waits for room), and config errors."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.config import CacheConfig, SchedulerConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra, with_adapter
from tokenfleet.runtime.router.config import RoutingSpec
from tokenfleet.sim.adapters import BUSY, PARKED, PodAdapters, sim_adapter
from tokenfleet.sim.api import simulate
from tokenfleet.sim.config import LoRASpec, parse_config
from tokenfleet.sim.cost_model import LinearCost
from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.model_profile import model_profile
from tokenfleet.sim.replica import ADAPTERS_BUSY, ReplicaConfig, RequestRecord, SimReplica
from tokenfleet.sim.router import SimRouter
from tokenfleet.sim.workload import SimRequest, Workload, WorkloadSpec

BS = 16
MODEL = "m"


class _Pod:
    """One replica driven by hand: steps back to back, adapter loads completed when they are due."""

    def __init__(self, lora: LoRASpec) -> None:
        model = model_profile("8b")
        cost = LinearCost(
            0.01, 1e-5, 1e-4, 0.0, 1e-9, kv_cache_bytes=400 * BS * model.kv_bytes_per_token, model=model
        )
        config = ReplicaConfig(
            SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
            CacheConfig(block_size=BS),
            4096,
            MODEL,
            lora,
        )
        self.now = 0.0
        self.loads: list[tuple[float, str]] = []
        self.replica = SimReplica(
            "r0",
            cost,
            config,
            lambda: self.now,
            lambda _: None,
            None,
            lambda _, a, at: self.loads.append((at, a)),
        )
        self.done: dict[str, RequestRecord] = {}
        self.max_batch_adapters = 0

    def add(self, sreq: SimRequest) -> RequestRecord:
        return self.replica.add(sreq, self.now)

    def run(self) -> None:
        replica = self.replica
        while replica.has_work() or self.loads:
            duration = replica.start_step(self.now)
            end = self.now + duration if duration is not None else float("inf")
            running = {r.lora for r in replica.scheduler.running if r.lora is not None}
            self.max_batch_adapters = max(self.max_batch_adapters, len(running))
            self.loads.sort()
            if self.loads and self.loads[0][0] <= end:  # a load completes first (or nothing runs)
                if duration is not None:
                    self.now = end
                    self._finish()
                at, adapter = self.loads.pop(0)
                self.now = max(self.now, at)
                assert not replica.adapter_loaded(adapter, self.now)
                continue
            assert duration is not None
            self.now = end
            self._finish()

    def _finish(self) -> None:
        for rec in self.replica.finish_step(self.now):
            self.done[rec.request.request_id] = rec


def _request(rid: str, prompt: list[int], adapter: str | None, router: SimRouter, out: int = 4) -> SimRequest:
    sreq = SimRequest(rid, 0.0, prompt, [7] * out, adapter=adapter)
    router.hash_prompt(sreq)
    return sreq


def test_adapter_blocks_are_keyed_apart_from_base_and_other_adapters():
    router = SimRouter(RoutingSpec(), BS, MODEL, lambda: 0.0)
    prompt = list(range(1000, 1000 + 8 * BS))
    hashes = {a: _request(f"h-{a}", prompt, a, router).block_hashes for a in (None, "adapter-0", "adapter-1")}
    # The router's hashes are the pod's: the engine's function under the adapter's `name@digest` key.
    for adapter, h in hashes.items():
        key = None if adapter is None else sim_adapter(adapter).cache_key
        assert h == block_hashes_for(prompt, BS, with_adapter(hash_extra(MODEL), None, key))
    assert sim_adapter("adapter-0").cache_key.startswith("adapter-0@")
    assert len({h for hs in hashes.values() for h in hs}) == 3 * 8  # no block shared between the three

    pod = _Pod(LoRASpec(load_s=0.01))
    for i, adapter in enumerate([None, "adapter-0", "adapter-1", "adapter-0", None]):
        rid = f"q{i}"
        pod.add(_request(rid, prompt, adapter, router))
        pod.run()
        cached = pod.done[rid].num_cached_tokens
        if i < 3:  # the first of each key: the blocks under the other keys are no hit
            assert cached == 0, (adapter, cached)
        else:  # the same key again: its own blocks are
            assert cached == len(prompt) - BS, (adapter, cached)


def _fleet(placement: str) -> dict:
    return simulate(
        parse_config(
            {
                "model": "8b",
                "fleet": {"gpu": "h100", "replicas": 4},
                "probe_interval_s": 0.01,
                "lora": {"placement": placement, "max_adapters": 4, "max_loras": 4, "load_s": 0.005},
                "workload": {
                    "rate": 3,
                    "duration_s": 30,
                    "num_tenants": 3,
                    "system_prompt_tokens": 64,
                    "user_tokens": 64,
                    "output_tokens": 32,
                    "adapters": {"count": 12, "zipf": 1.0},
                    "seed": 1,
                },
            }
        )
    )


def test_placement_keeps_each_adapter_on_one_pod_and_adapter_blind_routing_swaps():
    placed, blind = _fleet("placement"), _fleet("none")
    lora = placed["lora"]
    assert placed["requests"]["finished"] == placed["requests"]["arrived"] > 50
    assert lora["adapter_swaps"] == 0
    assert lora["adapter_loads"] == lora["adapters_served"]  # each adapter loaded once, on one pod
    assert lora["pods_per_adapter_mean"] == 1.0
    assert blind["requests"]["finished"] == blind["requests"]["arrived"]
    assert blind["lora"]["adapter_swaps"] >= 10
    assert blind["lora"]["adapter_loads"] >= 3 * lora["adapter_loads"]
    assert blind["lora"]["top_adapter_pods"] == 4


def test_a_pod_holds_at_most_max_adapters_and_refuses_one_more_while_all_are_in_use():
    router = SimRouter(RoutingSpec(), BS, MODEL, lambda: 0.0)
    pod = _Pod(LoRASpec(max_adapters=3, max_loras=2, load_s=0.02))
    records = []
    for i in range(12):  # five adapters at once on a pod that holds three, two per step
        prompt = list(range(2000 + 100 * i, 2000 + 100 * i + 3 * BS))
        records.append(pod.add(_request(f"q{i}", prompt, f"adapter-{i % 5}", router, out=20)))
    adapters = pod.replica.adapters
    assert adapters is not None
    # Adapters 3 and 4 find every place in use: refused as the server refuses them (nothing kept).
    refused = [r.request.request_id for r in records if r.rejected is not None]
    assert refused == ["q3", "q4", "q8", "q9"]
    assert all(r.rejected == ADAPTERS_BUSY for r in records if r.rejected is not None)
    assert adapters.refusals == 4 and adapters.room(0.0) == 0
    assert len(adapters.held) == 3 and adapters.num_parked == 8  # the rest wait for their adapter's load
    assert pod.replica.num_waiting == 8  # parked requests count in the load report
    pod.run()
    assert sorted(pod.done) == sorted(r.request.request_id for r in records if r.rejected is None)
    assert all(len(rec.request.output) == rec.num_emitted for rec in pod.done.values())
    assert adapters.loads == 3 and adapters.swaps == 0 and adapters.room(0.0) == 3
    assert pod.max_batch_adapters == 2  # the scheduler's max_loras
    waited = [r.adapter_wait for r in records if r.rejected is None]
    assert min(waited) == pytest.approx(0.02) and all(w >= 0.02 - 1e-9 for w in waited)
    # Idle now: a fourth adapter evicts the least recently used one.
    again = pod.add(_request("q12", list(range(9000, 9000 + 3 * BS)), "adapter-3", router))
    assert again.rejected is None and adapters.swaps == 1 and adapters.max_held == 3


def test_the_fleet_bound_holds_with_a_busy_pod():
    r = simulate(
        parse_config(
            {
                "model": "8b",
                "fleet": {"gpu": "h100", "replicas": 1},
                "lora": {"max_adapters": 2, "max_loras": 2},
                "workload": {"rate": 20, "duration_s": 5, "adapters": {"count": 6, "zipf": 0.5}, "seed": 3},
            }
        )
    )
    # One pod, two places, six adapters: what finds both places in use is refused (the pod's 503; no
    # other pod to try), nothing is left hanging, and the bound holds.
    rq, lora = r["requests"], r["lora"]
    assert rq["arrived"] > 50 and rq["finished"] > 0 and rq["unfinished"] == 0
    assert rq["finished"] + rq["rejected"] == rq["arrived"]
    assert rq["rejected"] == lora["pod_refusals"] > 0 and lora["retried_elsewhere"] == 0
    assert lora["max_held"] == 2 and lora["adapter_loads"] >= 2


def test_adapter_draws_are_seeded_zipf_and_sessions_keep_theirs():
    spec = WorkloadSpec(
        rate=200,
        duration_s=10,
        session_fraction=0.5,
        think_time_s=0,
        adapters={"count": 10, "zipf": 1.0},
        seed=4,
    )
    first = [(r.request_id, r.adapter) for r in Workload(spec).arrivals()]
    assert first == [(r.request_id, r.adapter) for r in Workload(spec).arrivals()]
    names = [a for _, a in first]
    assert names.count("adapter-0") > 2 * names.count("adapter-2") > 0
    w = Workload(spec)
    opener = next(r for r in w.arrivals() if r.session is not None)
    follow = w.follow_up(opener, 1.0)
    assert follow is not None and follow.adapter == opener.adapter
    plain = Workload(spec.model_copy(update={"adapters": None}))
    assert [r.prompt for r in plain.arrivals()][:50] == [r.prompt for r in Workload(spec).arrivals()][:50]
    some_base = WorkloadSpec(rate=200, duration_s=5, adapters={"count": 3, "base_fraction": 0.5})
    share = sum(r.adapter is None for r in Workload(some_base).arrivals()) / (200 * 5)
    assert 0.4 < share < 0.6


@pytest.mark.parametrize(
    "config, field",
    [
        ({"workload": {"adapters": {"count": 10, "zipf": -0.5}}}, "workload.adapters.zipf"),
        ({"workload": {"adapters": {"count": 0}}}, "workload.adapters.count"),
        ({"workload": {"adapters": {"count": 5, "base_fraction": 1.5}}}, "workload.adapters.base_fraction"),
        ({"lora": {"max_adapters": 0}}, "lora.max_adapters"),
        ({"lora": {"max_adapters": 4, "max_loras": 8}}, "lora.max_loras"),
        ({"lora": {"load_s": -1}}, "lora.load_s"),
        ({"lora": {"placement": "random"}}, "lora.placement"),
        (
            {
                "workload": {"adapters": {"count": 5}},
                "fleet": {"replicas": 2},
                "disaggregation": {"prefill_replicas": 1},
            },
            "workload.adapters",
        ),
        ({"workload": {"tenants": [{"name": "a", "rate": 1}], "adapters": {"count": 5}}}, "workload"),
    ],
)
def test_bad_lora_settings_are_refused_naming_the_field(config, field):
    with pytest.raises(SimInputError) as e:
        parse_config(config)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")


def _busy_fleet(max_copies: int | None) -> dict:
    """Two adapters on four pods, busy enough that the hot one's holders spill without a bound."""
    return simulate(
        parse_config(
            {
                "model": "8b",
                "fleet": {"gpu": "h100", "replicas": 4},
                "probe_interval_s": 0.05,
                "lora": {"max_adapters": 2, "max_loras": 2, "load_s": 0.005, "max_copies": max_copies},
                "workload": {
                    "rate": 120,
                    "duration_s": 5,
                    "num_tenants": 3,
                    "system_prompt_tokens": 64,
                    "user_tokens": 64,
                    "output_tokens": 32,
                    "adapters": {"count": 2, "zipf": 1.0},
                    "seed": 1,
                },
            }
        )
    )


def test_max_copies_bounds_the_pods_holding_an_adapter():
    """The router's `within_max_copies` in the simulator (`lora.max_copies`): without it the hot adapter's
    busy holders spill to other pods; with a bound of one, a busy fleet serves it from one pod only."""
    free, bounded = _busy_fleet(None), _busy_fleet(1)
    assert free["lora"]["top_adapter_pods"] > 1
    assert bounded["lora"]["top_adapter_pods"] == 1
    assert bounded["requests"]["finished"] == bounded["requests"]["arrived"]


def test_a_pin_loads_its_adapter_keeps_it_from_eviction_and_counts_as_a_place_in_use():
    """The operator's minCopies on a simulated pod, as `LoRAManager.pin` keeps them: a pin loads the adapter
    the pod lacks, a pinned adapter is never evicted for another while its lease lasts (the pod refuses the
    other instead), it is no room in the load report, and the lease ends by itself."""
    loads: list[str] = []
    pod = PodAdapters(2, 0.01, lambda name, _: loads.append(name))
    assert pod.pin("a", until=30.0, now=0.0)
    assert loads == ["a"] and pod.load_done("a") == []  # loaded for the pin: no request waited for it
    assert pod.loaded() == {"a": sim_adapter("a").cache_key}
    assert pod.room(1.0) == 1 and pod.pinned(1.0) == ["a"]
    assert pod.request("b", "req-b", 1.0) == PARKED
    pod.load_done("b")
    pod.release("b")  # b idle now: evictable; a pinned: not
    assert pod.request("c", "req-c", 2.0) == PARKED
    assert sorted(pod.held) == ["a", "c"] and pod.swaps == 1
    # Every place in use or pinned: the next adapter is refused, the pin still holds.
    assert pod.request("d", "req-d", 3.0) == BUSY
    assert not pod.pin("e", until=40.0, now=3.0)  # no room for a second pin either
    assert sorted(pod.held) == ["a", "c"] and pod.room(3.0) == 0
    # The lease ends: "a" is an idle adapter like any other, and gives its place to the next one.
    assert pod.pinned(30.0) == [] and pod.room(30.0) == 1
    assert pod.request("d", "req-d", 30.0) == PARKED
    assert sorted(pod.held) == ["c", "d"]


def _pinned_fleet(min_copies: dict[str, int]) -> dict:
    """Twenty adapters on four pods that hold three each: a rarely requested adapter loses its copies
    unless pinned."""
    return simulate(
        parse_config(
            {
                "model": "8b",
                "fleet": {"gpu": "h100", "replicas": 4},
                "probe_interval_s": 0.05,
                "lora": {
                    "max_adapters": 3,
                    "max_loras": 3,
                    "load_s": 0.005,
                    "min_copies": min_copies,
                    "pin_interval_s": 1.0,
                },
                "workload": {
                    "rate": 40,
                    "duration_s": 10,
                    "num_tenants": 3,
                    "system_prompt_tokens": 64,
                    "user_tokens": 64,
                    "output_tokens": 32,
                    "adapters": {"count": 20, "zipf": 1.0},
                    "seed": 1,
                },
            }
        )
    )


def test_min_copies_are_pinned_on_that_many_pods_through_the_run():
    """`lora.min_copies` in the simulator: the operator's adapter tick (operator/adapter_copies.py) pins the
    least requested adapter on three of the four pods, and every tick after the first finds them held,
    while the other adapters come and go in the places left."""
    free = _pinned_fleet({"adapter-19": 0})
    pinned = _pinned_fleet({"adapter-19": 3})
    assert free["lora"]["min_copies_met"] is None  # no minimum: the operator pins nothing
    assert free["lora"]["min_copies_held"] == {"adapter-19": 0}  # evicted for the busier adapters
    assert pinned["lora"]["min_copies_held"] == {"adapter-19": 3}
    assert pinned["lora"]["min_copies_met"] == 1.0
    for r in (free, pinned):
        assert r["requests"]["finished"] + r["requests"]["rejected"] == r["requests"]["arrived"]
