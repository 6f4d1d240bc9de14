"""Fair share between tenants in the simulator's router, as the live router runs it (`FairShare` counters
ordering `WaitQueue`), and the per-tenant / per-priority results that show it."""

from __future__ import annotations

import random
from collections import Counter

from tokenfleet.runtime.engine.fair_share import FairShare
from tokenfleet.runtime.router.config import RoutingSpec
from tokenfleet.runtime.router.priority import WaitQueue
from tokenfleet.sim.api import build_cost, build_model, build_workload
from tokenfleet.sim.config import parse_config
from tokenfleet.sim.router import SimRouter
from tokenfleet.sim.simulator import Simulation
from tokenfleet.sim.workload import SimRequest


def request(rid: str, tenant: str, prompt: int = 100) -> SimRequest:
    return SimRequest(rid, 0.0, list(range(1000, 1000 + prompt)), [7] * 10, tenant=tenant)


def served_order(fair: bool) -> list[str]:
    """One pod taking one request at a time: A's first request runs, four more of A's wait, then B's."""
    router = SimRouter(
        RoutingSpec(max_in_flight_per_endpoint=1, fair_share={"enabled": fair}), 16, "m", lambda: 0.0
    )
    router.add_endpoint("p0")
    first = request("A1", "A")
    router.arrived(first)
    assert router.pick(first) == "p0"
    for sreq in [request(f"A{i}", "A") for i in range(2, 6)] + [request("B1", "B")]:
        router.arrived(sreq)
        assert not isinstance(router.enqueue(sreq), str)
    order, running = [], first
    while True:
        router.release("p0")
        if fair:
            router.streamed(Counter({running.tenant: 10}))  # its answer, as the pod generated it
        router.ended(running)
        sent = router.dispatch_queued()
        if not sent:
            break
        assert len(sent) == 1
        running = sent[0][0]
        order.append(running.request_id)
    if fair:
        assert not router.fair.active  # every request left its tenant
    return order


def test_fair_share_sends_a_light_tenant_ahead_of_a_flood():
    assert served_order(fair=False) == ["A2", "A3", "A4", "A5", "B1"]
    # B joins at A's counter (no credit for its idle past), and A's first answer tips it: B goes next.
    assert served_order(fair=True) == ["B1", "A2", "A3", "A4", "A5"]


def test_the_order_moves_with_each_send_as_the_queue_would_order_it_again():
    """`_fair_order` yields what `WaitQueue.ordered()` would put first after each send charged its tenant."""
    rng = random.Random(5)
    pushes = [(rng.choice("abcd"), rng.choice((0, 1))) for _ in range(60)]
    charges = [rng.randint(1, 500) for _ in pushes]

    def setup() -> tuple[FairShare, WaitQueue]:
        fair = FairShare()
        queue: WaitQueue = WaitQueue(1000, lambda: 0.0, fair.counter)
        for i, (tenant, priority) in enumerate(pushes):
            fair.join(tenant)
            queue.push(i, priority, 60.0, "", tenant)
        for tenant in "abcd":
            fair.charge_prompt(tenant, rng.randint(0, 300))
        return fair, queue

    state = rng.getstate()
    fair, queue = setup()
    merged = []
    for w, cost in zip(SimRouter._fair_order(queue), charges, strict=True):
        merged.append(w.item)
        fair.charge_prompt(w.tenant, cost)
    rng.setstate(state)
    fair, queue = setup()
    again = []
    for cost in charges:
        w = queue.ordered()[0]
        queue.remove(w)
        again.append(w.item)
        fair.charge_prompt(w.tenant, cost)
    assert merged == again


def _simulation(fair: bool, tenants: list[dict], **routing) -> Simulation:
    config = parse_config(
        {
            "model": "8b",
            "fleet": {"gpu": "h100", "replicas": 1},
            "routing": {"maxInFlightPerEndpoint": 8, "fairShare": {"enabled": fair}, **routing},
            "breakdown": ["tenant", "priority"],
            "workload": {"duration_s": 10, "tenants": tenants, "seed": 3},
        }
    )
    model = build_model(config)
    return Simulation(
        config, build_workload(config), build_cost(config, model), model.name, model.max_model_len
    )


FLOOD = {"name": "A", "rate": 30, "user_tokens": 200, "output_tokens": 100}
LIGHT = {"name": "B", "rate": 2, "user_tokens": 200, "output_tokens": 100, "start_s": 2}


def test_a_light_tenant_keeps_its_latency_beside_a_flood_only_with_fair_share():
    runs = {}
    for fair in (False, True):
        sim = _simulation(fair, [FLOOD, LIGHT], queueTimeoutSeconds=60)
        runs[fair] = sim.run()
        if fair:
            assert not sim.router.fair.active  # every request left its tenant once it ended
        else:
            assert sim.router.fair is None and sim.router.queue.order is None
    off, on = (runs[f]["by_tenant"]["B"]["latency_s"]["ttft"] for f in (False, True))
    assert off["p50"] > 3.0  # behind A's backlog, first come first served
    assert on["p99"] < 0.5 and on["p99"] * 10 < off["p50"]
    for r in runs.values():  # everything is served in both; only the order differs
        assert r["requests"]["finished"] == r["requests"]["arrived"]
    # A pays for it: its own backlog waits longer.
    assert (
        runs[True]["by_tenant"]["A"]["latency_s"]["ttft"]["p50"]
        >= runs[False]["by_tenant"]["A"]["latency_s"]["ttft"]["p50"]
    )


def test_one_tenant_orders_as_without_fair_share_and_is_charged_what_it_was_served():
    runs = []
    for fair in (False, True):
        sim = _simulation(fair, [FLOOD], queueTimeoutSeconds=60)
        r = sim.run()
        r.pop("config")
        runs.append(r)
    assert runs[0] == runs[1]
    c = sim.collector
    assert c.num_finished == c.num_arrived and not c.rejected
    # Prompt tokens x 1 when sent, output tokens x 2 when done (the default weights).
    assert sim.router.fair.counter("A") == c.prompt_tokens + 2 * c.output_tokens


def test_refused_requests_leave_their_tenant():
    sim = _simulation(True, [FLOOD, LIGHT], queueTimeoutSeconds=1, maxQueued=20)
    r = sim.run()
    reasons = {why.split(":")[0] for why in sim.collector.rejected}
    assert reasons == {"router 429"} and any("waited" in w for w in sim.collector.rejected)
    assert any("queued in the router" in w for w in sim.collector.rejected)
    assert not sim.router.fair.active
    assert r["requests"]["unfinished"] == 0


def test_breakdowns_add_up_to_the_totals_and_are_absent_unless_asked():
    sim = _simulation(False, [FLOOD, {**LIGHT, "priority": 0}], queueTimeoutSeconds=1, maxQueued=20)
    r = sim.run()
    for dim, names in (("by_tenant", {"A", "B"}), ("by_priority", {"0", "1"})):
        classes = r[dim]
        assert set(classes) == names
        for key in ("arrived", "finished", "rejected", "unfinished"):
            assert sum(c["requests"][key] for c in classes.values()) == r["requests"][key]
        tokens = sum(c["output_tokens_per_s"] for c in classes.values())
        assert abs(tokens - r["throughput"]["output_tokens_per_s"]) < 1e-3 * tokens
    assert r["by_priority"]["0"]["requests"] == r["by_tenant"]["B"]["requests"]
    plain = parse_config({"model": "8b", "fleet": {"gpu": "h100", "replicas": 1}})
    model = build_model(plain)
    sim = Simulation(plain, build_workload(plain), build_cost(plain, model), model.name, model.max_model_len)
    assert not {"by_tenant", "by_priority"} & set(sim.run())


def test_ttft_splits_into_router_queue_pod_queue_and_prefill():
    """Each request's TTFT is its router queue (arrival to its pod), pod queue (to its first step) and
    prefill (to its first token), none negative; their means add up to the TTFT's, overall and per class.
    Fair share off, the flood held in the router's queue makes both tenants wait there."""
    sim = _simulation(False, [FLOOD, {**LIGHT, "priority": 0}], queueTimeoutSeconds=1, maxQueued=20)
    r = sim.run()
    parts = sim.collector.ttft_parts
    assert min(parts.router_queue) >= 0 and min(parts.pod_queue) >= 0 and min(parts.prefill) > 0
    for lat in (r["latency_s"], *(c["latency_s"] for c in r["by_tenant"].values())):
        total = sum(lat[part]["mean"] for part in ("router_queue", "pod_queue", "prefill"))
        assert abs(total - lat["ttft"]["mean"]) <= 1e-5 * lat["ttft"]["mean"]
    for tenant in ("A", "B"):
        lat = r["by_tenant"][tenant]["latency_s"]
        assert lat["router_queue"]["mean"] > lat["pod_queue"]["mean"]
