"""`tokenfleet simulate <run|plan|calibrate>`.

    tokenfleet simulate run --model 8b --gpu h100 --replicas 4 --rate 20 --duration 300 --json out.json --png out.png
    tokenfleet simulate run --config fleet.yaml
    tokenfleet simulate run --model 8b --gpu h100 --replicas 8 --prefill-replicas 3 --rate 60
    tokenfleet simulate plan --model 70b --rate 30 --slo-ttft 2 --slo-tpot 0.05 --gpus h100,h200,a100 --tp 1,2,4,8
    tokenfleet simulate calibrate [--out PATH] [--via server|engine]

Flags override the `--config` file. Bad input exits with status 2 and one line naming the field.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from tokenfleet.sim.errors import SimInputError

WORKLOAD_FLAGS = {
    "rate": "rate",
    "duration": "duration_s",
    "arrival": "arrival",
    "burstiness": "burstiness",
    "tenants": "num_tenants",
    "system_tokens": "system_prompt_tokens",
    "user_tokens": "user_tokens",
    "output_tokens": "output_tokens",
    "sessions": "session_fraction",
    "seed": "seed",
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML/JSON simulation config (flags override it)")
    p.add_argument(
        "--model", help="preset (8b, 70b, moe, llama-3-8b, ...), HF config.json / directory, or .gguf"
    )
    p.add_argument("--routing", help="round-robin | least-load | prefix-affinity | session-affinity")
    p.add_argument("--trace", type=Path, help="JSONL trace to replay (see docs/simulator.md)")
    p.add_argument("--slo-ttft", type=float, help="TTFT p99 bound, seconds")
    p.add_argument("--slo-tpot", type=float, help="TPOT p99 bound, seconds")
    p.add_argument("--weights", choices=["bfloat16", "fp8"])
    p.add_argument("--kv-cache", choices=["bfloat16", "fp8"])
    p.add_argument("--rate", type=float, help="arrivals per second")
    p.add_argument("--duration", type=float, help="seconds of arrivals")
    p.add_argument("--arrival", choices=["poisson", "gamma", "diurnal"])
    p.add_argument("--burstiness", type=float)
    p.add_argument("--tenants", type=int)
    p.add_argument("--system-tokens", type=int)
    p.add_argument("--user-tokens", type=int)
    p.add_argument("--output-tokens", type=int)
    p.add_argument("--sessions", type=float, help="fraction of arrivals that open a multi-turn session")
    p.add_argument("--seed", type=int)


def _config(args: argparse.Namespace, fleet: dict | None = None, extra: dict | None = None):
    import yaml
    from tokenfleet.sim.config import parse_config

    data: dict = {}
    if args.config is not None:
        try:
            data = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise SimInputError("config", f"cannot read {args.config}: {e}") from None
        if not isinstance(data, dict):
            raise SimInputError("config", "expected a mapping at the top level")
    if args.model:
        data["model"] = args.model
    if args.trace:
        data["trace"] = str(args.trace)
    if args.routing:
        data.setdefault("routing", {})["strategy"] = args.routing
    for flag, key in (("slo_ttft", "ttft_s"), ("slo_tpot", "tpot_s")):
        if getattr(args, flag) is not None:
            data.setdefault("slo", {})[key] = getattr(args, flag)
    for flag, key in WORKLOAD_FLAGS.items():
        if getattr(args, flag) is not None:
            data.setdefault("workload", {})[key] = getattr(args, flag)
    fleet_data = data.setdefault("fleet", {})
    for flag in ("weights", "kv_cache"):
        if getattr(args, flag) is not None:
            fleet_data[flag] = getattr(args, flag)
    fleet_data.update(fleet or {})
    for key, value in (extra or {}).items():
        data[key] = {**(data.get(key) or {}), **value}
    return parse_config(data)


def _run(args: argparse.Namespace) -> int:
    from tokenfleet.sim.api import simulate
    from tokenfleet.sim.plot import timeline_png
    from tokenfleet.sim.results import table, to_json

    fleet = {
        k: v for k, v in (("gpu", args.gpu), ("tp", args.tp), ("replicas", args.replicas)) if v is not None
    }
    if args.cpu_profile:
        fleet["cpu_profile"] = str(args.cpu_profile)
    extra = {}
    if args.prefill_replicas:
        extra["disaggregation"] = {"prefill_replicas": args.prefill_replicas}
    config = _config(args, fleet, extra)
    t0 = time.perf_counter()
    results = simulate(config)
    wall = time.perf_counter() - t0
    print(table(results))
    print(f"wall clock    {wall:.1f} s ({results['virtual_seconds'] / max(wall, 1e-9):.0f}x real time)")
    if args.json:
        args.json.write_text(to_json(results) + "\n")
        print(f"json          {args.json}")
    if args.png:
        timeline_png(results, args.png)
        print(f"timeline      {args.png}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from tokenfleet.sim.plan import format_candidates, plan

    config = _config(args)
    gpus = [g for g in args.gpus.split(",") if g]
    try:
        tps = [int(t) for t in args.tp.split(",") if t]
    except ValueError:
        raise SimInputError("tp", f"expected a comma-separated list of integers, got {args.tp!r}") from None
    routings = [r for r in (args.routings or config.routing.strategy).split(",") if r]
    from tokenfleet.runtime.router.scoring import STRATEGIES

    for r in routings:
        if r not in STRATEGIES:
            raise SimInputError("routings", f"unknown strategy {r!r}", STRATEGIES)
    if args.jobs < 0:
        raise SimInputError("jobs", f"expected 0 (every usable core) or a positive count, got {args.jobs}")
    jobs = args.jobs or len(os.sched_getaffinity(0))
    feasible, closest, skipped = plan(config, gpus, tps, routings, args.max_replicas, args.top, jobs=jobs)
    for line in skipped:
        print(f"skipped {line}")
    if feasible:
        print(
            format_candidates(
                f"cheapest fleets meeting TTFT p99 <= {config.slo.ttft_s} s, TPOT p99 <= {config.slo.tpot_s} s:",
                feasible,
            )
        )
        return 0
    print(f"no fleet of up to {args.max_replicas} replicas meets the SLO.")
    print(format_candidates("closest candidates (at the most replicas tried):", closest))
    return 1


def _calibrate(args: argparse.Namespace) -> int:
    from tokenfleet.sim.api import DEFAULT_CPU_PROFILE
    from tokenfleet.sim.calibrate import calibrate

    calibrate(args.out or DEFAULT_CPU_PROFILE, args.decode_steps, args.via)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenfleet simulate", description="fleet simulator and capacity planner"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate one fleet")
    _common(run)
    run.add_argument("--gpu", help="h100-sxm | h200 | a100-80gb | l4 | cpu")
    run.add_argument("--tp", type=int)
    run.add_argument("--replicas", type=int)
    run.add_argument("--cpu-profile", type=Path)
    run.add_argument(
        "--prefill-replicas",
        type=int,
        help="disaggregate: this many of --replicas run prompts, the rest decode",
    )
    run.add_argument("--json", type=Path, help="write the results here (byte-identical for the same seed)")
    run.add_argument("--png", type=Path, help="write the timeline plot here")
    plan = sub.add_parser("plan", help="search the cheapest fleets that meet the SLO")
    _common(plan)
    plan.add_argument("--gpus", default="h100-sxm,h200,a100-80gb,l4")
    plan.add_argument("--tp", default="1,2,4,8")
    plan.add_argument("--routings", help="comma-separated strategies to try (default: the config's)")
    plan.add_argument("--max-replicas", type=int, default=16)
    plan.add_argument("--top", type=int, default=5)
    plan.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="candidates searched at once, one process each (0: every usable core)",
    )
    cal = sub.add_parser("calibrate", help="time the real engine here and fit the cpu profile")
    cal.add_argument("--out", type=Path)
    cal.add_argument("--decode-steps", type=int, default=6)
    cal.add_argument(
        "--via",
        choices=["server", "engine"],
        default="server",
        help="time steps through a real served pod (what clients see) or the bare engine in this process",
    )
    args = parser.parse_args(argv)
    try:
        return {"run": _run, "plan": _plan, "calibrate": _calibrate}[args.command](args)
    except SimInputError as e:
        print(f"tokenfleet simulate: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
