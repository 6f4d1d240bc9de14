"""Prefix-cache policy comparison: hit rate per eviction policy, with and without the host tier, two sizes.

    python bench/cache_policy.py [--requests 3000] [--seed 0]

A KV-manager-level simulation (no model: the policies decide which tokens need a prefill, and prefill
time is proportional to those tokens): real KVCacheManager, BlockPool, policies and HostKVTier, driven by
a trace that mixes what serving traffic looks like:
- chat: one of 4 long system prompts (512 tokens, Zipf popularity) + a unique question;
- sessions: multi-turn conversations whose next turn extends the previous prompt;
- one-off documents: 1-2k unique tokens each, never seen again;
- scans: a batch job reading a 300-document corpus (256 tokens each) in order, twice over the trace.
Up to 4 requests are in flight (they hold their blocks), as in a small continuous batch.

Columns: policy, host tier on/off, device blocks; hit% = prompt tokens served from cache (device + host);
host% = the share of those copied back from the host tier; prefill/req = tokens computed per request
(what TTFT scales with on a compute-bound prefill); sys-hit% = hit rate on system-prompt blocks alone.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import deque
from dataclasses import dataclass

from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.kv_cache.offload import HostKVTier
from tokenfleet.runtime.engine.request import Request, RequestStatus
from tokenfleet.runtime.engine.sampling_params import SamplingParams

BLOCK = 16
EXTRA = hash_extra("bench")
SYSTEM_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceItem:
    tokens: tuple[int, ...]
    hashes: tuple[bytes, ...]
    num_system_blocks: int  # leading blocks that belong to a shared system prompt


def build_trace(num_requests: int, seed: int) -> list[TraceItem]:
    rng = random.Random(seed)
    fresh = iter(range(10_000, 10**9))

    def unique(n: int) -> list[int]:
        return [next(fresh) for _ in range(n)]

    systems = [unique(SYSTEM_TOKENS) for _ in range(4)]
    corpus = [unique(256) for _ in range(300)]
    scan_pos = 0
    sessions: list[list[int]] = []
    items: list[TraceItem] = []
    for _ in range(num_requests):
        kind = rng.random()
        num_sys = 0
        if kind < 0.40:  # chat with a shared system prompt; popularity 1, 1/2, 1/3, 1/4
            system = rng.choices(systems, weights=[12, 6, 4, 3])[0]
            tokens = system + unique(rng.randint(32, 96))
            num_sys = SYSTEM_TOKENS // BLOCK
        elif kind < 0.55:  # a session's next turn
            if not sessions or rng.random() < 0.3:
                sessions.append(unique(rng.randint(64, 160)))
                sessions = sessions[-20:]
            i = rng.randrange(len(sessions))
            sessions[i] = sessions[i] + unique(rng.randint(32, 96))
            tokens = sessions[i]
        elif kind < 0.75:  # a one-off document
            tokens = unique(rng.randint(1000, 2000))
        else:  # the scan: next corpus document (+ an instruction), cycling
            tokens = corpus[scan_pos % len(corpus)] + unique(16)
            scan_pos += 1
        items.append(TraceItem(tuple(tokens), tuple(block_hashes_for(tokens, BLOCK, EXTRA)), num_sys))
    return items


@dataclass(frozen=True, slots=True)
class Result:
    hit_rate: float
    host_share: float
    prefill_per_request: float
    system_hit_rate: float
    seconds: float


def simulate(trace: list[TraceItem], num_blocks: int, eviction: str, host_blocks: int) -> Result:
    km = KVCacheManager(num_blocks, BLOCK, hash_extra=EXTRA, eviction=eviction, enable_kv_events=False)
    if host_blocks:
        km.attach_host_tier(HostKVTier(host_blocks))
    in_flight: deque[Request] = deque()
    queried = hit = prefilled = sys_blocks = sys_hits = 0
    start = time.perf_counter()
    for n, item in enumerate(trace):
        if len(in_flight) >= 4:
            done = in_flight.popleft()
            done.status = RequestStatus.FINISHED_LENGTH
            km.free(done)
        r = Request(str(n), list(item.tokens), SamplingParams(max_tokens=1))
        r.block_hashes = list(item.hashes)  # precomputed: the simulation measures policies, not hashing
        blocks, num_hit = km.get_computed_blocks(r)
        while km.allocate_slots(r, r.num_tokens - num_hit, blocks) is None:
            done = in_flight.popleft()  # make room, as the scheduler would by waiting
            done.status = RequestStatus.FINISHED_LENGTH
            km.free(done)
            blocks, num_hit = km.get_computed_blocks(r)
        r.num_computed_tokens = r.num_tokens
        in_flight.append(r)
        queried += r.num_tokens
        hit += num_hit
        prefilled += r.num_tokens - num_hit
        sys_blocks += item.num_system_blocks
        sys_hits += min(item.num_system_blocks, num_hit // BLOCK)
        if km.host is not None:
            km.host.take_transfers()  # the copies themselves are the engine's; nothing to run here
    m = km.metrics()
    hit_blocks = m.device_hit_blocks + m.host_hit_blocks
    return Result(
        hit_rate=hit / queried,
        host_share=m.host_hit_blocks / hit_blocks if hit_blocks else 0.0,
        prefill_per_request=prefilled / len(trace),
        system_hit_rate=sys_hits / sys_blocks if sys_blocks else 0.0,
        seconds=time.perf_counter() - start,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host-blocks", type=int, default=2048)
    ap.add_argument("--sizes", type=int, nargs=2, default=(384, 1536), help="device blocks (small, large)")
    args = ap.parse_args()
    trace = build_trace(args.requests, args.seed)
    total_tokens = sum(len(t.tokens) for t in trace)
    print(f"trace: {len(trace)} requests, {total_tokens} prompt tokens, block size {BLOCK}")
    print(
        f"{'policy':8} {'host':>5} {'blocks':>6} {'hit%':>6} {'host%':>6} {'prefill/req':>11} {'sys-hit%':>8}"
    )
    for num_blocks in args.sizes:
        for host in (0, args.host_blocks):
            for eviction in ("lru", "lfu", "s3fifo"):
                r = simulate(trace, num_blocks, eviction, host)
                print(
                    f"{eviction:8} {('on' if host else 'off'):>5} {num_blocks:>6} {100 * r.hit_rate:6.1f} "
                    f"{100 * r.host_share:6.1f} {r.prefill_per_request:11.0f} {100 * r.system_hit_rate:8.1f}"
                )


if __name__ == "__main__":
    main()
