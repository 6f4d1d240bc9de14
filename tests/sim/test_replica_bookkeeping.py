"""The replica's per-step figures (taken with set operations over a step's ids, not per token) equal what a
client timing every token would see; the batch shape equals the per-request sum; the router's extended
hashes equal hashing each prompt whole."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
from tokenfleet.runtime.config import SchedulerConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra
from tokenfleet.sim.config import parse_config
from tokenfleet.sim.cost_model import LinearCost, batch_shape
from tokenfleet.sim.model_profile import model_profile
from tokenfleet.sim.replica import ReplicaConfig, SimReplica, itl_bin
from tokenfleet.sim.results import Collector
from tokenfleet.sim.router import SimRouter
from tokenfleet.sim.workload import SimRequest, Workload, WorkloadSpec


def _reference_shape(scheduled):
    """The per-request definition of the step's shape."""
    num_tokens = num_samples = kv = 0
    attn = 0.0
    for _, token_ids, start, _, sample, spec in scheduled:
        q = len(token_ids) + len(spec)
        num_tokens += q
        num_samples += sample
        kv += start + q
        attn += q * (start + (q + 1) * 0.5)
    return num_tokens, len(scheduled), num_samples, attn, kv


def test_step_figures_equal_a_per_token_client_under_chunking_and_preemption():
    model = model_profile("8b")
    # A cache of 90 blocks for prompts of up to ~700 tokens, 120-token budget: chunked prefills, decodes
    # starved of budget behind them, and preemptions (recompute) all happen.
    cost = LinearCost(
        0.01, 1e-5, 1e-4, 0.0, 1e-9, kv_cache_bytes=90 * 16 * model.kv_bytes_per_token, model=model
    )
    config = ReplicaConfig(SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=120), max_model_len=4096)
    now = [0.0]
    ttfts: list[float] = []
    replica = SimReplica("r0", cost, config, lambda: now[0], ttfts.append)
    rng = np.random.Generator(np.random.PCG64(7))
    requests = {}
    for i in range(40):
        prompt = rng.integers(100, 30000, int(rng.integers(20, 700))).tolist()
        sreq = SimRequest(f"q{i}", 0.0, prompt, [int(rng.integers(100, 30000))] * int(rng.integers(1, 300)))
        requests[sreq.request_id] = sreq
    pending = list(requests.values())
    token_times: dict[str, list[float]] = {rid: [] for rid in requests}
    first_scheduled: dict[str, float] = {}
    finished = {}
    step = 0
    while pending or replica.has_work():
        if pending and step % 3 == 0:  # arrivals spread over the first steps
            sreq = pending.pop(0)
            sreq.arrival = now[0]
            replica.add(sreq, now[0])
        duration = replica.start_step(now[0])
        step += 1
        if duration is None:  # idle between arrivals: the next iteration admits one
            continue
        output = replica._pending
        assert _reference_shape(output.scheduled) == tuple(
            getattr(batch_shape(output), f)
            for f in ("num_tokens", "num_seqs", "num_samples", "attn_work", "kv_read_tokens")
        )
        for entry in output.scheduled:
            first_scheduled.setdefault(entry[0], now[0])
        before = {
            rid: len(r.output_token_ids)
            for rid in requests
            if (r := replica.scheduler.get_request(rid)) is not None
        }
        now[0] += duration
        done = replica.finish_step(now[0])
        for rid, n in before.items():
            r = replica.scheduler.get_request(rid)
            n_after = len(r.output_token_ids) if r is not None else None
            if n_after is None:  # finished in this step: it got its last token now
                n_after = n + 1
            token_times[rid] += [now[0]] * (n_after - n)
        for rec in done:
            finished[rec.request.request_id] = rec
    assert replica.scheduler.num_preemptions_total > 0
    assert len(finished) == len(requests)
    expected_bins: dict[int, int] = {}
    gaps: list[float] = []
    for rid, times in token_times.items():
        rec, sreq = finished[rid], requests[rid]
        assert len(times) == len(sreq.output) == rec.num_emitted
        assert rec.first_token == times[0] and rec.last_token == times[-1]
        assert rec.first_scheduled == first_scheduled[rid]
        for a, b in itertools.pairwise(times):
            k = itl_bin(b - a)
            expected_bins[k] = expected_bins.get(k, 0) + 1
            gaps.append(b - a)
    assert replica.itl_bins == expected_bins
    # The results' ITL figures, read from those bins, are within a bin's width of the exact ones.
    itl = Collector._itl_pcts([SimpleNamespace(replica=replica)])
    exact = {"p50": np.median(gaps), "mean": np.mean(gaps), "max": max(gaps)}
    for key, value in exact.items():
        assert math.isclose(itl[key], value, rel_tol=0.011), (key, itl[key], value)
    assert sorted(ttfts) == sorted(finished[r].first_token - requests[r].arrival for r in requests)
    assert replica.generation_tokens_total == sum(len(s.output) for s in requests.values())
    # Every request was announced once, when first scheduled, with its prompt's block hashes.
    assert len(replica.announced) == len(requests)
    assert not math.isnan(sum(ttfts))


def test_router_extends_known_prefix_hashes_to_the_same_values():
    spec = WorkloadSpec(seed=4, num_tenants=3, system_prompt_tokens=200, session_fraction=1.0, turns_mean=4)
    workload = Workload(spec)
    router = SimRouter(parse_config({}).routing, 16, "llama-3-8b", lambda: 0.0)
    extra = hash_extra("llama-3-8b")
    checked = 0
    for sreq in list(workload.arrivals())[:30]:
        turn = sreq
        while turn is not None:
            router.hash_prompt(turn)
            assert turn.block_hashes == block_hashes_for(turn.prompt, 16, extra)
            checked += 1
            turn = workload.follow_up(turn, turn.arrival + 1.0)
    assert checked > 40  # first turns (tenant prefix reused) and later turns (previous turn reused)
