"""Fair share between tenants in the scheduler's waiting queue (`scheduler.fair_share`), null model."""

from __future__ import annotations

import itertools
import random

import pytest
from tokenfleet.runtime.config import SchedulerConfig
from tokenfleet.runtime.engine.fair_share import RETURN_CREDIT, FairShare
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_extra
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.request import Request, RequestStatus
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler import FAIR_PREEMPT_MARGIN, Scheduler
from tokenfleet.runtime.engine.waiting_queue import FairWaitingQueue, WaitingQueue

BS = 4
TOKEN = 7

_arrival = itertools.count()
_first = itertools.count(100, 1000)


def make(
    fair: bool = True,
    max_seqs: int = 8,
    budget: int = 32,
    policy: str = "fcfs",
    caching: bool = True,
    blocks: int = 64,
) -> Scheduler:
    km = KVCacheManager(blocks, BS, enable_caching=caching, hash_extra=hash_extra("m"))
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy, fair_share=fair
    )
    return Scheduler(config, km, max_model_len=256)


def mkreq(rid: str, tenant: str | None, n: int = 4, priority: int = 0, max_tokens: int = 2, prompt=None):
    base = next(_first)
    return Request(
        rid,
        list(prompt) if prompt is not None else list(range(base, base + n)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority=priority,
        arrival_time=float(next(_arrival)),
        tenant=tenant,
    )


def step(s: Scheduler):
    out = s.schedule()
    fin = s.update(out, {x.request_id: [TOKEN] for x in out.scheduled if x.sample})
    return out, fin


def admission_order(s: Scheduler) -> list[str]:
    order: list[str] = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        order += [x.request_id for x in out.scheduled if x.request_id not in order]
    return order


@pytest.mark.parametrize("fair", [True, False])
def test_a_late_tenant_is_not_stuck_behind_another_tenants_flood(fair):
    s = make(fair=fair, max_seqs=1)
    for i in range(6):
        s.add_request(mkreq(f"a{i}", "A"))
    s.add_request(mkreq("b0", "B"))
    order = admission_order(s)
    if fair:  # b0 goes as soon as A's first request leaves room: A has had service, B none
        assert order == ["a0", "b0", "a1", "a2", "a3", "a4", "a5"]
    else:
        assert order == ["a0", "a1", "a2", "a3", "a4", "a5", "b0"]


def test_tenants_alternate_by_service_and_keep_their_own_arrival_order():
    s = make(max_seqs=1)
    for i in range(3):
        s.add_request(mkreq(f"a{i}", "A"))
    for i in range(3):
        s.add_request(mkreq(f"b{i}", None))  # None is the anonymous tenant, one like any other
    assert admission_order(s) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_priority_bands_stay_strict_under_fair_share():
    s = make(max_seqs=1)
    s.add_request(mkreq("b-low", "B", priority=1))
    for i in range(3):
        s.add_request(mkreq(f"a{i}", "A", priority=0))
    s.add_request(mkreq("b-high", "B", priority=0))
    # A's service never lets B's lower-priority request pass, only B's request of the same priority.
    assert admission_order(s) == ["a0", "b-high", "a1", "a2", "b-low"]


def test_prompt_chunks_and_generated_tokens_are_charged_as_they_happen():
    s = make(budget=16)
    r = mkreq("a", "A", n=40, max_tokens=3)
    s.add_request(r)
    counter = s.fair.counter
    step(s)
    assert counter("A") == 16  # the first chunk, when scheduled (input weight 1)
    step(s)
    assert counter("A") == 32
    step(s)
    assert counter("A") == 40 + 2  # the last chunk and the token sampled after it (output weight 2)
    step(s)
    assert counter("A") == 40 + 4
    step(s)
    assert r.status is RequestStatus.FINISHED_LENGTH and counter("A") == 40 + 6
    assert not s.fair.active


def test_accepted_speculative_tokens_are_charged_as_generated():
    s = make()
    r = mkreq("a", "A", n=4, max_tokens=10)
    s.add_request(r)
    step(s)
    r.spec_token_ids = [TOKEN, TOKEN, TOKEN]
    out = s.schedule()
    assert out.scheduled[0].spec_token_ids == (TOKEN,) * 3
    s.update(out, {"a": [TOKEN, TOKEN, 5]})  # two proposals accepted, then the token sampled after them
    assert r.num_output_tokens == 4 and s.fair.counter("A") == 4 + 2 * 4


def test_prefix_cache_hits_are_not_charged():
    s = make()
    shared = list(range(500, 516))  # four full blocks
    s.add_request(mkreq("a", "A", prompt=[*shared, 1, 2, 3, 4], max_tokens=1))
    step(s)
    s.add_request(mkreq("b", "B", prompt=[*shared, 5, 6, 7, 8], max_tokens=1))
    out, _ = step(s)
    assert out.scheduled[0].start_pos == 16
    assert s.fair.counter("A") == 20 + 2 and s.fair.counter("B") == 4 + 2


def test_an_aborted_waiting_request_leaves_its_tenant_inactive():
    s = make(max_seqs=1)
    s.add_request(mkreq("a0", "A", max_tokens=4))
    step(s)
    s.add_request(mkreq("b0", "B"))
    assert s.fair.active == {"A": 1, "B": 1}
    assert s.abort("b0")
    assert s.fair.active == {"A": 1} and s.num_waiting == 0 and "b0" not in s.waiting
    assert s.abort("a0")  # a running one too
    assert not s.fair.active
    out, _ = step(s)
    assert not out.scheduled and set(out.aborted_ids) == {"a0", "b0"}


@pytest.mark.parametrize("caching", [True, False])
def test_a_preempted_request_resumes_without_paying_its_prompt_twice(caching):
    # A low-priority request of A finishes its prompt when B's urgent request takes the only seat.
    s = make(max_seqs=1, budget=16, policy="priority", caching=caching)
    low = mkreq("a-low", "A", n=20, priority=1, max_tokens=2)
    s.add_request(low)
    step(s)
    assert s.fair.counter("A") == 16
    s.add_request(mkreq("b-urgent", "B", priority=0))
    out, _ = step(s)
    assert out.preempted_ids == ("a-low",) and [x.request_id for x in out.scheduled] == ["b-urgent"]
    assert s.fair.counter("A") == 16  # its last chunk, taken back in this step, is not charged
    while s.has_unfinished_requests():
        step(s)
    assert low.num_preemptions == 1 and low.num_output_tokens == 2
    # Each prompt token and generated token once, whether the resumption hit the cache or recomputed.
    assert s.fair.counter("A") == 20 + 2 * 2
    # B joined at A's count less the return credit (floored at its own 0), then paid its own way.
    assert s.fair.counter("B") == max(16 - RETURN_CREDIT, 0) + 4 + 2 * 2


def test_a_returning_tenant_starts_at_most_the_credit_below_the_least_served_active_counter():
    s = make(max_seqs=1, budget=128)
    s.add_request(mkreq("a0", "A", max_tokens=1))
    step(s)  # A served 4 + 2, then gone
    s.add_request(mkreq("b0", "B", n=100, max_tokens=3))
    step(s)
    assert s.fair.counter("B") == 100 + 2
    s.add_request(mkreq("a1", "A"))  # idling earned A no more than the return credit
    assert s.fair.counter("A") == 100 + 2 - RETURN_CREDIT


def test_fair_waiting_queue_interface():
    fair = FairShare()
    q = FairWaitingQueue(fair)
    reqs = [mkreq("a0", "A"), mkreq("a1", "A"), mkreq("b0", "B"), mkreq("c0", None, priority=-1)]
    for order, r in enumerate(reqs):
        q.push(r, order)
    assert len(q) == 4 and "a1" in q and "zz" not in q
    assert q.pop().request_id == "c0"  # the best priority first, whatever its tenant's service
    fair.charge_prompt("A", 10)
    assert q.peek().request_id == "b0"
    assert q.remove("b0") and not q.remove("b0")
    assert [q.pop().request_id, q.pop().request_id] == ["a0", "a1"]
    assert len(q) == 0 and q.peek() is None
    with pytest.raises(IndexError):
        q.pop()


def test_without_fair_share_the_scheduler_keeps_the_single_heap_and_charges_nothing():
    s = make(fair=False)
    assert s.fair is None and type(s.waiting) is WaitingQueue
    s.add_request(mkreq("a0", "A"))
    step(s)
    assert s.fair is None


def test_the_engine_passes_each_requests_tenant_to_the_scheduler(default_model):
    from tokenfleet.runtime.config import RuntimeConfig
    from tokenfleet.runtime.engine.engine_core import EngineCore

    config = RuntimeConfig.model_validate(
        {
            "model": {"dtype": "float32", "attention_backend": "torch"},
            "scheduler": {"max_num_seqs": 1, "fair_share": True},
            "cache": {"num_blocks": 64},
        }
    )
    core = EngineCore(config, loaded=default_model)
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        for i in range(3):
            core.add_request(f"a{i}", [10 + i, 20, 30], params, tenant="A")
        core.add_request("b0", [40, 50, 60], params)  # no tenant: the anonymous one
        order: list[str] = []
        while core.has_unfinished():
            order += [d.request_id for d in core.step() if d.request_id not in order]
        assert order == ["a0", "b0", "a1", "a2"]
        assert set(core.scheduler.fair.counters) == {"A", ""} and not core.scheduler.fair.active
    finally:
        core.shutdown()


def test_a_light_tenant_behind_a_flood_preempts_the_most_served_one_at_once_and_only_once():
    s = make(max_seqs=2)
    s.add_request(mkreq("a0", "A", max_tokens=60))  # both fit the cache to the end: no preemption for blocks
    s.add_request(mkreq("a1", "A", max_tokens=60))
    for _ in range(40):
        step(s)  # A alone
    s.add_request(mkreq("b0", "B"))  # joins the credit below A: exactly the margin behind
    assert s.fair.counter("A") - s.fair.counter("B") == FAIR_PREEMPT_MARGIN
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["a0", "b0"] and out.preempted_ids == ("a1",)
    rest = admission_order(s)
    assert "a1" in rest and s.num_preemptions_total == 1  # no slot traded back and forth


def test_a_tenant_is_never_preempted_down_to_fewer_running_requests_than_the_one_it_yields_to():
    # One slot each way would swap back as soon as the newcomer's prompt is charged: A holding the only
    # slot is not preempted, however far ahead in service.
    s = make(max_seqs=1)
    s.add_request(mkreq("a0", "A", max_tokens=40))
    for _ in range(30):
        step(s)
    s.add_request(mkreq("b0", "B"))
    assert s.fair.counter("A") - s.fair.counter("B") >= FAIR_PREEMPT_MARGIN
    assert admission_order(s) == ["a0", "b0"] and s.num_preemptions_total == 0


def test_fair_share_preempts_only_within_a_priority():
    s = make(max_seqs=2)
    s.add_request(mkreq("a0", "A", max_tokens=200))
    s.add_request(mkreq("a1", "A", max_tokens=200))
    for _ in range(40):
        step(s)
    s.add_request(mkreq("b-low", "B", priority=1))
    for _ in range(20):
        out, _ = step(s)
        assert [x.request_id for x in out.scheduled] == ["a0", "a1"] and not out.preempted_ids


@pytest.mark.timeout(20)
def test_a_request_preempted_for_fair_share_is_not_admitted_again_in_the_same_step():
    """The victim's chunk is refunded when it is preempted, which can leave its tenant less served than the
    preemptor's: re-admitting it at once would charge the chunk again, preempt it again for the same
    head, and never end the step (a livelock seen with fleets of pods holding a flood)."""
    s = make(max_seqs=2, budget=160, blocks=128)
    s.add_request(mkreq("a0", "A", n=4, max_tokens=100))
    s.add_request(mkreq("a1", "A", n=240, max_tokens=2))
    step(s)  # a0's prompt, a1's first chunk: 156 prompt tokens
    a_before = s.fair.counter("A")
    s.add_request(mkreq("b0", "B"))
    # B's history leaves it a little more served than A before this step's chunks (a0's decode, a1's last
    # 84 prompt tokens, two sampled tokens), and more than the margin behind A after them.
    s.fair.counters["B"] = a_before + 5
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["a0", "b0"] and out.preempted_ids == ("a1",)
    assert s.get_request("a1").status is RequestStatus.PREEMPTED and s.fair.counter("A") < s.fair.counter("B")
    s.update(out, {"a0": [TOKEN], "b0": [TOKEN]})
    rest = admission_order(s)
    assert "a1" in rest and s.num_preemptions_total == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_token_is_charged_once_through_priority_preemptions(seed):
    # One tenant (no return credit moves its counter), no prefix cache, a tight cache, small chunks and mixed
    # priorities: chunks taken back by preemptions in the step that charged them, prompts recomputed. At the
    # end the counter is exactly each prompt token once (a recomputed prompt is not charged again) and each
    # generated token once.
    rng = random.Random(seed)
    s = make(max_seqs=4, budget=12, policy="priority", caching=False, blocks=14)
    added: list[Request] = []
    for k in range(300):
        if k < 200 and rng.random() < 0.3:
            added.append(r := mkreq(f"r{k}", "A", n=rng.randint(1, 24), priority=rng.randint(0, 2),
                                    max_tokens=rng.randint(1, 8)))  # fmt: skip
            s.add_request(r)
        step(s)
    while s.has_unfinished_requests():
        step(s)
    assert s.num_preemptions_total > 0
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in added)
    expected = sum(r.num_prompt_tokens + 2 * r.num_output_tokens for r in added)
    assert s.fair.counter("A") == expected
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_chunk_that_made_way_for_admissions_and_then_preempts_refunds_its_victims_charge():
    # c's prompt chunk makes way for u's admission; scheduled after it, with the budget left, it finds the
    # cache too small and preempts d (the lowest priority), whose decode was charged before the admissions,
    # then itself. d's token is refunded: at the end every token is charged exactly once.
    s = make(max_seqs=8, budget=24, policy="priority", caching=False, blocks=16)
    s.add_request(e := mkreq("e", "A", n=20, priority=0, max_tokens=10))
    s.add_request(d := mkreq("d", "A", n=3, priority=9, max_tokens=10))
    step(s)
    s.add_request(c := mkreq("c", "A", n=40, priority=5, max_tokens=2))
    out, _ = step(s)
    assert {x.request_id: x.num_tokens for x in out.scheduled} == {"e": 1, "d": 1, "c": 22}
    s.add_request(u := mkreq("u", "A", n=4, priority=0, max_tokens=2))
    out, _ = step(s)
    assert {x.request_id: x.num_tokens for x in out.scheduled} == {"e": 1, "u": 4}
    assert out.preempted_ids == ("d", "c")
    while s.has_unfinished_requests():
        step(s)
    assert s.fair.counter("A") == sum(r.num_prompt_tokens + 2 * r.num_output_tokens for r in (e, d, c, u))
