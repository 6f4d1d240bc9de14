"""The decodes a step carries over to the next (carried_decodes.py) are a shortcut only: every step must be
what the scheduler's general loop gives. Two schedulers are driven through the same random traffic —
arrivals, shared prefixes (cache hits), chunked prompts, a cache too small for everyone (preemptions), a
budget below the running count, stop tokens, the length limit, aborts before and after a step's tokens
arrive, speculative proposals — one applying each step as scheduled (its decodes carried into the next
step), the other applying a copy of each output, which takes `update`'s general loop and carries nothing.
Outputs, finished requests, KV events and every running request's state must agree step by step."""

from __future__ import annotations

import dataclasses
import random

import pytest
from tokenfleet.runtime.config import SchedulerConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_extra
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler import Scheduler

BS = 4
EOS = 5
STOP = 7


def _scheduler(seed: int, policy: str, fair_share: bool) -> Scheduler:
    rng = random.Random(seed)
    kv = KVCacheManager(rng.choice([24, 40, 200]), BS, enable_caching=True, hash_extra=hash_extra("m"))
    config = SchedulerConfig(
        max_num_seqs=rng.choice([6, 12, 32]),
        max_num_batched_tokens=rng.choice([5, 9, 64]),
        policy=policy,
        fair_share=fair_share,
    )
    return Scheduler(config, kv, 256)


def _drive(seed: int, carry: bool, policy: str = "fcfs", fair_share: bool = False) -> list:
    """What every step of one random run produced. `carry`: update with the output itself (else a copy)."""
    rng = random.Random(seed)
    s = _scheduler(seed, policy, fair_share)
    system = [rng.randint(10, 99) for _ in range(2 * BS)]
    trace = []
    num_added = 0
    for step in range(80):
        for _ in range(rng.choice([0, 0, 0, 1, 3]) if num_added < 40 else 0):
            params = SamplingParams(
                max_tokens=rng.randint(2, 30), stop_token_ids=[STOP], min_tokens=rng.randint(0, 6)
            )
            shared = system[: rng.choice([0, BS, 2 * BS])]
            prompt = shared + [rng.randint(10, 99) for _ in range(rng.randint(1, 14))]
            s.add_request(
                Request(
                    f"r{num_added}",
                    prompt,
                    params,
                    eos_token_ids=frozenset({EOS}),
                    priority=rng.randint(0, 2),
                    arrival_time=float(step),
                    tenant=rng.choice(["a", "b"]),
                )
            )
            num_added += 1
        if s.running and rng.random() < 0.1:  # a stop string found between steps
            s.abort(rng.choice(s.running).request_id)
        if rng.random() < 0.15:  # proposals for some decodes, as the speculative decoder sets them
            for r in s.running:
                if r.num_computed_tokens == r.num_tokens - 1 and rng.random() < 0.5:
                    k = s.max_spec_tokens(r, 2)
                    if k > 0:
                        r.spec_token_ids = [rng.randint(10, 20) for _ in range(k)]
        out = s.schedule()
        if out.is_empty and not s.num_waiting and num_added >= 40:
            break
        if out.num_scheduled and rng.random() < 0.1:  # an abort while the step runs: its tokens are dropped
            s.abort(rng.choice(out.request_ids))
        sampled = {}
        for entry in out.scheduled:
            if entry.sample:
                accepted = rng.randint(0, len(entry.spec_token_ids))
                tail = [rng.choice([EOS, STOP, *range(11, 21)])]
                sampled[entry.request_id] = list(entry.spec_token_ids[:accepted]) + tail
        finished = s.update(out if carry else dataclasses.replace(out), sampled)
        trace.append(
            (
                out.decodes.request_ids,
                out.decodes.token_ids,
                out.decodes.start_pos,
                out.decodes.block_ids,
                out.others,
                out.preempted_ids,
                out.num_batched_tokens,
                [(r.request_id, r.status, r.stop_reason) for r in finished],
                s.kv.take_events(),
                [(r.request_id, r.num_computed_tokens, tuple(r.output_token_ids)) for r in s.running],
            )
        )
    return trace


@pytest.mark.parametrize("policy,fair_share", [("fcfs", False), ("priority", False), ("fcfs", True)])
def test_carried_decodes_schedule_what_the_general_loop_does(policy, fair_share):
    for seed in range(40):
        carried = _drive(seed, True, policy, fair_share)
        assert carried == _drive(seed, False, policy, fair_share), f"seed {seed}"


def test_the_random_runs_reach_what_the_carry_must_cope_with():
    """The runs above do meet each case: decodes carried, preemptions, proposals, a budget below the running
    count."""
    seen = {"decodes": 0, "preempted": 0, "proposals": 0, "budget full": 0}
    for seed in range(40):
        for decode_ids, _, _, _, others, preempted, num_batched, *_ in _drive(seed, True):
            seen["decodes"] += len(decode_ids) > 1
            seen["preempted"] += bool(preempted)
            seen["proposals"] += any(entry.spec_token_ids for entry in others)
            seen["budget full"] += num_batched in (5, 9) and len(decode_ids) == num_batched
    assert all(count >= 10 for count in seen.values()), seen


def test_a_decode_given_proposals_after_the_step_is_not_carried_as_a_plain_decode():
    kv = KVCacheManager(32, BS, enable_caching=True, hash_extra=hash_extra("m"))
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, 256)
    a = Request("a", [11, 12, 13], SamplingParams(max_tokens=20, ignore_eos=True))
    b = Request("b", [14, 15, 16], SamplingParams(max_tokens=20, ignore_eos=True))
    s.add_request(a)
    s.add_request(b)
    s.update(s.schedule(), {"a": [20], "b": [21]})
    out = s.schedule()
    assert out.decodes.request_ids == ["a", "b"]
    s.update(out, {"a": [22], "b": [23]})
    b.spec_token_ids = [30, 31][: s.max_spec_tokens(b, 2)]
    out = s.schedule()
    assert out.decodes.request_ids == ["a"] and out.decodes.start_pos == [4]
    assert [(e.request_id, e.token_ids, e.spec_token_ids) for e in out.others] == [("b", (23,), (30, 31))]
