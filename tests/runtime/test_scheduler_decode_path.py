"""The decode path of the scheduler: a running decode that needs no new block and fills none is
scheduled without asking the KV cache manager; these tests pin down that what the runner and the router
see is exactly what allocating every step would give (block tables, KV events, order, preemption)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from tokenfleet.runtime.config import SchedulerConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra
from tokenfleet.runtime.engine.kv_cache.kv_events import BlockStored
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler import Scheduler

BS = 4


def make(num_blocks: int = 32, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=True, hash_extra=hash_extra("m"))
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), kv, 256)


def req(
    rid: str, prompt: list[int], max_tokens: int = 20, priority: int = 0, arrival: float = 0.0
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, priority=priority, arrival_time=arrival)


def test_decode_gets_a_block_exactly_when_it_needs_one_and_caches_each_block_once_computed():
    """Prompt blocks are stored once their KV is written; blocks holding generated tokens when the
    request gives them back (only a later prompt can contain those tokens)."""
    s = make()
    r = req("a", [10, 11, 12, 13, 14, 15])  # 1.5 blocks
    s.add_request(r)
    out = s.schedule()
    assert out.scheduled[0].block_ids == (0, 1)
    s.update(out, {"a": [100]})
    assert [e for e in s.kv.take_events() if isinstance(e, BlockStored)] == []  # nothing computed yet
    tables, stored = [], []
    for t in range(101, 111):
        out = s.schedule()
        (entry,) = out.scheduled
        assert entry.token_ids == (r.all_token_ids[entry.start_pos],) and entry.sample
        tables.append((entry.start_pos, entry.block_ids))
        s.update(out, {"a": [t]})
        stored += [e for e in s.kv.take_events() if isinstance(e, BlockStored)]
    # Position 8 is the first slot of block 2, 12 of block 3: taken in the step that writes there.
    assert tables == [
        (6, (0, 1)),
        (7, (0, 1)),
        (8, (0, 1, 2)),
        (9, (0, 1, 2)),
        (10, (0, 1, 2)),
        (11, (0, 1, 2)),
        (12, (0, 1, 2, 3)),
        (13, (0, 1, 2, 3)),
        (14, (0, 1, 2, 3)),
        (15, (0, 1, 2, 3)),
    ]
    # The prompt's one full block is stored once its KV is written (the step after the prefill), only once.
    tokens = r.all_token_ids
    hashes = block_hashes_for(tokens, BS, hash_extra("m"))
    assert stored == [BlockStored((hashes[0],), None, tuple(tokens[0:4]), BS)]
    assert s.kv.tables["a"].num_cached == 1
    # The blocks the decode filled (16 tokens computed: 4 full blocks), in one run when they are freed.
    assert r.num_computed_tokens == 16
    s.abort("a")
    assert s.kv.take_events() == [BlockStored(tuple(hashes[1:4]), hashes[0], tuple(tokens[4:16]), BS)]
    assert all(s.kv.pool.get_cached_block(h) is not None for h in hashes[:4])


def test_decodes_around_a_chunked_prefill_keep_running_order():
    s = make(budget=12)
    s.add_request(req("a", [1, 2, 3]))
    s.add_request(req("b", [4, 5]))
    s.update(s.schedule(), {"a": [9], "b": [9]})  # both decoding now
    s.add_request(req("c", list(range(20, 40))))  # 20 tokens: chunked
    out = s.schedule()
    assert [(e.request_id, len(e.token_ids), e.sample) for e in out.scheduled] == [
        ("a", 1, True),
        ("b", 1, True),
        ("c", 10, False),
    ]
    s.update(out, {"a": [9], "b": [9]})
    s.add_request(req("d", [50, 51]))
    out = s.schedule()
    # c's second chunk sits between decodes in running order; d is admitted after.
    assert [(e.request_id, len(e.token_ids)) for e in out.scheduled] == [("a", 1), ("b", 1), ("c", 10)]
    s.update(out, {"a": [9], "b": [9], "c": [9]})
    s.schedule()  # d admitted now
    assert [r.request_id for r in s.running] == ["a", "b", "c", "d"]


def test_a_decode_whose_next_block_is_not_free_preempts_the_newest():
    s = make(num_blocks=4)
    s.add_request(req("old", [1, 2, 3, 4, 5, 6, 7], max_tokens=8, arrival=0.0))  # 2 blocks
    s.add_request(req("new", [8, 9, 10, 11, 12, 13, 14], max_tokens=8, arrival=1.0))  # 2 more: pool full
    out = s.schedule()
    assert {e.request_id: e.block_ids for e in out.scheduled} == {"old": (0, 1), "new": (2, 3)}
    s.update(out, {"old": [70], "new": [80]})
    out = s.schedule()  # both decode position 7: the last slot of their second block, no allocation
    assert [e.start_pos for e in out.scheduled] == [7, 7] and not out.preempted_ids
    s.update(out, {"old": [71], "new": [81]})
    out = s.schedule()  # position 8 needs a third block each: the newest gives its blocks back
    assert out.preempted_ids == ("new",)
    assert [(e.request_id, e.start_pos) for e in out.scheduled] == [("old", 8)]
    assert out.scheduled[0].block_ids[:2] == (0, 1) and len(out.scheduled[0].block_ids) == 3
    assert [r.request_id for r in s.running] == ["old"] and s.num_waiting == 1


def _run_twin(seed: int, general: bool) -> list:
    """Drive a scheduler through decodes that finish on EOS, a stop token (past min_tokens), the length
    limit, an abort between schedule and update; `general`: update with a copy of each output, which
    takes update's general loop instead of the plain-decode run. What every step produced."""
    rng = random.Random(seed)
    s = make(num_blocks=64, budget=64)
    for i in range(6):
        params = SamplingParams(
            max_tokens=rng.randint(3, 20), stop_token_ids=[7], min_tokens=rng.randint(0, 8)
        )
        prompt = [rng.randint(10, 99) for _ in range(rng.randint(2, 9))]
        s.add_request(Request(f"r{i}", prompt, params, eos_token_ids=frozenset({5}), arrival_time=float(i)))
    trace = []
    for step in range(30):
        out = s.schedule()
        if step == 4:
            s.abort("r1")  # between schedule and update: its sampled token is dropped
        sampled = {e.request_id: [rng.choice([5, 7, *range(11, 21)])] for e in out.scheduled if e.sample}
        finished = s.update(dataclasses.replace(out) if general else out, sampled)
        trace.append(
            (
                out,
                [(r.request_id, r.status, r.stop_reason) for r in finished],
                [(r.request_id, r.num_computed_tokens, tuple(r.output_token_ids)) for r in s.running],
            )
        )
    return trace


def test_the_plain_decode_run_of_update_matches_its_general_loop():
    for seed in range(5):
        assert _run_twin(seed, general=False) == _run_twin(seed, general=True)


def test_a_plain_decode_without_its_sampled_token_fails_as_in_the_general_loop():
    errors = []
    for general in (False, True):
        s = make()
        s.add_request(req("a", [1, 2, 3]))
        s.update(s.schedule(), {"a": [9]})
        out = s.schedule()
        with pytest.raises(ValueError) as info:
            s.update(dataclasses.replace(out) if general else out, {"a": [9, 9]})
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "expected 1..1 sampled tokens" in errors[0]


def test_a_decode_preempted_later_in_its_step_leaves_the_step():
    """Under `policy: priority` an urgent arrival preempts a running request whose decode the step had
    already scheduled: the decode leaves the step's columns and the plain-decode run of `update`, and its
    token of budget comes back."""
    kv = KVCacheManager(32, BS, enable_caching=True, hash_extra=hash_extra("m"))
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, policy="priority")
    s = Scheduler(config, kv, 256)
    low, mid = req("low", [1, 2, 3], priority=5, arrival=0.0), req("mid", [4, 5, 6], priority=0, arrival=1.0)
    s.add_request(low)
    s.add_request(mid)
    s.update(s.schedule(), {"low": [9], "mid": [9]})
    s.add_request(req("urgent", [7, 8, 9], priority=-5, arrival=2.0))  # the batch is full: low yields
    out = s.schedule()
    assert out.preempted_ids == ("low",)
    assert out.decodes.request_ids == ["mid"] and out.decodes.start_pos == [3]
    assert [(e.request_id, len(e.token_ids)) for e in out.scheduled] == [("mid", 1), ("urgent", 3)]
    assert out.num_batched_tokens == 4
    s.update(out, {"mid": [10], "urgent": [11]})
    assert low.output_token_ids == [9] and low.num_computed_tokens == 0  # back in the queue, to recompute
    assert mid.output_token_ids == [9, 10] and mid.num_computed_tokens == 4
    assert [r.request_id for r in s.running] == ["mid", "urgent"]


def test_decode_columns_and_entries_say_the_same():
    """`scheduled` (entries, for code off the per-step path) is the columns of `decodes` then `others`, and
    `request_ids` follows the same order."""
    s = make(budget=12)
    s.add_request(req("a", [1, 2, 3]))
    s.add_request(req("b", [4, 5]))
    s.update(s.schedule(), {"a": [9], "b": [8]})
    s.add_request(req("c", list(range(20, 40))))
    out = s.schedule()
    d = out.decodes
    assert (d.request_ids, d.token_ids, d.start_pos) == (["a", "b"], [9, 8], [3, 2])
    assert out.scheduled[:2] == tuple(d.entries()) and out.scheduled[2:] == out.others
    assert out.request_ids == ["a", "b", "c"] and out.num_scheduled == 3 and not out.is_empty
