"""`tokenfleet simulate plan`: the cheapest fleets (GPU type x TP x replicas x routing) that meet an SLO.

For every (GPU, TP, routing) candidate whose weights fit, the fewest replicas that meet the SLO are found by
bisection over [1, max_replicas] (more replicas never hurt latency here: the SLO check is monotone in
practice), each probe one full simulation of the same seeded traffic. Candidates are ranked by cost per
hour (replicas x TP x price). Before searching, a candidate whose *single-sequence* decode step is already
slower than the TPOT bound, or whose prefill of the mean prompt alone exceeds the TTFT bound, is dropped as
impossible; if every candidate is, the SLO itself is reported as impossible, naming the bound.

The candidates' searches are independent, so they run in parallel worker processes (`jobs`; the CLI uses
every core this process may run on): on this machine's 2 cores a plan takes about half the time.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import queue
import sys
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass

from tokenfleet.runtime.engine.parallel.worker import die_with_parent
from tokenfleet.sim.api import build_workload, simulate
from tokenfleet.sim.config import SimConfig
from tokenfleet.sim.cost_model import BatchShape, RooflineCost
from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.hardware import gpu_profile
from tokenfleet.sim.model_profile import model_profile


@dataclass(frozen=True, slots=True)
class Candidate:
    gpu: str
    tp: int
    routing: str
    replicas: int
    met: bool
    cost_per_hour: float
    ttft_p99: float
    tpot_p99: float
    goodput: float


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, stream=sys.stderr, width: int = 30) -> None:
        self.total, self.done, self.stream, self.width = max(total, 1), 0, stream, width

    def update(self, label: str) -> None:
        self.done += 1
        filled = int(self.width * min(self.done / self.total, 1.0))
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {label:<40}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _floor_latencies(config: SimConfig, gpu: str, tp: int) -> tuple[float, float]:
    """(fastest TPOT, fastest TTFT of a mean prompt) on an otherwise idle replica."""
    model = model_profile(config.model).with_precision(config.fleet.weights, config.fleet.kv_cache)
    cost = RooflineCost(gpu_profile(gpu), model, tp)
    w = config.workload
    p = w.system_prompt_tokens + w.user_tokens
    tpot = cost.step_seconds(BatchShape(1, 1, 1, p, p))
    ttft = cost.step_seconds(BatchShape(p, 1, 1, p * (p + 1) / 2, p))
    return tpot, ttft


def plan(
    config: SimConfig,
    gpus: list[str],
    tps: list[int],
    routings: list[str],
    max_replicas: int,
    top: int = 5,
    progress: Progress | None = None,
    jobs: int = 1,
) -> tuple[list[Candidate], list[Candidate], list[str]]:
    """(feasible fleets cheapest first, closest infeasible ones best goodput first, skipped candidates).

    `jobs` > 1 searches that many candidates at once, each in its own process (a search is one
    candidate's bisection: its probes depend on each other, the candidates do not); the answer is the same
    for any `jobs`, since every probe is a seeded, deterministic simulation."""
    if config.disaggregation is not None:
        raise SimInputError(
            "disaggregation",
            "plan searches aggregated fleets; compare prefill:decode splits with `simulate run` "
            "(or `python -m tokenfleet.sim.experiments disaggregation --splits ...`)",
        )
    build_workload(config)  # a bad trace fails before any search
    combos = []
    impossible = []
    skipped: list[str] = []
    model = model_profile(config.model).with_precision(config.fleet.weights, config.fleet.kv_cache)
    for gpu in gpus:
        profile = gpu_profile(gpu, "gpus")
        for tp in tps:
            if tp > profile.max_tp:
                continue
            if RooflineCost(profile, model, tp).num_kv_blocks(config.cache.block_size) < 64:
                skipped.append(f"{profile.name} tp={tp}: the weights leave (almost) no KV cache")
                continue
            tpot, ttft = _floor_latencies(config, profile.name, tp)
            if tpot > config.slo.tpot_s or ttft > config.slo.ttft_s:
                impossible.append((profile.name, tp, tpot, ttft))
                skipped.append(
                    f"{profile.name} tp={tp}: batch-1 TPOT {tpot:.4f} s / TTFT {ttft:.4f} s already miss the SLO"
                )
                continue
            combos.extend((profile.name, tp, r) for r in routings)
    if not combos:
        if impossible:
            best = min(impossible, key=lambda c: c[2])
            raise SimInputError(
                "slo",
                f"no candidate can meet TPOT <= {config.slo.tpot_s} s / TTFT <= {config.slo.ttft_s} s even at batch 1: "
                f"the fastest is {best[0]} tp={best[1]} with TPOT {best[2]:.4f} s, TTFT {best[3]:.4f} s",
            )
        raise SimInputError("gpus", f"{config.model} fits on none of {gpus} with tp in {tps}")
    steps = max(1, max_replicas.bit_length() + 1)
    progress = progress or Progress(len(combos) * steps)
    progress.total = len(combos) * steps
    feasible: list[Candidate] = []
    closest: list[Candidate] = []
    for candidate in _searches(config, combos, max_replicas, jobs, progress):
        (feasible if candidate.met else closest).append(candidate)
    progress.close()
    feasible.sort(key=lambda c: (c.cost_per_hour, c.gpu, c.tp, c.routing))
    closest.sort(key=lambda c: (-c.goodput, c.cost_per_hour, c.gpu, c.tp, c.routing))
    return feasible[:top], closest[:top], skipped


def _search(
    config: SimConfig, combo: tuple[str, int, str], max_replicas: int, report: Callable[[str], None]
) -> Candidate:
    """The fewest replicas of one (gpu, tp, routing) that meet the SLO, by bisection over [1, max_replicas];
    when even `max_replicas` misses it, that run (the closest this candidate gets). `report` is told of
    every probe."""
    gpu, tp, routing = combo
    runs: dict[int, Candidate] = {}

    def run(replicas: int) -> Candidate:
        if replicas not in runs:
            cfg = config.model_copy(
                update={
                    "fleet": config.fleet.model_copy(update={"gpu": gpu, "tp": tp, "replicas": replicas}),
                    "routing": config.routing.model_copy(update={"strategy": routing}),
                    "autoscaling": None,
                }
            )
            r = simulate(cfg)
            price = r["fleet"]["price_per_gpu_hour"]
            runs[replicas] = Candidate(
                gpu,
                tp,
                routing,
                replicas,
                r["slo"]["met"],
                replicas * tp * price,
                r["latency_s"]["ttft"]["p99"],
                r["latency_s"]["tpot"]["p99"],
                r["slo"]["goodput_fraction"],
            )
            report(f"{gpu} tp{tp} {routing} x{replicas}")
        return runs[replicas]

    top_run = run(max_replicas)
    if not top_run.met:
        return top_run
    lo, hi = 1, max_replicas
    while lo < hi:
        mid = (lo + hi) // 2
        if run(mid).met:
            hi = mid
        else:
            lo = mid + 1
    return run(lo)


# A worker process's channel for its probes' labels, and the plan's signal to stop searching (set by
# `_init_worker`, once per process).
_labels: multiprocessing.queues.Queue | None = None
_stop: multiprocessing.synchronize.Event | None = None


class _Cancelled(Exception):
    """A worker's search ended early: the plan stopped (another search failed, or it was interrupted)."""


def _init_worker(
    labels: multiprocessing.queues.Queue, stop: multiprocessing.synchronize.Event, parent_pid: int
) -> None:
    global _labels, _stop
    _labels, _stop = labels, stop
    # A killed plan leaves no worker simulating on. (Ctrl-C reaches the whole group: a worker's search
    # ends with KeyboardInterrupt, which comes back as its result.)
    die_with_parent(parent_pid)


def _search_in_worker(
    config: SimConfig, combo: tuple[str, int, str], max_replicas: int
) -> tuple[Candidate, int]:
    """`_search` in a worker: the result and how many labels it sent (the parent reads that many). Once the
    plan stops, a search ends at its next probe boundary instead of running its bisection out."""
    sent = 0

    def report(label: str) -> None:
        nonlocal sent
        sent += 1
        _labels.put(label)
        if _stop.is_set():
            raise _Cancelled

    if _stop.is_set():
        raise _Cancelled
    return _search(config, combo, max_replicas, report), sent


def _searches(
    config: SimConfig, combos: list[tuple[str, int, str]], max_replicas: int, jobs: int, progress: Progress
) -> list[Candidate]:
    """Each combo's search result, in the combos' order; `jobs` worker processes when more than one."""
    if jobs <= 1 or len(combos) == 1:
        return [_search(config, combo, max_replicas, progress.update) for combo in combos]
    # spawn: a fresh interpreter per worker, nothing inherited from whatever threads the caller runs.
    ctx = multiprocessing.get_context("spawn")
    labels = ctx.Queue()
    stop = ctx.Event()
    received = 0

    def show(block: bool) -> None:
        nonlocal received
        while True:
            try:
                label = labels.get(timeout=30) if block else labels.get_nowait()
            except queue.Empty:
                return
            received += 1
            progress.update(label)
            block = False

    pool = ProcessPoolExecutor(
        min(jobs, len(combos)),
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(labels, stop, os.getpid()),
    )
    try:
        futures = [pool.submit(_search_in_worker, config, combo, max_replicas) for combo in combos]
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            show(block=False)
            for f in done:
                if f.exception() is not None:
                    # The plan has no answer now: raise it at once, not after every other search.
                    raise f.exception()
        results = [f.result() for f in futures]
        # A label is put before its search returns, but it travels through the queue's own thread and
        # pipe: the last ones may still be on their way.
        sent = sum(n for _, n in results)
        while received < sent:
            before = received
            show(block=True)
            if received == before:
                break  # none came for 30 s: the bar may stay short, the answer is complete
    finally:
        # Searches not started are dropped; running ones stop after their current probe (see
        # `_search_in_worker`), so an error or Ctrl-C costs at most one probe per worker.
        stop.set()
        pool.shutdown(cancel_futures=True)
        labels.close()
    return [candidate for candidate, _ in results]


def format_candidates(title: str, rows: list[Candidate]) -> str:
    lines = [
        title,
        f"{'gpu':10} {'tp':>3} {'routing':16} {'replicas':>8} {'$/hour':>8} {'TTFT p99':>9} {'TPOT p99':>9} {'goodput':>8}",
    ]
    for c in rows:
        lines.append(
            f"{c.gpu:10} {c.tp:3d} {c.routing:16} {c.replicas:8d} {c.cost_per_hour:8.2f} "
            f"{c.ttft_p99:9.3f} {c.tpot_p99:9.4f} {c.goodput:8.1%}"
        )
    return "\n".join(lines)
