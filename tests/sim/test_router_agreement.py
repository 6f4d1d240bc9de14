"""The live router and the simulator's router decide alike, request for request.

One seeded sequence — requests over a few shared system prompts and sessions, load reports, the pods' KV
events (stored, scheduled, removed, cleared), requests ending, time passing — goes to the live `Fleet`
(fake endpoints: no network, the KV events as the wire replies its followers apply, an injected clock)
and to `SimRouter` (the engine's event objects, the same clock). Both must choose the same endpoint, or
both say the request must wait, every time. Both wrap `runtime/router/decision.py`; this fails when
either side's own part (the candidate filter, the load figure, the prefix-match merge, the tie-break key,
the work-bound feed) drifts from the other's.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_extra
from tokenfleet.runtime.engine.kv_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PrefillScheduled,
)
from tokenfleet.runtime.kv_wire import KVEventsReply, KVWireEvent
from tokenfleet.runtime.router.config import Backend, RouterConfig, RoutingSpec
from tokenfleet.runtime.router.fleet import Fleet, PromptKey
from tokenfleet.runtime.router.metrics import RouterMetrics
from tokenfleet.runtime.router.prompt_blocks import token_block_hashes
from tokenfleet.sim.router import SimRouter
from tokenfleet.sim.workload import SimRequest

MODEL = "m"
BLOCK = 16
NUM_PODS = 5
NUM_REQUESTS = 400
LIMIT = 4  # small, so requests also meet the in-flight limit


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Pod:
    """What the test plays a pod as: its KV-event stream, in both forms."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seq = 0
        self.held: list[tuple[bytes, ...]] = []  # stored runs, to remove some later

    def reply(self, wire: list[KVWireEvent], reset: bool = False) -> dict:
        self.seq += 1
        extra = hash_extra(MODEL)
        return KVEventsReply("epoch", self.seq, BLOCK, extra, tuple(wire), reset).to_json()


def stored(hashes: tuple[bytes, ...]):
    return BlockStored(hashes, None, (), BLOCK), KVWireEvent("stored", hashes)


def removed(hashes: tuple[bytes, ...]):
    return BlockRemoved(hashes), KVWireEvent("removed", hashes)


def scheduled(hashes: tuple[bytes, ...]):
    return PrefillScheduled(hashes), KVWireEvent("scheduled", hashes)


def cleared():
    return AllBlocksCleared(), KVWireEvent("cleared")


def both_routers(strategy: str, routing: dict | None = None):
    """A live Fleet and a SimRouter over the same five pods on one clock, and a feed of KV events to both."""
    clock = Clock()
    spec = RoutingSpec.model_validate(
        {"strategy": strategy, "maxInFlightPerEndpoint": LIMIT, **(routing or {})}
    )
    urls = [f"http://pod-{i}.test:8000" for i in range(NUM_PODS)]
    backends = tuple(Backend(name=f"p{i}", model=MODEL, url=u, block_size=BLOCK) for i, u in enumerate(urls))
    fleet = Fleet(
        RouterConfig(routing=spec, backends=backends), RouterMetrics(), None, clock=clock, watch=False
    )
    sim = SimRouter(spec, BLOCK, MODEL, clock)
    pods = {u: Pod(u) for u in urls}
    for b in backends:
        fleet.sync_backend(b, [b.url])
        sim.add_endpoint(b.url)
    for ep in fleet.endpoints.by_id.values():
        fleet.report(ep, True)  # a probe answered: in rotation
        fleet.kv_reply(ep.id, pods[ep.id].reply([], reset=True))  # the follower's first (resync) reply

    def events(url: str, pairs) -> None:
        sim.apply_events(url, [engine for engine, _ in pairs])
        fleet.kv_reply(url, pods[url].reply([wire for _, wire in pairs]))

    return clock, urls, fleet, sim, pods, events


def pod_side(rng: random.Random, clock: Clock, urls, fleet, sim, pods, events, running) -> None:
    """One moment of the pods' side, the same to both routers: requests ending, load reports, evictions."""
    for item in [r for r in running if r[0] <= clock.t]:
        running.remove(item)
        fleet.release(fleet.endpoints.by_id[item[1]])
        sim.release(item[1])
    for url in urls:
        if rng.random() < 0.2:
            running_n, waiting_n, kv = rng.randint(0, 6), rng.randint(0, 4), rng.random()
            ep = fleet.endpoints.by_id[url]
            ep.load_report(running_n, waiting_n, kv)
            sim.report(url, running_n + waiting_n, kv)
    url = rng.choice(urls)
    pod = pods[url]
    if pod.held and rng.random() < 0.15:
        victim = pod.held.pop(rng.randrange(len(pod.held)))
        events(url, [removed(victim[rng.randrange(len(victim)) :])])
    elif rng.random() < 0.01:
        pod.held.clear()
        events(url, [cleared()])


def next_prompt(rng: random.Random, systems, sessions) -> tuple[list[int], str | None]:
    """A system prompt, a session's history, or neither; then a fresh user turn."""
    session = None
    if rng.random() < 0.3:
        session = f"s{rng.randrange(20)}"
        tokens = sessions.get(session) or list(rng.choice(systems))
    else:
        tokens = list(rng.choice(systems)) if rng.random() < 0.8 else []
    tokens += [rng.randrange(1, 30000) for _ in range(rng.randint(1, 3 * BLOCK))]
    if session is not None:
        sessions[session] = tokens
    return tokens, session


def started(rng: random.Random, clock: Clock, url: str, tokens, pods, events, running) -> None:
    """The pod runs the request: it announces it when it first schedules it, stores its blocks once
    computed, and finishes a while later."""
    hashes = tuple(token_block_hashes(tokens, BLOCK, hash_extra(MODEL), None))
    running.append((clock.t + rng.uniform(0.2, 5.0), url, hashes))
    if rng.random() < 0.8:
        events(url, [scheduled(hashes)])
    if hashes and rng.random() < 0.7:
        events(url, [stored(hashes)])
        pods[url].held.append(hashes)


def run_both(strategy: str, seed: int, routing: dict | None = None) -> tuple[list, Counter]:
    """Each request is picked at once by both, or both say it must wait (then it is dropped on both)."""
    rng = random.Random(seed)
    clock, urls, fleet, sim, pods, events = both_routers(strategy, routing)
    systems = [[rng.randrange(1, 30000) for _ in range(BLOCK * rng.randint(1, 6))] for _ in range(6)]
    sessions: dict[str, list[int]] = {}
    running: list[tuple[float, str, tuple[bytes, ...]]] = []  # (ends at, endpoint, the prompt's hashes)
    picks: list[str | None] = []
    live_reasons: Counter = Counter()
    for i in range(NUM_REQUESTS):
        clock.t += rng.expovariate(8.0)
        pod_side(rng, clock, urls, fleet, sim, pods, events, running)
        tokens, session = next_prompt(rng, systems, sessions)
        targets = fleet.targets(MODEL)
        live_id = None
        if fleet.has_capacity(targets):  # else the live request waits in the gate
            pick = fleet.pick(targets, PromptKey(tuple(tokens), "", None), session, frozenset())
            assert pick is not None
            fleet.acquire(pick.endpoint)
            fleet.record_route(pick)
            live_id = pick.endpoint.id
            live_reasons[pick.decision.reason] += 1
        sim_id = sim.pick(SimRequest(f"r{i}", clock.t, tokens, [1], session=session), "both")
        assert live_id == sim_id, (
            f"{strategy} seed {seed}: request {i} went to {live_id} live, {sim_id} simulated"
        )
        picks.append(live_id)
        if live_id is not None:
            started(rng, clock, live_id, tokens, pods, events, running)
    assert sim.decisions == dict(live_reasons)
    return picks, live_reasons


async def run_both_queued(strategy: str, seed: int) -> list[tuple[str, str]]:
    """Requests that cannot go wait: in the live gate (asyncio tasks) and in the simulator's queue, with
    priorities. Both must send the same requests to the same endpoints in the same order."""
    rng = random.Random(seed)
    clock, urls, fleet, sim, pods, events = both_routers(strategy)
    systems = [[rng.randrange(1, 30000) for _ in range(BLOCK * rng.randint(1, 6))] for _ in range(6)]
    sessions: dict[str, list[int]] = {}
    running: list[tuple[float, str, tuple[bytes, ...]]] = []
    prompts: dict[str, list[int]] = {}
    live: list[tuple[str, str]] = []  # (request, endpoint), in the order sent
    simulated: list[tuple[str, str]] = []
    tasks = []

    async def live_request(rid: str, tokens: list[int], session: str | None, priority: int) -> None:
        targets = fleet.targets(MODEL)
        await fleet.gate.wait_for(lambda: fleet.has_capacity(targets), priority, 3600.0, MODEL)
        pick = fleet.pick(targets, PromptKey(tuple(tokens), "", None), session, frozenset())
        assert pick is not None
        fleet.acquire(pick.endpoint)
        fleet.record_route(pick)
        live.append((rid, pick.endpoint.id))

    def sim_dispatch() -> None:
        simulated.extend((sreq.request_id, name) for sreq, name, _, _ in sim.dispatch_queued())

    async def settle() -> None:
        """Let woken waiters run (each wakes the next as it leaves the queue), then compare."""
        for _ in range(3 * NUM_PODS * LIMIT):
            await asyncio.sleep(0)
        assert live == simulated, f"{strategy} seed {seed}: live {live[-5:]}, simulated {simulated[-5:]}"

    done = 0
    for i in range(NUM_REQUESTS):
        clock.t += rng.expovariate(9.0)
        pod_side(rng, clock, urls, fleet, sim, pods, events, running)
        sim_dispatch()
        await settle()
        for rid, url in live[done:]:
            started(rng, clock, url, prompts.pop(rid), pods, events, running)
        done = len(live)
        tokens, session = next_prompt(rng, systems, sessions)
        rid, priority = f"r{i}", rng.randrange(3)
        prompts[rid] = tokens
        tasks.append(asyncio.create_task(live_request(rid, tokens, session, priority)))
        sreq = SimRequest(rid, clock.t, tokens, [1], priority=priority, session=session)
        if sim.queue:  # behind the waiters, as the gate admits (the simulator's _route)
            sim.enqueue(sreq)
            sim_dispatch()
        elif (name := sim.pick(sreq)) is not None:
            simulated.append((rid, name))
        else:
            sim.enqueue(sreq)
        await settle()
        for rid, url in live[done:]:
            started(rng, clock, url, prompts.pop(rid), pods, events, running)
        done = len(live)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return live


@pytest.mark.parametrize("strategy", ["prefix-affinity", "least-load", "session-affinity", "round-robin"])
@pytest.mark.parametrize("seed", [1, 2])
def test_live_and_simulated_router_pick_the_same_endpoints(strategy, seed):
    picks, reasons = run_both(strategy, seed)
    assert len(picks) == NUM_REQUESTS
    chosen = [p for p in picks if p is not None]
    assert len(set(chosen)) == NUM_PODS  # the sequence spreads over every pod ...
    assert len(chosen) < NUM_REQUESTS  # ... and meets the in-flight limit on all of them at times
    if strategy == "prefix-affinity":
        assert reasons["prefix_hit"] > 0 and reasons["load"] > 0  # cache hits and fresh prefixes both


def test_agreement_holds_with_the_hot_spot_guard_and_the_work_bound_acting():
    _, reasons = run_both(
        "prefix-affinity", 3, {"balance": {"absolute": 1, "relative": 1.2, "maxRatio": 1.2}}
    )
    assert reasons["hotspot_guard"] > 0 and reasons["work_bound"] > 0


@pytest.mark.parametrize("strategy", ["prefix-affinity", "least-load", "round-robin"])
async def test_live_gate_and_simulated_queue_send_the_same_waiters_to_the_same_endpoints(strategy):
    sent = await run_both_queued(strategy, 5)
    assert NUM_REQUESTS * 3 // 4 < len(sent) < NUM_REQUESTS  # many waited; some still wait at the end
