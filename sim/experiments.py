"""Reproducible GPU-scale experiments whose tables live in docs/simulator.md.

    python -m tokenfleet.sim.experiments routing [--duration 30] [--rate 200]
    python -m tokenfleet.sim.experiments speed [--duration 20] [--replicas 16] [--rate 880]
    python -m tokenfleet.sim.experiments disaggregation [--duration 60] [--rate 60] [--replicas 8]
    python -m tokenfleet.sim.experiments fairness [--duration 20] [--replicas 8] [--flood 10] [--b-share 1]
                                                  [--budget 8192]
    python -m tokenfleet.sim.experiments priority [--duration 40] [--replicas 8] [--rate BATCH_RATE]

`routing`: the routing benchmark's question at GPU scale — 16 H100 replicas of an 8B model, 150 tenants
with 4,000-token system prompts (600k prefix tokens: more than one replica's KV cache holds), Zipf
popularity, short user turns; one seeded arrival pattern, one row per strategy: round-robin, least-load,
prefix affinity without the work bound ("prefix-exact"), with it (the default, "prefix-balanced"), and
session affinity (30% of arrivals open sessions in every run so the rows stay comparable).

`disaggregation`: the disaggregation benchmark's question at GPU scale — the same H100 fleet of an 8B model,
aggregated vs split into prefill and decode pods (several splits), one seeded workload of chat turns
(tenants' 1,000-token system prompts, ~150-token questions, ~200-token answers) mixed with long-document
requests (6,000 fresh tokens); KV moves over a 50 GB/s link per pod.

`fairness`: the router's fair share at GPU scale — H100 replicas of an 8B model behind a router that holds
what the pods cannot run (`maxInFlightPerEndpoint` = the pods' `max_num_seqs`), two tenants with the same
request shape: B sends at its share (half of the fleet's capacity) and A at ten times its share (five
fleets' worth), A from the start and B once the fleet is full; B alone, then A + B with fair share off and
on.

`priority`: interactive beside batch at GPU scale — a batch flood (long questions and answers, priority 10)
past the fleet's capacity plus a few interactive requests (short, priority -10), behind the router's
priority queue holding the backlog (in flight per pod = `max_num_seqs`) or leaving it to the pods; the pods'
scheduler `policy` fcfs vs priority (preempting batch for interactive); then batch prompts long enough to
be chunked over several steps, where under `priority` their chunks give the step's budget to interactive
requests first.

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


# Requests of the fairness experiment: a 500-token system prompt per tenant, ~600-token questions, ~300-token
# answers; 256 of them fit one H100's KV cache, so a pod is full by `max_num_seqs`. One replica of
# Llama-3-8B serves ~29 of them per second: measured with B alone on one replica (256 in flight), TTFT p50 /
# p99 0.037 / 0.11 s at 24/s, 0.047 / 0.80 s at 28/s, 1.2 / 4.5 s at 32/s.
FAIR_REQUEST = {"system_prompt_tokens": 500, "user_tokens": 600, "output_tokens": 300}
FAIR_CAPACITY_PER_REPLICA = 29.0
# The router's in-flight bound per pod when the pods' own queues are to hold the backlog (their fair share
# then decides who is admitted, and preempts a flood's request for a tenant far behind in service).
POD_QUEUE_IN_FLIGHT = 1024


def _sim(config: dict) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = simulate(parse_config(config))
    return r, time.perf_counter() - t0


def fairness(
    duration: float,
    replicas: int = 8,
    flood: float = 10.0,
    b_share: float = 1.0,
    warmup: float = 10.0,
    seed: int = 0,
    budget: int = 8192,
) -> list[tuple]:
    """B at `b_share` of its share of the fleet, A at `flood` times its share; rows: B alone, A + B without
    fair share, with it in the router, and with it in the router and the pods. A floods from the start and
    B sends for `duration` seconds from `warmup` on, into a fleet already full (at the very start no request
    has finished yet, so for the first answer's time nobody gets a slot whatever the order). Requests wait
    in the router once every pod holds `max_num_seqs`, up to `queueTimeoutSeconds` (5 s: then 429); the
    queue's bound is out of the way (a full queue refuses B as well as A, whatever the order), so the order
    alone decides who is served. In the last row the router lets each pod hold POD_QUEUE_IN_FLIGHT, so the
    pods' own fair-share queues hold most of the flood and their schedulers preempt A's requests for B.
    `budget`: the pods' `max_num_batched_tokens` (how long a step of prefill chunks may be)."""
    share = FAIR_CAPACITY_PER_REPLICA * replicas / 2
    b = {"name": "B", "rate": b_share * share, "start_s": warmup, **FAIR_REQUEST}
    a = {"name": "A", "rate": flood * share, **FAIR_REQUEST}
    print(
        f"{replicas} x H100, capacity ~{2 * share:.0f} req/s; B sends {b_share * share:.0f} req/s "
        f"({b_share:g}x its share) for {duration:g} s from t = {warmup:g} s; A {flood * share:.0f} req/s "
        f"({flood:g}x its share) from t = 0"
    )
    print(
        "| run | B TTFT p50 s | B TTFT p99 s | B TTFT p99 / alone | B goodput | B rejected | B tok/s "
        "| A goodput | A rejected | A tok/s | mean step ms | B TTFT mean ms = router + pod queue + prefill "
        "| wall s |"
    )
    print("|" + "---|" * 13)
    rows = []
    solo_p99 = None
    # (label, tenants, fair share in the router, in the pods' schedulers, router's in-flight bound per pod)
    runs = (
        ("B alone", [b], False, False, 256),
        ("A + B, fair share off", [a, b], False, False, 256),
        ("A + B, fair share in the router", [a, b], True, False, 256),
        ("A + B, fair share in the router and the pods", [a, b], True, True, POD_QUEUE_IN_FLIGHT),
    )
    for label, tenants, fair, pods_fair, in_flight in runs:
        r, wall = _sim(
            {
                "model": "llama-3-8b",
                "fleet": {"gpu": "h100-sxm", "replicas": replicas},
                "scheduler": {
                    "max_num_seqs": 256,
                    "max_num_batched_tokens": budget,
                    "max_waiting": 100_000,
                    "fair_share": pods_fair,
                },
                "routing": {
                    "strategy": "prefix-affinity",
                    "maxInFlightPerEndpoint": in_flight,
                    "maxQueued": 1_000_000,
                    "queueTimeoutSeconds": 5,
                    "fairShare": {"enabled": fair},
                },
                "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
                "breakdown": ["tenant"],
                # Every row runs for the same time (the flood's fleet is still busy when arrivals stop), so
                # that tokens per second compare.
                "drain_limit_s": 10,
                "run_until_s": warmup + duration + 10,
                "workload": {"duration_s": warmup + duration, "tenants": tenants, "seed": seed},
            }
        )
        by = r["by_tenant"]
        bt = by["B"]
        at = by.get("A")
        p99 = bt["latency_s"]["ttft"]["p99"]
        solo_p99 = solo_p99 or p99
        row = (
            label,
            bt["latency_s"]["ttft"]["p50"],
            p99,
            p99 / solo_p99,
            bt["goodput_fraction"],
            bt["requests"]["rejected"],
            bt["output_tokens_per_s"],
            at["goodput_fraction"] if at else None,
            at["requests"]["rejected"] if at else None,
            at["output_tokens_per_s"] if at else None,
            r["load"]["step_s_mean"],
            wall,
            # B's mean TTFT in its three consecutive parts (they sum to it): where it waited, and its own steps.
            tuple(bt["latency_s"][part]["mean"] for part in ("router_queue", "pod_queue", "prefill")),
        )
        rows.append(row)
        dash = "-"
        print(
            f"| {label} | {row[1]:.3f} | {row[2]:.3f} | {row[3]:.2f}x | {row[4]:.1%} | {row[5]} | {row[6]:.0f} "
            f"| {dash if at is None else f'{row[7]:.1%}'} | {dash if at is None else row[8]} "
            f"| {dash if at is None else f'{row[9]:.0f}'} | {1000 * row[10]:.1f} "
            f"| {1000 * sum(row[12]):.0f} = {' + '.join(f'{1000 * t:.0f}' for t in row[12])} | {wall:.0f} |",
            flush=True,
        )
    return rows


# The priority experiment's two classes: a batch job's long questions and answers, a chat's short turns.
# 256 batch requests fit one H100's KV cache, so a pod is full by `max_num_seqs`; one replica finishes ~17
# of them per second (measured: batch alone on one replica, TTFT p50 0.05 s at 16/s, 2.1 s at 18/s).
BATCH = {"name": "batch", "priority": 10, "user_tokens": 800, "output_tokens": 600}
# Long prompts chunked over several steps (max_num_batched_tokens LONG_CHUNK): what a running request's
# chunks do to a more urgent request that arrives meanwhile.
LONG_BATCH = {"name": "batch", "priority": 10, "user_tokens": 4000, "output_tokens": 100}
LONG_CHUNK = 1024
INTERACTIVE = {
    "name": "interactive",
    "priority": -10,
    "system_prompt_tokens": 200,
    "user_tokens": 100,
    "output_tokens": 100,
}


def priority(
    duration: float,
    replicas: int = 8,
    batch_rate: float | None = None,
    interactive_rate: float | None = None,
    seed: int = 0,
) -> list[tuple]:
    """Rows: interactive alone (the idle fleet's TTFT); then, for the router holding each pod to
    `max_num_seqs` (256: the backlog waits in the router, by priority) or to 1,024 (the backlog waits in the
    pods' own queues), batch alone (its throughput: each setting's own, since the pods' balance differs)
    and both, with the pods' scheduler `policy` fcfs and priority (a waiting request preempts running ones
    of a lower priority). Last, the same with the batch's prompts 4,000 tokens long and chunks of 1,024 (at
    10 req/s per replica, which the fleet keeps up with): a long prompt takes several steps, and under
    `priority` its chunks give the budget to a more urgent request first."""
    batch_rate = batch_rate or 28.0 * replicas  # ~1.6x what the fleet finishes: a flood
    interactive_rate = interactive_rate or 2.0 * replicas
    batch = {**BATCH, "rate": batch_rate}
    interactive = {**INTERACTIVE, "rate": interactive_rate}
    print(
        f"{replicas} x H100; batch {batch_rate:g} req/s (priority 10), interactive {interactive_rate:g} req/s "
        f"(priority -10), {duration:g} s"
    )
    print(
        "| run | router in flight / pod | pod policy | interactive TTFT p50 s | interactive TTFT p99 s "
        "| p99 / idle fleet | batch tok/s | batch loss | preemptions / batch request | wall s |"
    )
    print("|" + "---|" * 10)
    rows = []
    idle_p99 = None
    alone_tok: dict[tuple[int, int], float] = {}  # batch alone's tokens/s per (router setting, chunk)
    long_batch = {**LONG_BATCH, "rate": 10.0 * replicas}
    # (label, tenants, router's in-flight bound per pod, pods' policy, max_num_batched_tokens)
    runs = [("interactive alone", [interactive], 256, "fcfs", 8192)]
    for in_flight in (256, 1024):
        runs.append(("batch alone", [batch], in_flight, "fcfs", 8192))
        runs += [
            ("batch + interactive", [batch, interactive], in_flight, p, 8192) for p in ("fcfs", "priority")
        ]
    runs.append(("long batch prompts alone", [long_batch], 1024, "fcfs", LONG_CHUNK))
    runs += [
        ("long batch prompts + interactive", [long_batch, interactive], 1024, p, LONG_CHUNK)
        for p in ("fcfs", "priority")
    ]
    for label, tenants, in_flight, policy, budget in runs:
        r, wall = _sim(
            {
                "model": "llama-3-8b",
                "fleet": {"gpu": "h100-sxm", "replicas": replicas},
                "scheduler": {
                    "max_num_seqs": 256,
                    "max_num_batched_tokens": budget,
                    "max_waiting": 100_000,
                    "policy": policy,
                },
                "routing": {"strategy": "prefix-affinity", "maxInFlightPerEndpoint": in_flight},
                "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
                "breakdown": ["priority"],
                "drain_limit_s": 10,  # the flood's fleet is still busy then: every row runs as long
                "run_until_s": duration + 10,
                "workload": {"duration_s": duration, "tenants": tenants, "length_sigma": 0.3, "seed": seed},
            }
        )
        by = r["by_priority"]
        inter, bat = by.get(str(INTERACTIVE["priority"])), by.get(str(BATCH["priority"]))
        ttft = inter["latency_s"]["ttft"] if inter else None
        if ttft and idle_p99 is None:
            idle_p99 = ttft["p99"]
        key = (in_flight, budget)
        if bat and not inter:
            alone_tok[key] = bat["output_tokens_per_s"]
        row = (
            label,
            in_flight,
            policy,
            ttft["p50"] if ttft else None,
            ttft["p99"] if ttft else None,
            ttft["p99"] / idle_p99 if ttft else None,
            bat["output_tokens_per_s"] if bat else None,
            1 - bat["output_tokens_per_s"] / alone_tok[key] if bat else None,
            bat["preemptions"] / max(bat["requests"]["finished"], 1) if bat else None,
            wall,
        )
        rows.append(row)
        specs = ("d", "s", ".3f", ".3f", ".2f", ".0f", ".1%", ".2f", ".0f")
        cells = [label] + ["-" if x is None else format(x, f) for x, f in zip(row[1:], specs, strict=True)]
        cells[5] += "x" if row[5] is not None else ""
        print("| " + " | ".join(cells) + " |", flush=True)
    return rows


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
    p.add_argument("experiment", choices=["routing", "speed", "disaggregation", "fairness", "priority"])
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--rate", type=float)
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=128, help="speed: mean answer length")
    p.add_argument("--splits", help="disaggregation: prefill pod counts to try, e.g. 4,3,2")
    p.add_argument("--flood", type=float, default=10.0, help="fairness: A's rate over its share")
    p.add_argument("--b-share", type=float, default=1.0, help="fairness: B's rate over its share")
    p.add_argument("--budget", type=int, default=8192, help="fairness: the pods' max_num_batched_tokens")
    args = p.parse_args(argv)
    if args.experiment == "routing":
        print(HEADER)
        print("|" + "---|" * 11)
        routing(args.duration, args.rate or 200.0, args.replicas)
    elif args.experiment == "disaggregation":
        splits = [int(x) for x in args.splits.split(",")] if args.splits else [args.replicas // 2]
        disaggregation(args.duration, args.rate or 60.0, args.replicas, splits)
    elif args.experiment == "fairness":
        fairness(args.duration, args.replicas, args.flood, args.b_share, budget=args.budget)
    elif args.experiment == "priority":
        priority(args.duration, args.replicas, args.rate)  # --rate: the batch flood's
    else:
        speed(args.duration, args.replicas, args.rate or 880.0, args.output_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
