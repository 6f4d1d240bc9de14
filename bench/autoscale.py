"""Autoscaling benchmark at GPU scale, in the fleet simulator: a bursty load, the operator's policy vs static fleets.

    python bench/autoscale.py [--base 20] [--burst 150] [--phase 60] [--cold-start 60] [--seed 0]
                              [--fast-cold-start 10] [--warm-pool 3] [--wake 5]

Measured (docs/simulator.md): `--phase 90 --cold-start 30 --warm-pool 2 --wake 1`.

Traffic (a JSONL trace, replayed): `base` req/s for one phase, `burst` req/s for the next, `base` again for
two more; 150 tenants with 1,000-token system prompts, 150-token questions, 150-token answers; 8B model on
H100 replicas. The fleets see the same trace:
- autoscaled, periodic decisions only: the operator's own policy (`autoscaling_policy.decide`, every 15 s)
  from 1 replica, targets waiting requests 4/replica and KV usage 0.7, TTFT p90 <= 1 s as a guard,
  `cold-start` seconds per new replica — the operator before it read demand between decisions;
- autoscaled: the same, and every second the routers' demand (`demand_calls_decision`: requests held, or
  the pods' queues over the target) runs the decision at once, as the operator does;
- autoscaled, fast cold start: the same with `fast-cold-start` seconds per new replica (what cutting the
  cold start's parts buys);
- autoscaled + warm pool: the same policy with `idle: sleep` and a pool of `warm-pool` replicas asleep from
  the start (as an earlier burst leaves them), woken in `wake` seconds — by the router's held requests at
  once, and by the policy's scale-ups — new replicas still cost `cold-start`. Sleepers hold their GPUs, so
  they count in replica-seconds;
- the same warm pool with a scale-down for a cheap wake (window 30 s, step 4, cooldown 15 s: capacity
  given back sooner, since a wake brings it back in about a second);
- static-peak: as many replicas as the autoscaled run peaked at, from the start (sized for the peak);
- static-base: one replica (sized for the base load).
Figures: SLO attainment (goodput: TTFT <= 2 s and TPOT <= 50 ms), TTFT p99, time from the burst's start
to the first scale-up decision and to the new capacity being Ready, replica-seconds, and the autoscaled
fleet's replica-seconds as a fraction of static-peak's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from tokenfleet.sim.api import simulate
from tokenfleet.sim.config import parse_config

# The warm fleet's second row: a scale-down that gives capacity back sooner, since bringing it back is a
# wake (about a second), not a cold start.
CHEAP_WAKE_SCALE_DOWN = {"stabilizationWindowSeconds": 30, "maxStep": 4, "cooldownSeconds": 15}


def write_trace(path: Path, base: float, burst: float, phase: float, seed: int) -> None:
    rng = np.random.Generator(np.random.PCG64(seed))
    weights = 1.0 / np.arange(1, 151) ** 1.1
    weights /= weights.sum()
    lines, t = [], 0.0
    schedule = [(phase, base), (phase, burst), (2 * phase, base)]
    start = 0.0
    for length, rate in schedule:
        while True:
            t += float(rng.exponential(1.0 / rate))
            if t >= start + length:
                t = start + length
                break
            tenant = int(rng.choice(150, p=weights))
            rec = {
                "t": round(t, 6),
                "prefix_group": f"tenant-{tenant}",
                "prefix_tokens": 1000,
                "suffix_tokens": 150,
                "output_tokens": 150,
            }
            lines.append(json.dumps(rec))
        start += length
    path.write_text("\n".join(lines) + "\n")


def run(
    trace: Path,
    replicas: int,
    autoscaling: dict | None,
    cold_start: float,
    until: float,
    in_flight: int,
    asleep: int = 0,
    wake: float = 1.0,
    demand: float | None = 1.0,
) -> tuple[dict, float]:
    config = parse_config(
        {
            "model": "llama-3-8b",
            "fleet": {"gpu": "h100-sxm", "replicas": replicas},
            # A pod takes at most this many requests beyond its running batch; the rest wait in the router's
            # queue, where a replica that becomes Ready can take them (a pod's own queue is never rebalanced).
            "routing": {"strategy": "prefix-affinity", "maxInFlightPerEndpoint": in_flight},
            "trace": str(trace),
            "autoscaling": autoscaling,
            "autoscale_interval_s": 15,
            "demand_interval_s": demand,
            "cold_start_s": cold_start,
            "start_asleep": asleep,
            "wake_s": wake,
            "run_until_s": until,
            "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
        }
    )
    t0 = time.perf_counter()
    r = simulate(config)
    return r, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=float, default=20.0)
    p.add_argument("--burst", type=float, default=150.0)
    p.add_argument("--phase", type=float, default=60.0)
    p.add_argument("--cold-start", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fast-cold-start", type=float, default=10.0, help="cold start of the second autoscaled fleet"
    )
    p.add_argument("--warm-pool", type=int, default=3, help="replicas asleep (idle: sleep) in the warm fleet")
    p.add_argument("--wake", type=float, default=5.0, help="a sleeper's wake to Ready, seconds")
    p.add_argument("--max-in-flight", type=int, default=320, help="router's maxInFlightPerEndpoint")
    args = p.parse_args()
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 8,
        "targets": {
            "waitingRequestsPerReplica": 4,
            "kvCacheUsage": 0.7,
            "ttft": {"percentile": 0.9, "seconds": 1.0},
        },
        "scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 4, "cooldownSeconds": 0},
        "scaleDown": {"stabilizationWindowSeconds": 60, "maxStep": 2, "cooldownSeconds": 30},
    }
    until = 6 * args.phase  # two phases of quiet after the trace: room to scale back down
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "burst.jsonl"
        write_trace(trace, args.base, args.burst, args.phase, args.seed)
        common = (args.cold_start, until, args.max_in_flight)
        periodic, wall_periodic = run(trace, 1, autoscaling, *common, demand=None)
        auto, wall_auto = run(trace, 1, autoscaling, *common)
        fast, wall_fast = run(trace, 1, autoscaling, args.fast_cold_start, *common[1:])
        warm_spec = autoscaling | {"idle": "sleep", "warmPoolSize": args.warm_pool}
        warm, wall_warm = run(trace, 1, warm_spec, *common, asleep=args.warm_pool, wake=args.wake)
        # A wake costs a second, not a cold start: capacity can be given back sooner.
        warm_fast_down = warm_spec | {"scaleDown": CHEAP_WAKE_SCALE_DOWN}
        warm_down, wall_warm_down = run(
            trace, 1, warm_fast_down, *common, asleep=args.warm_pool, wake=args.wake
        )
        peak = max(periodic["fleet"]["replicas_peak"], auto["fleet"]["replicas_peak"])
        static_peak, wall_peak = run(trace, peak, None, *common)
        static_base, wall_base = run(trace, 1, None, *common)

    def first_up(r: dict) -> float:
        ups = [e for e in r["fleet"]["scale_events"] if e[2] > e[1] and e[0] >= args.phase]
        return ups[0][0] - args.phase if ups else float("nan")

    print(
        f"trace: {args.base} -> {args.burst} -> {args.base} req/s, phases of {args.phase:.0f} s; "
        f"cold start {args.cold_start:.0f} s (fast: {args.fast_cold_start:.0f} s); warm pool {args.warm_pool} "
        f"asleep, wake {args.wake:.0f} s; 8B on H100"
    )
    print("| fleet | replicas | goodput | TTFT p99 s | TPOT p99 s | replica-s | vs static-peak | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    peak_seconds = max(static_peak["fleet"]["replica_seconds"], 1e-9)
    for label, r, reps, wall in (
        (
            "autoscaled, periodic decisions only",
            periodic,
            f"1..{periodic['fleet']['replicas_peak']}",
            wall_periodic,
        ),
        ("autoscaled", auto, f"1..{auto['fleet']['replicas_peak']}", wall_auto),
        (
            f"autoscaled, cold start {args.fast_cold_start:.0f} s",
            fast,
            f"1..{fast['fleet']['replicas_peak']}",
            wall_fast,
        ),
        (
            f"autoscaled + {args.warm_pool} asleep",
            warm,
            f"1..{warm['fleet']['replicas_peak']} awake",
            wall_warm,
        ),
        (
            f"autoscaled + {args.warm_pool} asleep, scale-down for a cheap wake",
            warm_down,
            f"1..{warm_down['fleet']['replicas_peak']} awake",
            wall_warm_down,
        ),
        ("static-peak", static_peak, str(peak), wall_peak),
        ("static-base", static_base, "1", wall_base),
    ):
        print(
            f"| {label} | {reps} | {r['slo']['goodput_fraction']:.1%} | {r['latency_s']['ttft']['p99']:.3f} "
            f"| {r['latency_s']['tpot']['p99']:.4f} | {r['fleet']['replica_seconds']:.0f} "
            f"| {r['fleet']['replica_seconds'] / peak_seconds:.2f}x | {wall:.0f} |"
        )
    for label, r in (("periodic decisions only", periodic), ("with demand between decisions", auto)):
        print(
            f"autoscaled, {label}: first scale-up {first_up(r):.1f} s after the burst starts; capacity Ready "
            f"after {first_up(r) + args.cold_start:.1f} s"
        )
    print("scale events:", json.dumps(auto["fleet"]["scale_events"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
