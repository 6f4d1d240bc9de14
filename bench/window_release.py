"""KV blocks held by long generations of a model with a sliding window on every layer, with and without the
window release, and what the release costs the scheduler per step (a null model: random token ids).

The same requests run twice through Scheduler + KVCacheManager: once with `sliding_window` W (blocks behind
every query's window go back to the pool) and once without (the whole context kept, as for full attention).
Figures: peak blocks in use, blocks held per request at the end, and the CPU time of schedule() + update()
per step (both runs measured the same way, interleaved in one process). With caching on, a released block
is hashed and indexed when it goes back (so it stays a prefix hit); without the release a generated block
is hashed only when its request frees its table, which these never-finishing requests never do, so the
CPU difference includes hashing the run without release defers. `--no-caching` shows the release alone.

    python bench/window_release.py [--seqs 256] [--window 256] [--block-size 16] [--steps 2048]
"""

from __future__ import annotations

import argparse
import random
import time

from tokenfleet.runtime.config import SchedulerConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_extra
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler import Scheduler


def build(num_seqs: int, steps: int, block_size: int, window: int | None, caching: bool) -> Scheduler:
    rng = random.Random(0)
    max_prompt = 512
    max_tokens = steps + 64
    num_blocks = num_seqs * -(-(max_prompt + max_tokens) // block_size) + 1
    kv = KVCacheManager(
        num_blocks, block_size, enable_caching=caching, hash_extra=hash_extra("bench"), sliding_window=window
    )
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=8192)
    scheduler = Scheduler(config, kv, max_model_len=max_prompt + max_tokens + 1)
    for i in range(num_seqs):
        prompt = [rng.randrange(50_000) for _ in range(rng.randint(128, max_prompt))]
        scheduler.add_request(
            Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        )
    return scheduler


def run(num_seqs: int, steps: int, block_size: int, window: int | None, caching: bool = True) -> None:
    rng = random.Random(1)
    scheduler = build(num_seqs, steps, block_size, window, caching)
    kv = scheduler.kv
    peak = 0
    cpu = 0.0
    measured = 0
    for _ in range(steps):
        c0 = time.process_time()
        out = scheduler.schedule()
        c1 = time.process_time()
        sampled = {s.request_id: [rng.randrange(50_000)] for s in out.scheduled if s.sample}
        c2 = time.process_time()
        scheduler.update(out, sampled)
        kv.take_events()
        c3 = time.process_time()
        if all(len(s.token_ids) == 1 for s in out.scheduled):  # decode-only steps
            cpu += (c1 - c0) + (c3 - c2)
            measured += 1
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
    held = [kv.num_held_blocks(r.request_id) for r in scheduler.running]
    tokens = [r.num_tokens for r in scheduler.running]
    label = (f"window {window}" if window is not None else "no release") + ("" if caching else ", no caching")
    print(
        f"{label:>12}: {num_seqs} seqs, block {block_size}, {steps} steps, {sum(tokens) / len(tokens):.0f} "
        f"tokens/seq at the end: peak blocks in use {peak}, held per request at the end "
        f"mean {sum(held) / len(held):.1f} max {max(held)}; schedule+update CPU "
        f"{1e3 * cpu / max(measured, 1):.3f} ms/step over {measured} decode steps; preemptions "
        f"{scheduler.num_preemptions_total}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2048)
    parser.add_argument(
        "--no-caching",
        dest="caching",
        action="store_false",
        help="prefix caching off: released blocks are not hashed (the cost of the release alone)",
    )
    args = parser.parse_args()
    for window in (args.window, None, args.window, None):  # twice each, interleaved: noise shows
        run(args.seqs, args.steps, args.block_size, window, args.caching)


if __name__ == "__main__":
    main()
