"""Scheduler + KV cache manager overhead per step: 256, 1,024 and 4,096 running sequences, a null model.

The model is replaced by random token ids, so the time measured is all bookkeeping the engine pays on
top of the forward pass each step: scheduling, block allocation, prefix-cache hashing and caching of
blocks as they fill, appending tokens and stop checks. Targets: <= 0.5 ms per step at 1,024 sequences and
<= 2 ms at 4,096, normalised (a fleet simulator runs these same classes for every simulated step of every
replica, and a server runs them between forward passes that a GPU finishes in a few milliseconds). CPU time is split
into schedule() and update(); the garbage collector's share is shown apart, since its passes cover the
whole heap of the process, not only what a step allocates. The collector runs with the settings of
`tokenfleet serve` and the simulator (long_lived_heap.py: the heap built at setup frozen, young
collections rare); `--gc-young 700` shows CPython's default.

    python bench/scheduler_overhead.py [--seqs 256 1024 4096] [--steps 300] [--block-size 16] [--gc-young N]
                                       [--profile [N]]

`--profile` runs the measured steps under cProfile and prints the N functions with the most time of
their own (the figures then include the profiler's own overhead: read them as shares, not as timings).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import time

from tokenfleet.runtime.config import SchedulerConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_extra
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.long_lived_heap import YOUNG_THRESHOLD
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler import Scheduler
from tokenfleet.sim.cpu_speed import REFERENCE_CALIBRATION_US, calibration_us

TARGET_MS = 0.5  # at TARGET_SEQS running sequences
TARGET_SEQS = 1024
TARGETS_MS = {TARGET_SEQS: TARGET_MS, 4096: 2.0}  # normalised ms per step, by running sequences


def build(num_seqs: int, steps: int, block_size: int, rng: random.Random) -> Scheduler:
    max_prompt = 512
    budget = 8192
    # Outputs long enough that nobody finishes during the measured steps: the first admitted decode
    # while the rest is still prefilling (at most num_seqs * max_prompt / budget steps).
    max_tokens = steps + 64 + num_seqs * max_prompt // budget
    num_blocks = num_seqs * -(-(max_prompt + max_tokens) // block_size)
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True, hash_extra=hash_extra("bench"))
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=budget)
    scheduler = Scheduler(config, kv, max_model_len=4096)
    system_prompt = [rng.randrange(50_000) for _ in range(64)]  # a shared prefix, as in chat traffic
    for i in range(num_seqs):
        prompt = system_prompt + [rng.randrange(50_000) for _ in range(rng.randint(16, max_prompt - 64))]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", prompt, params))
    return scheduler


class GCTimer:
    """Wall time the cyclic garbage collector spends, by generation (gc.callbacks), while `active`.

    A step's own work and the collector's passes over the whole heap are different costs: the second
    depends on everything else the process holds (a simulator's other replicas, a server's objects).
    """

    def __init__(self) -> None:
        self.active = False
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.active:
            generation = info["generation"]
            self.seconds[generation] += time.perf_counter() - self._start
            self.counts[generation] += 1

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def one_step(scheduler: Scheduler, rng: random.Random) -> tuple[int, float, float, float, float]:
    """One step: (requests scheduled, wall s, CPU s, CPU s of schedule(), CPU s of update()).

    Timed: schedule() + update() + draining the KV events. The null model's token draws are not timed.
    CPU time is reported besides wall time because this benchmark often shares its cores: CPU time
    excludes the time the process waits to be run.
    """
    w0, c0 = time.perf_counter(), time.process_time()
    out = scheduler.schedule()
    w1, c1 = time.perf_counter(), time.process_time()
    sampling = [*out.decodes.request_ids, *(s.request_id for s in out.others if s.sample)]
    sampled = {rid: [rng.randrange(50_000)] for rid in sampling}
    w2, c2 = time.perf_counter(), time.process_time()
    scheduler.update(out, sampled)
    scheduler.kv.take_events()  # the engine drains the KV events (for the router) every step
    w3, c3 = time.perf_counter(), time.process_time()
    return out.num_scheduled, (w1 - w0) + (w3 - w2), (c1 - c0) + (c3 - c2), c1 - c0, c3 - c2


def run(
    num_seqs: int,
    steps: int,
    block_size: int,
    gc_freeze: bool = True,
    gc_young: int = YOUNG_THRESHOLD,
    profile_top: int = 0,
) -> float:
    """Measure one configuration, print it; the normalised CPU ms per step.

    `gc_young`: net allocations between young-generation collections (`tokenfleet serve` and the
    simulator run with `YOUNG_THRESHOLD`; CPython's default is 700).
    `gc_freeze`: move everything built so far (KV blocks, requests) out of the collector's reach, as
    `tokenfleet serve` does once its engine is loaded, so that only what the steps allocate is collected.
    `profile_top`: profile the measured steps and print that many functions by own time (0: no profile).
    """
    rng = random.Random(0)
    scheduler = build(num_seqs, steps, block_size, rng)
    while any(r.num_output_tokens == 0 for r in scheduler.running) or scheduler.num_waiting:
        one_step(scheduler, rng)  # prefill everything: the measured steps are all decodes
    assert scheduler.num_running == num_seqs
    if gc_freeze:
        gc.collect()
        gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(gc_young, *threshold[1:])
    walls, cpus, sched_cpus, update_cpus = [], [], [], []
    gc_timer = GCTimer()
    gc_timer.active = True
    calibs = []
    profiler = cProfile.Profile() if profile_top else None
    if profiler is not None:
        profiler.enable()
    for step in range(steps):
        if step % 10 == 0:
            # Interleaved with the steps, so that both see the same contention on a shared machine.
            calibs.append(calibration_us(200))
        n, wall, cpu, sched_cpu, update_cpu = one_step(scheduler, rng)
        assert n == num_seqs
        walls.append(wall)
        cpus.append(cpu)
        sched_cpus.append(sched_cpu)
        update_cpus.append(update_cpu)
    if profiler is not None:
        profiler.disable()
    gc_timer.active = False
    gc_timer.close()
    gc.set_threshold(*threshold)
    if gc_freeze:
        gc.unfreeze()
    walls.sort()
    cpus.sort()
    wall_ms = 1e3 * sum(walls) / steps
    cpu_ms = 1e3 * sum(cpus) / steps
    cpu_p50_ms = 1e3 * cpus[steps // 2]
    sched_ms, update_ms = 1e3 * sum(sched_cpus) / steps, 1e3 * sum(update_cpus) / steps
    p50_ms, p99_ms = 1e3 * walls[steps // 2], 1e3 * walls[int(steps * 0.99)]
    gc_ms = 1e3 * sum(gc_timer.seconds) / steps
    calib = sum(calibs) / len(calibs)
    normalised_ms = cpu_ms * REFERENCE_CALIBRATION_US / calib
    verdict = ""
    target = TARGETS_MS.get(num_seqs)
    if target is not None:
        verdict = f"; target <= {target:.1f} ms: " + ("OK" if normalised_ms <= target else "ABOVE TARGET")
    print(
        f"scheduler+kv overhead, {num_seqs} running seqs, block {block_size}, {steps} steps:\n"
        f"  cpu  mean {cpu_ms:.3f} ms/step  p50 {cpu_p50_ms:.3f}  ({1e3 * cpu_ms / num_seqs:.2f} us/seq)"
        f"  = schedule {sched_ms:.3f} + update {update_ms:.3f}\n"
        f"  wall mean {wall_ms:.3f} ms/step  p50 {p50_ms:.3f}  p99 {p99_ms:.3f}\n"
        f"  of which garbage collection {gc_ms:.3f} ms/step (wall; heap frozen after setup: {gc_freeze}, young threshold "
        f"{gc_young}; "
        f"collections gen0/1/2: "
        f"{'/'.join(str(c) for c in gc_timer.counts)})\n"
        f"  calibration (interleaved): sum(range(1000)) = {calib:.1f} us CPU here vs {REFERENCE_CALIBRATION_US:.0f} us on "
        f"a reference core -> {normalised_ms:.3f} ms/step normalised{verdict}\n"
        f"  preemptions {scheduler.num_preemptions_total}, kv usage {scheduler.kv.usage:.0%}",
        flush=True,
    )
    if profiler is not None:
        print(
            f"  cProfile of the measured steps (with the profiler's overhead), top {profile_top} by own time:"
        )
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile_top)
    return normalised_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="leave the heap built at setup to the collector (the default freezes it, as `tokenfleet serve` "
        "does once its engine is loaded)",
    )
    parser.add_argument(
        "--gc-young",
        type=int,
        default=YOUNG_THRESHOLD,
        help=f"young-generation threshold of the collector during the steps (default {YOUNG_THRESHOLD}, as "
        "`tokenfleet serve` and the simulator run; CPython's own default is 700)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=15,
        default=0,
        metavar="N",
        help="profile the measured steps with cProfile and print the N functions with the most own time "
        "(default 15); the timings then include the profiler's overhead",
    )
    args = parser.parse_args()
    for num_seqs in args.seqs:
        run(num_seqs, args.steps, args.block_size, args.gc_freeze, args.gc_young, args.profile)


if __name__ == "__main__":
    main()
