"""Reproducible GPU-scale experiments whose tables live in docs/simulator.md.

    python -m tokenfleet.sim.experiments routing [--duration 30] [--rate 200]
    python -m tokenfleet.sim.experiments speed [--duration 20] [--replicas 16] [--rate 880]
    python -m tokenfleet.sim.experiments disaggregation [--duration 60] [--rate 60] [--replicas 8]

`routing`: the routing benchmark's question at GPU scale — 16 H100 replicas of an 8B model, 150 tenants
with 4,000-token system prompts (600k prefix tokens: more than one replica's KV cache holds), Zipf
popularity, short user turns; one seeded arrival pattern, one row per strategy: round-robin, least-load,
prefix affinity without the work bound ("prefix-exact"), with it (the default, "prefix-balanced"), and
session affinity (30% of arrivals open sessions in every run so the rows stay comparable).

`disaggregation`: the disaggregation benchmark's question at GPU scale — the same H100 fleet of an 8B model,
aggregated vs split into prefill and decode pods (several splits), one seeded workload of chat turns
(tenants' 1,000-token system prompts, ~150-token questions, ~200-token answers) mixed with long-document
requests (6,000 fresh tokens); KV moves over a 50 GB/s link per pod.

`speed`: wall-clock cost of simulating `duration` seconds of traffic on N replicas, extrapolated linearly to
one hour (per-step cost is flat in time at a steady load, so the extrapolation is the measured rate); also
scaled to a reference core by a calibration loop timed at every tick (cpu_speed.py), so that runs from
different hours compare.
"""

from __future__ import annotations

import argparse
import time

from tokenfleet.sim.api import simulate
from tokenfleet.sim.config import parse_config
from tokenfleet.sim.cpu_speed import REFERENCE_CALIBRATION_US, calibration_us

ROUTINGS = {
    "round-robin": {"strategy": "round-robin"},
    "least-load": {"strategy": "least-load"},
    "prefix-exact": {"strategy": "prefix-affinity", "balance": {"maxRatio": None}},
    "prefix-balanced": {"strategy": "prefix-affinity"},
    "session-affinity": {"strategy": "session-affinity"},
}


def routing(
    duration: float, rate: float, replicas: int = 16, tenants: int = 150, seed: int = 0
) -> list[tuple]:
    rows = []
    for label, routing_spec in ROUTINGS.items():
        config = parse_config(
            {
                "model": "llama-3-8b",
                "fleet": {"gpu": "h100-sxm", "replicas": replicas},
                "routing": {**routing_spec, "maxInFlightPerEndpoint": 4096},
                "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
                "workload": {
                    "rate": rate,
                    "duration_s": duration,
                    "num_tenants": tenants,
                    "zipf_s": 1.1,
                    "system_prompt_tokens": 4000,
                    "user_tokens": 200,
                    "output_tokens": 150,
                    "session_fraction": 0.3,
                    "turns_mean": 3,
                    "think_time_s": 5,
                    "seed": seed,
                },
            }
        )
        t0 = time.perf_counter()
        r = simulate(config)
        wall = time.perf_counter() - t0
        lat, load = r["latency_s"], r["load"]
        rows.append(
            (
                label,
                r["cache"]["prefix_hit_rate"],
                lat["ttft"]["p50"],
                lat["ttft"]["p99"],
                lat["tpot"]["p50"],
                lat["e2e"]["p50"],
                r["slo"]["goodput_fraction"],
                load["served_max"] / max(load["served_min"], 1),
                r["preemptions"],
                wall,
            )
        )
        print(_row(rows[-1], rows[0][2]), flush=True)
    return rows


HEADER = (
    "| routing | prefix hit | TTFT p50 s | TTFT p50 vs RR | TTFT p99 s | TPOT p50 s | E2E p50 s | goodput "
    "| max/min served | preemptions | wall s |"
)


def _row(r: tuple, rr_ttft: float) -> str:
    return (
        f"| {r[0]} | {r[1]:.1%} | {r[2]:.3f} | {r[2] / rr_ttft:.2f}x | {r[3]:.3f} | {r[4]:.4f} | {r[5]:.3f} "
        f"| {r[6]:.1%} | {r[7]:.2f} | {r[8]} | {r[9]:.0f} |"
    )


def disaggregation(duration: float, rate: float, replicas: int, splits: list[int], seed: int = 0) -> None:
    print(
        "| fleet | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | TPOT p99 ms | E2E p50 s | goodput "
        "| KV moved GB | transfer p99 ms | wall s |"
    )
    print("|" + "---|" * 11)
    for prefill in [0, *splits]:
        config = parse_config(
            {
                "model": "llama-3-8b",
                "fleet": {"gpu": "h100-sxm", "replicas": replicas},
                "routing": {"strategy": "prefix-affinity", "maxInFlightPerEndpoint": 4096},
                "disaggregation": {"prefill_replicas": prefill} if prefill else None,
                "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
                "workload": {
                    "rate": rate,
                    "duration_s": duration,
                    "num_tenants": 150,
                    "system_prompt_tokens": 1000,
                    "user_tokens": 150,
                    "output_tokens": 200,
                    "long_doc_fraction": 0.2,
                    "long_doc_tokens": 6000,
                    "max_prompt_tokens": 8000,
                    "seed": seed,
                },
            }
        )
        t0 = time.perf_counter()
        r = simulate(config)
        wall = time.perf_counter() - t0
        lat, dis = r["latency_s"], r["disaggregation"]
        label = (
            f"aggregated x{replicas}" if not prefill else f"{prefill} prefill : {replicas - prefill} decode"
        )
        moved = f"{dis['bytes_sent'] / 1e9:.0f}" if dis else "-"
        transfer = f"{dis['transfer_s']['p99'] * 1000:.1f}" if dis else "-"
        print(
            f"| {label} | {lat['ttft']['p50']:.3f} | {lat['ttft']['p99']:.3f} | {lat['itl']['p50'] * 1000:.1f} "
            f"| {lat['itl']['p99'] * 1000:.1f} | {lat['tpot']['p99'] * 1000:.1f} | {lat['e2e']['p50']:.2f} "
            f"| {r['slo']['goodput_fraction']:.1%} | {moved} | {transfer} | {wall:.0f} |",
            flush=True,
        )


def speed(duration: float, replicas: int, rate: float, output_tokens: int = 128) -> dict:
    """CPU seconds per virtual second of steady traffic, measured between the end of the warm-up (the first
    third of the arrivals: caches fill, batches grow) and the last arrival, read at the timeline's ticks —
    so neither the start nor the drain after the last arrival dilutes or inflates it."""
    from tokenfleet.sim.api import build_cost, build_model, build_workload
    from tokenfleet.sim.simulator import Simulation

    config = parse_config(
        {
            "model": "llama-3-8b",
            "fleet": {"gpu": "h100-sxm", "replicas": replicas},
            "routing": {"strategy": "prefix-affinity", "maxInFlightPerEndpoint": 4096},
            "workload": {
                "rate": rate,
                "duration_s": duration,
                "num_tenants": 150,
                "output_tokens": output_tokens,
                "seed": 0,
            },
            "timeline_points": max(2, int(duration)),
        }
    )
    model = build_model(config)
    cost = build_cost(config, model)
    sim = Simulation(config, build_workload(config), cost, model.name, model.max_model_len)
    # (virtual time, the run's own CPU time): the calibration loop timed at each tick is left out of it.
    marks: list[tuple[float, float]] = []
    calibs: list[float] = []
    calib_cpu = 0.0

    def tick(now: float) -> None:
        nonlocal calib_cpu
        before = time.process_time()
        marks.append((now, before - calib_cpu))
        if duration / 3 <= now <= duration:
            calibs.append(calibration_us(100))
            calib_cpu += time.process_time() - before

    sim.on_tick = tick
    t0, c0 = time.perf_counter(), time.process_time()
    r = sim.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0 - calib_cpu
    steady = [m for m in marks if duration / 3 <= m[0] <= duration]
    (v0, p0), (v1, p1) = steady[0], steady[-1]
    cpu_per_s = (p1 - p0) / max(v1 - v0, 1e-9)
    calib = sum(calibs) / len(calibs)
    normalised = cpu_per_s * REFERENCE_CALIBRATION_US / calib
    busy = r["load"]["busy_fraction_max"], r["load"]["busy_fraction_min"]
    out = {
        "requests": r["requests"]["finished"],
        "steps": r["engine_steps"],
        "output_tok_s": r["throughput"]["output_tokens_per_s"],
        "cpu_s": cpu,
        "wall_s": wall,
        "steady_cpu_per_virtual_s": cpu_per_s,
        "hour_cpu_min": cpu_per_s * 3600 / 60,
        "calibration_us": calib,
        "hour_cpu_min_normalised": normalised * 3600 / 60,
    }
    print(
        f"{replicas} replicas, {rate} req/s for {duration} s ({output_tokens}-token answers): "
        f"{out['requests']} requests, {out['steps']} steps, {out['output_tok_s']:.0f} output tok/s, "
        f"TPOT p50 {r['latency_s']['tpot']['p50'] * 1000:.1f} ms, TTFT p50 {r['latency_s']['ttft']['p50'] * 1000:.0f} ms, "
        f"busy {busy[1]:.0%}..{busy[0]:.0%}, prefix hits {r['cache']['prefix_hit_rate']:.0%}; "
        f"{cpu:.1f} s of CPU in all ({wall:.1f} s wall); steady state {v0:.0f}..{v1:.0f} s: "
        f"{cpu_per_s:.2f} CPU s per simulated second -> one hour of this traffic: {out['hour_cpu_min']:.1f} min "
        f"of one core (calibration: sum(range(1000)) = {calib:.1f} us here vs {REFERENCE_CALIBRATION_US:.0f} us on "
        f"a reference core -> {out['hour_cpu_min_normalised']:.1f} min normalised)",
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenfleet.sim.experiments")
    p.add_argument("experiment", choices=["routing", "speed", "disaggregation"])
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--rate", type=float)
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=128, help="speed: mean answer length")
    p.add_argument("--splits", help="disaggregation: prefill pod counts to try, e.g. 4,3,2")
    args = p.parse_args(argv)
    if args.experiment == "routing":
        print(HEADER)
        print("|" + "---|" * 11)
        routing(args.duration, args.rate or 200.0, args.replicas)
    elif args.experiment == "disaggregation":
        splits = [int(x) for x in args.splits.split(",")] if args.splits else [args.replicas // 2]
        disaggregation(args.duration, args.rate or 60.0, args.replicas, splits)
    else:
        speed(args.duration, args.replicas, args.rate or 880.0, args.output_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
