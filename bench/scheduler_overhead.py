"""Scheduler + KV cache manager overhead per step: 256 and 1,024 running sequences, a null model.

The model is replaced by random token ids, so the time measured is all bookkeeping the engine pays on
top of the forward pass each step: scheduling, block allocation, prefix-cache hashing and caching of
blocks as they fill, appending tokens and stop checks. Target: <= 1 ms per step.

    python bench/scheduler_overhead.py [--seqs 256] [--steps 300] [--block-size 16]
"""

from __future__ import annotations

import argparse
import random
import time
import timeit

from tokenfleet.runtime.config import SchedulerConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_extra
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler import Scheduler

TARGET_MS = 1.0


def build(num_seqs: int, steps: int, block_size: int, rng: random.Random) -> Scheduler:
    max_prompt = 512
    num_blocks = num_seqs * -(-(max_prompt + steps + 64) // block_size)
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True, hash_extra=hash_extra("bench"))
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=8192)
    scheduler = Scheduler(config, kv, max_model_len=4096)
    system_prompt = [rng.randrange(50_000) for _ in range(64)]  # a shared prefix, as in chat traffic
    for i in range(num_seqs):
        prompt = system_prompt + [rng.randrange(50_000) for _ in range(rng.randint(16, max_prompt - 64))]
        params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", prompt, params))
    return scheduler


def one_step(scheduler: Scheduler, rng: random.Random) -> tuple[int, float, float]:
    """One step; (requests scheduled, wall s, CPU s) of schedule() + update() + draining KV events.

    The null model's token draws are not timed. CPU time is reported besides wall time because this
    benchmark often shares its cores: CPU time excludes the time the process waits to be run.
    """
    w0, c0 = time.perf_counter(), time.process_time()
    out = scheduler.schedule()
    w1, c1 = time.perf_counter(), time.process_time()
    sampled = {s.request_id: [rng.randrange(50_000)] for s in out.scheduled if s.sample}
    w2, c2 = time.perf_counter(), time.process_time()
    scheduler.update(out, sampled)
    scheduler.kv.take_events()  # the engine drains the KV events (for the router) every step
    w3, c3 = time.perf_counter(), time.process_time()
    return len(out.scheduled), (w1 - w0) + (w3 - w2), (c1 - c0) + (c3 - c2)


REFERENCE_CALIBRATION_US = 10.0  # sum(range(1000)) on an idle, current x86 server core (CPython 3.11)


def calibration_us() -> float:
    """CPU time of a fixed pure-Python workload (best of 5), to compare figures across machines."""
    runs = timeit.repeat("sum(range(1000))", number=2000, repeat=5, timer=time.process_time)
    return 1e6 * min(runs) / 2000


def run(num_seqs: int, steps: int, block_size: int) -> None:
    rng = random.Random(0)
    scheduler = build(num_seqs, steps, block_size, rng)
    while any(r.num_output_tokens == 0 for r in scheduler.running) or scheduler.num_waiting:
        one_step(scheduler, rng)  # prefill everything: the measured steps are all decodes
    assert scheduler.num_running == num_seqs
    walls, cpus = [], []
    for _ in range(steps):
        n, wall, cpu = one_step(scheduler, rng)
        assert n == num_seqs
        walls.append(wall)
        cpus.append(cpu)
    walls.sort()
    cpus.sort()
    wall_ms = 1e3 * sum(walls) / len(walls)
    cpu_ms = 1e3 * sum(cpus) / len(cpus)
    cpu_p50_ms = 1e3 * cpus[len(cpus) // 2]
    p50_ms, p99_ms = 1e3 * walls[len(walls) // 2], 1e3 * walls[int(len(walls) * 0.99)]
    calib = calibration_us()
    normalised_ms = cpu_ms * REFERENCE_CALIBRATION_US / calib
    verdict = "OK" if normalised_ms <= TARGET_MS else "ABOVE TARGET"
    print(
        f"scheduler+kv overhead, {num_seqs} running seqs, block {block_size}, {steps} steps:\n"
        f"  cpu  mean {cpu_ms:.3f} ms/step  p50 {cpu_p50_ms:.3f}  ({1e3 * cpu_ms / num_seqs:.2f} us/seq)\n"
        f"  wall mean {wall_ms:.3f} ms/step  p50 {p50_ms:.3f}  p99 {p99_ms:.3f}\n"
        f"  calibration: sum(range(1000)) = {calib:.1f} us CPU here vs {REFERENCE_CALIBRATION_US:.0f} us on "
        f"a reference core -> {normalised_ms:.3f} ms/step normalised; target <= {TARGET_MS:.1f} ms: {verdict}\n"
        f"  preemptions {scheduler.num_preemptions_total}, kv usage {scheduler.kv.usage:.0%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    for num_seqs in args.seqs:
        run(num_seqs, args.steps, args.block_size)


if __name__ == "__main__":
    main()
