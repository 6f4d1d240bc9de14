"""Scheduler through its public API with a null model (every sampled token is fixed or seeded-random)."""

from __future__ import annotations

import random

import pytest
from tokenfleet.runtime.config import SchedulerConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_extra
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.request import Request, RequestStatus
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler import Scheduler
from tokenfleet.runtime.errors import CapacityError, ConfigError, ContextLengthExceeded, InvalidRequest

BS = 4
TOKEN = 7  # what the null model samples
EOS = 2


def make(
    num_blocks: int = 64,
    budget: int = 32,
    max_seqs: int = 8,
    max_model_len: int = 256,
    chunked: bool = True,
    caching: bool = True,
    policy: str = "fcfs",
) -> Scheduler:
    km = KVCacheManager(num_blocks, BS, enable_caching=caching, hash_extra=hash_extra("m"))
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked, policy=policy
    )
    return Scheduler(config, km, max_model_len)


_arrival = iter(range(1_000_000))


def mkreq(rid: str, n: int, priority: int = 0, first: int | None = None, **params) -> Request:
    params.setdefault("max_tokens", 8)
    base = first if first is not None else 1000 * (abs(hash(rid)) % 1000) + 100
    return Request(
        rid,
        list(range(base, base + n)),
        SamplingParams(**params),
        eos_token_ids=frozenset({EOS}),
        priority=priority,
        arrival_time=float(next(_arrival)),
    )


def step(s: Scheduler, token: int = TOKEN):
    out = s.schedule()
    fin = s.update(out, {x.request_id: [token] for x in out.scheduled if x.sample})
    return out, fin


def counts(out) -> dict[str, int]:
    return {x.request_id: x.num_tokens for x in out.scheduled}


def assert_all_free(s: Scheduler) -> None:
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
    assert s.kv.usage == 0.0


def test_long_prompt_is_chunked_alongside_decodes_under_the_budget():
    s = make(budget=16)
    a, b = mkreq("a", 3, max_tokens=20), mkreq("b", 3, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)
    assert counts(out) == {"a": 3, "b": 3} and out.num_batched_tokens == 6
    c = mkreq("c", 40, first=500)
    s.add_request(c)
    chunks = []
    for _ in range(3):
        out, _ = step(s)
        assert counts(out) == {"a": 1, "b": 1, "c": out.num_batched_tokens - 2}
        sc = out.scheduled[2]
        chunks.append((sc.start_pos, len(sc.token_ids), sc.sample))
        assert sc.token_ids == tuple(range(500 + sc.start_pos, 500 + sc.start_pos + len(sc.token_ids)))
        assert all(x.sample for x in out.scheduled[:2])
    assert chunks == [(0, 14, False), (14, 14, False), (28, 12, True)]
    assert c.num_output_tokens == 1 and c.num_computed_tokens == 40
    out, _ = step(s)
    assert counts(out) == {"a": 1, "b": 1, "c": 1}
    decode = out.scheduled[0]
    assert decode.token_ids == (TOKEN,) and decode.start_pos == 3 + 4 - 1  # 4 generated, last not fed
    # a's second block was taken when it crossed position 4, after c's first chunk had taken 2..5.
    assert decode.block_ids == s.kv.get_block_ids("a") == (0, 6)


def test_max_num_seqs_bounds_the_running_set():
    s = make(max_seqs=2)
    for rid in ("a", "b", "c"):
        s.add_request(mkreq(rid, 4, max_tokens=2))
    out, fin = step(s)
    assert counts(out) == {"a": 4, "b": 4}
    assert (s.num_running, s.num_waiting) == (2, 1)
    out, fin = step(s)
    assert counts(out) == {"a": 1, "b": 1}
    assert [r.request_id for r in fin] == ["a", "b"]
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in fin)
    out, _ = step(s)
    assert counts(out) == {"c": 4} and out.finished_ids == ("a", "b")


def test_waiting_requests_admitted_by_priority_then_arrival():
    s = make(max_seqs=1)
    s.add_request(mkreq("low", 4, priority=5, max_tokens=1))
    s.add_request(mkreq("first", 4, max_tokens=1))
    s.add_request(mkreq("second", 4, max_tokens=1))
    order = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        order += [x.request_id for x in out.scheduled]
    assert order == ["first", "second", "low"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_under_the_priority_policy_a_full_batch_yields_to_a_higher_priority_request(policy):
    s = make(max_seqs=2, policy=policy)
    batch = [mkreq(rid, 4, priority=5, max_tokens=6) for rid in ("b0", "b1")]
    for r in batch:
        s.add_request(r)
    step(s)
    urgent = mkreq("urgent", 4, priority=0, max_tokens=3)
    s.add_request(urgent)
    out, _ = step(s)
    if policy == "fcfs":  # it waits for room, whatever its priority
        assert counts(out) == {"b0": 1, "b1": 1} and not out.preempted_ids
        assert urgent.status is RequestStatus.WAITING
    else:  # the lowest priority and newest running request yields; its step's token is taken back
        assert out.preempted_ids == ("b1",) and counts(out) == {"b0": 1, "urgent": 4}
        assert batch[1].status is RequestStatus.PREEMPTED and batch[1].num_computed_tokens == 0
    finished = []
    while s.has_unfinished_requests():
        finished += [r.request_id for r in step(s)[1]]
    # Everyone gets every token; the preempted one resumed by recompute once there was room.
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in [*batch, urgent])
    # fcfs: the urgent request finishes last; priority: before the request it displaced.
    assert (finished.index("urgent") < finished.index("b1")) == (policy == "priority")
    assert_all_free(s)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_under_the_priority_policy_a_long_prompts_chunks_give_way_to_more_urgent_requests(policy):
    # A batch request's long prompt is chunked over several steps. Under fcfs the budget goes to running
    # requests in admission order, so its chunks take it all: an urgent request arriving meanwhile waits for
    # the whole prompt, and once running it would get only what the chunks leave.
    s = make(budget=16, policy=policy)
    s.add_request(mkreq("decoding", 3, priority=5, max_tokens=20))
    s.add_request(urgent := mkreq("urgent", 4, priority=0, max_tokens=20))
    step(s)
    s.add_request(long := mkreq("long", 60, priority=5, max_tokens=2))
    out, _ = step(s)
    assert counts(out) == {"decoding": 1, "urgent": 1, "long": 14}
    s.add_request(later := mkreq("later", 4, priority=0, max_tokens=20))  # arrives while it is chunked
    out, _ = step(s)
    if policy == "fcfs":  # the chunks take the budget first: the urgent request waits for the whole prompt
        assert counts(out) == {"decoding": 1, "urgent": 1, "long": 14}
        steps = 1
        while later.num_computed_tokens == 0:
            step(s)
            steps += 1
        assert steps == 4 and long.num_output_tokens == 1
        return
    # The chunk goes after the admission, with what is left.
    assert counts(out) == {"decoding": 1, "urgent": 1, "later": 4, "long": 10}
    tokens = urgent.num_output_tokens
    out, _ = step(s)  # the chunk leaves a token for the urgent stream admitted after it
    assert counts(out) == {"decoding": 1, "urgent": 1, "long": 13, "later": 1}
    assert urgent.num_output_tokens == tokens + 1
    while s.has_unfinished_requests():
        step(s)
    assert_all_free(s)


def test_under_the_priority_policy_equal_priorities_never_preempt_each_other():
    s = make(max_seqs=2, policy="priority")
    for rid in ("a", "b"):
        s.add_request(mkreq(rid, 4, priority=3, max_tokens=4))
    step(s)
    s.add_request(mkreq("c", 4, priority=3, max_tokens=4))
    out, _ = step(s)
    assert counts(out) == {"a": 1, "b": 1} and not out.preempted_ids


def test_under_the_priority_policy_a_full_kv_cache_yields_to_a_higher_priority_request():
    # 6 blocks of 4: three 5-token requests hold 2 blocks each and finish within them (3 tokens more).
    s = make(num_blocks=6, caching=False, policy="priority")
    low = [mkreq(rid, 5, priority=2, max_tokens=3) for rid in ("l0", "l1", "l2")]
    for r in low:
        s.add_request(r)
    step(s)
    assert s.kv.num_free_blocks == 0
    urgent = mkreq("urgent", 5, priority=0, max_tokens=2)
    s.add_request(urgent)
    out, _ = step(s)
    # The batch has room (8 sequences), the cache has none: the newest low-priority request yields it.
    assert out.preempted_ids == ("l2",) and counts(out) == {"l0": 1, "l1": 1, "urgent": 5}
    while s.has_unfinished_requests():
        step(s)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in [*low, urgent])
    assert_all_free(s)


def _fill(s: Scheduler, specs: list[tuple[str, int]]) -> list[Request]:
    """Requests of 7-token prompts (2 blocks each), prefilled in one step."""
    reqs = [mkreq(rid, 7, priority=prio, max_tokens=9) for rid, prio in specs]
    for r in reqs:
        s.add_request(r)
    out, _ = step(s)
    assert counts(out) == {r.request_id: 7 for r in reqs}
    out, _ = step(s)  # position 7: still in block 2 of each
    assert s.kv.num_free_blocks == 0 and not out.preempted_ids
    return reqs


@pytest.mark.parametrize(
    ("specs", "victim"),
    [
        ([("r0", 0), ("r1", 0), ("r2", 0)], "r2"),  # equal priority: the newest goes
        ([("r0", 0), ("r1", 1), ("r2", 0)], "r1"),  # the lowest priority goes, even if older
    ],
)
def test_preempts_lowest_priority_newest_and_resumes_by_recompute(specs, victim):
    s = make(num_blocks=6, caching=False)
    reqs = {r.request_id: r for r in _fill(s, specs)}
    out, _ = step(s)  # position 8 needs a third block each: one request must go
    assert out.preempted_ids == (victim,)
    assert set(counts(out)) == {"r0", "r1", "r2"} - {victim}
    v = reqs[victim]
    assert v.status is RequestStatus.PREEMPTED and v.num_computed_tokens == 0
    assert v.num_preemptions == 1 and s.num_preemptions_total == 1
    assert (s.num_running, s.num_waiting) == (2, 1)
    assert s.kv.get_block_ids(victim) == ()
    generated = list(v.output_token_ids)
    assert generated == [TOKEN, TOKEN]
    while v.status is not RequestStatus.RUNNING:
        out, _ = step(s)
    (resumed,) = [x for x in out.scheduled if x.request_id == victim]
    # Recompute: prompt plus what it had generated, from position 0, then sample the next token.
    assert resumed.start_pos == 0 and resumed.token_ids == tuple(v.prompt_token_ids + generated)
    assert resumed.sample
    while s.has_unfinished_requests():
        step(s)
    assert all(r.num_output_tokens == 9 for r in reqs.values())
    assert_all_free(s)


def test_started_announces_each_first_admission_once_and_no_resumption():
    """`started`: the requests the last schedule() admitted for the first time (what routers are told a pod
    begins computing); a resumption after preemption is not announced again."""
    s = make(num_blocks=6, caching=False)
    reqs = [mkreq(rid, 7, max_tokens=9) for rid in ("r0", "r1", "r2")]
    for r in reqs:
        s.add_request(r)
    step(s)
    assert len(s.started) == 3
    step(s)
    assert s.started == []
    out, _ = step(s)  # position 8 needs a third block each: r2 goes
    assert out.preempted_ids == ("r2",) and s.started == []
    while reqs[2].status is not RequestStatus.RUNNING:
        step(s)
        assert s.started == []


def test_started_carries_each_prompt_block_hashes_in_admission_order():
    s = make()
    a, b, c = mkreq("a", 9), mkreq("b", 5), mkreq("c", 3)
    for r in (a, b, c):
        s.add_request(r)
    step(s)
    assert [ev.block_hashes for ev in s.started] == [tuple(r.block_hashes) for r in (a, b, c)]
    assert [len(r.block_hashes) for r in (a, b, c)] == [2, 1, 0]  # one without a full block counts too


def test_a_request_preempts_itself_when_it_is_the_lowest_priority():
    s = make(num_blocks=4, caching=False)
    s.add_request(r0 := mkreq("r0", 5, max_tokens=4))
    s.add_request(r1 := mkreq("r1", 7, priority=1, max_tokens=6))
    step(s)
    step(s)
    assert s.kv.num_free_blocks == 0
    out, _ = step(s)  # r1 reaches position 8 and needs a third block; it is the one to go
    assert out.preempted_ids == ("r1",) and counts(out) == {"r0": 1}
    assert r1.status is RequestStatus.PREEMPTED and r0.status is RequestStatus.RUNNING
    while s.has_unfinished_requests():
        step(s)
    assert r0.num_output_tokens == 4 and r1.num_output_tokens == 6
    assert_all_free(s)


def test_abort_in_every_state_frees_everything():
    s = make(num_blocks=6, budget=8, caching=False)
    assert s.abort("unknown") is False
    waiting = mkreq("waiting", 5)
    s.add_request(waiting)
    assert s.abort("waiting") and waiting.status is RequestStatus.FINISHED_ABORTED
    assert s.num_waiting == 0
    out = s.schedule()
    assert out.is_empty and out.aborted_ids == ("waiting",)

    running = mkreq("running", 12)
    s.add_request(running)
    step(s)  # 8 of 12 prompt tokens computed: mid-prefill
    assert running.status is RequestStatus.RUNNING and s.kv.usage > 0
    assert s.abort("running") and s.num_running == 0
    assert_all_free(s)

    s = make(num_blocks=6, caching=False)
    reqs = _fill(s, [("r0", 0), ("r1", 0), ("r2", 0)])
    out, _ = step(s)
    assert out.preempted_ids == ("r2",)
    assert s.abort("r2") and reqs[2].status is RequestStatus.FINISHED_ABORTED
    assert s.num_waiting == 0
    for r in reqs[:2]:
        assert s.abort(r.request_id)
    assert s.abort("r0") is False  # already finished
    assert not s.has_unfinished_requests()
    assert s.schedule().aborted_ids == ("r2", "r0", "r1")
    assert_all_free(s)


def test_stop_conditions():
    s = make()
    s.add_request(eos := mkreq("eos", 3))
    s.add_request(min_t := mkreq("min", 3, min_tokens=2))
    s.add_request(ign := mkreq("ignore", 3, ignore_eos=True, max_tokens=3))
    s.add_request(stop := mkreq("stop", 3, stop_token_ids=[9]))
    out = s.schedule()
    fin = s.update(out, {"eos": [EOS], "min": [EOS], "ignore": [EOS], "stop": [9]})
    assert [r.request_id for r in fin] == ["eos", "stop"]
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop.status is RequestStatus.FINISHED_STOPPED and stop.stop_reason == 9
    out = s.schedule()
    assert s.update(out, {"min": [EOS], "ignore": [EOS]}) == [min_t]  # EOS counts from min_tokens on
    out = s.schedule()
    assert s.update(out, {"ignore": [EOS]}) == [ign]
    assert ign.status is RequestStatus.FINISHED_LENGTH and ign.output_token_ids == [EOS] * 3
    assert_all_free(s)


def test_context_length_ends_generation_and_finish_from_outside():
    s = make(max_model_len=10)
    s.add_request(r := mkreq("r", 8, max_tokens=None))
    s.add_request(other := mkreq("other", 4, max_tokens=6))
    _, fin = step(s)
    assert fin == []
    _, fin = step(s)
    assert fin == [r] and r.num_tokens == 10 and r.status is RequestStatus.FINISHED_LENGTH
    finished = s.finish("other", RequestStatus.FINISHED_STOPPED)  # a stop string, found downstream
    assert finished is other and other.status is RequestStatus.FINISHED_STOPPED
    assert s.schedule().finished_ids == ("r", "other")
    assert_all_free(s)


def test_admission_errors():
    s = make(num_blocks=4, max_model_len=64)  # 16 slots of KV in all
    with pytest.raises(CapacityError):
        s.add_request(mkreq("huge", 10, max_tokens=8))  # 17 tokens of KV
    s.add_request(mkreq("fits", 10, max_tokens=7))  # the 17th token is never fed back
    with pytest.raises(InvalidRequest, match="duplicate"):
        s.add_request(mkreq("fits", 3))
    with pytest.raises(ContextLengthExceeded):
        s.add_request(mkreq("long", 64))
    with pytest.raises(InvalidRequest, match="empty") as empty:
        s.add_request(mkreq("empty", 0))
    assert not isinstance(empty.value, ContextLengthExceeded)  # an empty prompt is not a length problem
    with pytest.raises(ConfigError):
        make(budget=32, max_model_len=64, chunked=False)
    assert s.num_waiting == 1  # refused requests leave nothing behind


@pytest.mark.parametrize(
    ("num_prompt", "max_tokens", "error"),
    [
        (15, None, None),  # max_model_len - 1: exactly one token may be generated
        (15, 1, None),
        (15, 2, ContextLengthExceeded),  # max_tokens overflow: refused, not clamped
        (16, None, ContextLengthExceeded),  # max_model_len: nothing left to generate
        (16, 1, ContextLengthExceeded),
        (10, 6, None),  # prompt + max_tokens == max_model_len
        (10, 7, ContextLengthExceeded),
    ],
)
def test_admission_at_the_context_length(num_prompt, max_tokens, error):
    s = make(max_model_len=16)
    r = mkreq("r", num_prompt, max_tokens=max_tokens)
    if error is not None:
        with pytest.raises(error, match="context length"):
            s.add_request(r)
        assert s.num_waiting == 0
        return
    s.add_request(r)
    while not r.is_finished:
        step(s)
    expected = 16 if max_tokens is None else num_prompt + max_tokens
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == expected
    assert_all_free(s)


def test_capacity_counts_the_kv_a_sequence_can_hold():
    """A sequence of final length L writes L - 1 tokens of KV: exactly the whole cache is admissible."""
    s = make(num_blocks=4, max_model_len=64)  # 16 slots
    s.add_request(r := mkreq("r", 16, max_tokens=1))  # 16 slots of prompt KV; its one token is never fed
    with pytest.raises(CapacityError):
        s.add_request(mkreq("r2", 16, max_tokens=2))  # 17 slots
    with pytest.raises(CapacityError):
        s.add_request(mkreq("r3", 1, max_tokens=None))  # may reach the context length: 63 slots
    _, fin = step(s)
    assert fin == [r] and r.output_token_ids == [TOKEN]
    assert_all_free(s)


def test_without_chunked_prefill_only_whole_prompts_are_admitted():
    s = make(budget=16, max_model_len=16, chunked=False)
    s.add_request(mkreq("a", 10, max_tokens=3))
    s.add_request(mkreq("b", 10, max_tokens=3))
    out, _ = step(s)
    assert counts(out) == {"a": 10}  # b would need a chunk: it waits
    out, _ = step(s)
    assert counts(out) == {"a": 1, "b": 10}


def test_prefix_cache_hits_start_ahead():
    s = make(num_blocks=16)
    s.add_request(a := mkreq("a", 10, first=0, max_tokens=1))
    step(s)
    s.add_request(b := mkreq("b", 11, first=0, max_tokens=1))
    out, _ = step(s)
    (sb,) = out.scheduled
    assert (sb.start_pos, sb.token_ids) == (8, (8, 9, 10))
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (21, 8)


def test_speculative_tokens_are_scheduled_and_rejected_ones_rolled_back():
    s = make(num_blocks=16)
    s.add_request(r := mkreq("r", 6, max_tokens=20))
    step(s)
    r.spec_token_ids = [11, 12, 13, 14, 15, 16]  # 6 proposals: positions 7..12, a fourth block
    out = s.schedule()
    (sr,) = out.scheduled
    assert (sr.token_ids, sr.start_pos, sr.spec_token_ids) == ((TOKEN,), 6, (11, 12, 13, 14, 15, 16))
    assert out.num_batched_tokens == 7 and len(sr.block_ids) == 4
    s.update(out, {"r": [11, 12, 99]})  # two accepted, then the target's own token
    assert r.output_token_ids == [TOKEN, 11, 12, 99]
    assert r.num_computed_tokens == 9 and r.spec_token_ids == []
    assert s.kv.get_block_ids("r") == sr.block_ids[:3]  # the block past the new length is freed
    with pytest.raises(ValueError):
        s.update(s.schedule(), {"r": [1, 2]})  # no proposals this time: one token only


def test_proposals_are_capped_by_max_tokens():
    s = make()
    s.add_request(r := mkreq("r", 4, max_tokens=3))
    step(s)
    r.spec_token_ids = [1, 1, 1, 1]
    out = s.schedule()
    assert out.scheduled[0].spec_token_ids == (1,)  # 1 accepted + 1 bonus reach max_tokens
    assert s.update(out, {"r": [1, 5]}) == [r]
    assert r.num_output_tokens == 3 and r.status is RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_add_abort_finish_never_leaks(seed, policy):
    rng = random.Random(seed)
    s = make(num_blocks=8, budget=12, max_seqs=5, max_model_len=32, policy=policy)
    next_id = 0
    for _ in range(400):
        if rng.random() < 0.4:
            n = rng.randint(1, 20)
            shared = rng.random() < 0.5  # shared prefixes exercise hits and ref counts
            s.add_request(
                mkreq(
                    f"q{next_id}",
                    n,
                    priority=rng.randint(0, 2),
                    first=0 if shared else 1000 * next_id,
                    max_tokens=rng.randint(1, 32 - n),
                )
            )
            next_id += 1
        live = [f"q{i}" for i in range(next_id) if s.get_request(f"q{i}") is not None]
        if live and rng.random() < 0.1:
            s.abort(rng.choice(live))
        for rid in live:
            r = s.get_request(rid)
            if r is not None and r.status is RequestStatus.RUNNING and rng.random() < 0.3:
                r.spec_token_ids = [rng.randint(0, 9) for _ in range(rng.randint(1, 3))]
        out = s.schedule()
        assert out.num_batched_tokens <= 12 and len(out.scheduled) <= 5
        sampled = {}
        for x in out.scheduled:
            assert len(x.block_ids) * BS >= x.start_pos + x.num_tokens
            if x.sample:
                accepted = list(x.spec_token_ids[: rng.randint(0, len(x.spec_token_ids))])
                sampled[x.request_id] = [*accepted, rng.choice([TOKEN, TOKEN, TOKEN, EOS])]
        s.update(out, sampled)
        if live and rng.random() < 0.05:
            s.finish(rng.choice(live), RequestStatus.FINISHED_STOPPED)
        assert 0.0 <= s.kv.usage <= 1.0
    while s.has_unfinished_requests():
        step(s)
    assert s.num_preemptions_total > 0  # the pool is tight enough to exercise preemption
    assert_all_free(s)


def test_lookahead_slots_are_allocated_with_each_sampling_chunk_and_capped_by_the_length_limit():
    """A draft that writes KV proposes into slots the scheduler allocated: k past each sampling chunk."""
    km = KVCacheManager(64, BS, enable_caching=True, hash_extra=hash_extra("m"))
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32), km, 256, num_lookahead_tokens=3)
    s.add_request(r := mkreq("r", 6, max_tokens=4))  # length limit 10: at most 9 slots
    out, _ = step(s)
    assert counts(out) == {"r": 6} and len(s.kv.get_block_ids("r")) == 3  # 6 + 3 look-ahead slots
    # The draft writes positions 6.. (the last token + proposals): as many as the held slots allow.
    assert s.max_spec_tokens(r, 5) == 2  # 7 tokens; 2 proposals + the bonus reach the limit of 10
    r.spec_token_ids = [11, 12]
    out = s.schedule()
    assert out.scheduled[0].spec_token_ids == (11, 12) and len(out.scheduled[0].block_ids) == 3  # capped at 9
    s.update(out, {"r": [11, 99]})  # one accepted, one rejected: keeps the slots the next draft needs
    assert r.num_tokens == 9 and len(s.kv.get_block_ids("r")) == 3
    assert s.max_spec_tokens(r, 5) == 0  # one token left to generate: nothing to verify it against
    step(s)
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert_all_free(s)


def test_a_draft_never_gets_more_proposals_than_slots_held():
    km = KVCacheManager(64, BS, enable_caching=True, hash_extra=hash_extra("m"))
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32), km, 256, num_lookahead_tokens=2)
    s.add_request(r := mkreq("r", 4, max_tokens=50))
    step(s)  # 4 + 2 slots: 2 blocks
    assert s.max_spec_tokens(r, 8) == 4  # positions 4..7 are held (the second block), not 8
