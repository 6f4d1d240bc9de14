"""Fidelity: the calibrated `cpu` profile against real `tokenfleet serve` pods on this machine, same workload.

    python -m tokenfleet.sim.fidelity [--replicas 1,3] [--routings round-robin,prefix-affinity]
                                      [--requests 40] [--rate 0.5] [--cpu-profile PATH] [--verbose]

One seeded JSONL trace (tenants' shared prefixes + unique suffixes, fixed output lengths, Poisson arrivals)
is replayed twice per (replicas, routing): through the real router (in this process) to real pods of the
default model, as completions whose prompts are the trace's exact token ids (`ignore_eos`, `max_tokens` =
the output length, streamed), and through the simulator with the `cpu` profile, the pods' scheduler
defaults and their KV block count. Each (replicas, routing) gets fresh pods and its own token ids, so no run
profits from a cache another warmed. Printed: TTFT p50 and E2E p50 of both, the simulator's error, and
both prefix hit rates (the real one from the pods' usage reports), which tell a routing difference from a
timing one.

The real pods all run on this machine and share its cores, so the simulated fleet does too
(`fleet.cpu_shared_host`: steps stretch while several engines compute at once, by the contention the
served calibration measured).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tokenfleet.sim.real_pod import (
    StreamTiming,
    free_port,
    real_router,
    start_pod,
    stop_pods,
    stream_completion,
    wait_ready,
)


def write_trace(path: Path, n: int, rate: float, tenants: int, prefix: int, suffix: int, out: int, seed: int):
    rng = np.random.Generator(np.random.PCG64(seed))
    t, lines = 0.0, []
    for _ in range(n):
        t += float(rng.exponential(1.0 / rate))
        tenant = int(rng.integers(tenants))
        lines.append(
            json.dumps(
                {
                    "t": round(t, 3),
                    "prefix_group": f"tenant-{tenant}",
                    "prefix_tokens": prefix,
                    "suffix_tokens": suffix,
                    "output_tokens": out,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")


async def real_run(trace: Path, seed: int, replicas: int, routing: str, num_blocks: int, tmp: Path) -> dict:
    import aiohttp
    from tokenfleet.sim.trace import TraceWorkload

    requests = list(TraceWorkload(trace, seed).arrivals())
    ports = [free_port() for _ in range(replicas)]
    procs = [start_pod(tmp, p, num_blocks) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    timeout = aiohttp.ClientTimeout(total=1800)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for url, proc in zip(urls, procs, strict=True):
                await wait_ready(session, url, proc)
            async with real_router(urls, routing) as router:
                records = [StreamTiming() for _ in requests]
                start = time.perf_counter()
                tasks = []
                for rec, sreq in zip(records, requests, strict=True):
                    delay = start + sreq.arrival - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    coro = stream_completion(session, router, sreq.prompt, len(sreq.output), rec)
                    tasks.append(asyncio.create_task(coro))
                await asyncio.gather(*tasks)
    finally:
        stop_pods(procs)
    ok = [r for r in records if r.status == 200 and r.ttft is not None]
    return {
        "ok": len(ok),
        "requests": len(records),
        "ttft_p50": statistics.median(r.ttft for r in ok) if ok else float("nan"),
        "e2e_p50": statistics.median(r.e2e for r in ok) if ok else float("nan"),
        "prefix_hit_rate": sum(r.cached_tokens for r in ok) / max(sum(len(q.prompt) for q in requests), 1),
        "ttfts": [r.ttft for r in records],
    }


def sim_run(
    trace: Path,
    seed: int,
    replicas: int,
    routing: str,
    num_blocks: int,
    profile: Path,
    shared_host: bool = True,
) -> dict:
    from tokenfleet.sim.api import simulate
    from tokenfleet.sim.config import parse_config
    from tokenfleet.sim.model_profile import model_profile

    kv_bytes = num_blocks * 16 * model_profile("smollm2-135m").kv_bytes_per_token
    config = parse_config(
        {
            "model": "smollm2-135m",
            "fleet": {
                "gpu": "cpu",
                "replicas": replicas,
                "cpu_profile": str(profile),
                "cpu_kv_cache_gib": kv_bytes / 2**30,
                "cpu_shared_host": shared_host,  # the real pods all run on this machine
            },
            "scheduler": {},  # the pods' defaults
            "routing": {"strategy": routing},
            "probe_interval_s": 0.5,
            "trace": str(trace),
            "workload": {"seed": seed},
        }
    )
    r = simulate(config)
    return {
        "ttft_p50": r["latency_s"]["ttft"]["p50"],
        "e2e_p50": r["latency_s"]["e2e"]["p50"],
        "prefix_hit_rate": r["cache"]["prefix_hit_rate"],
    }


def main(argv: list[str] | None = None) -> int:
    from tokenfleet.sim.api import DEFAULT_CPU_PROFILE

    p = argparse.ArgumentParser(prog="python -m tokenfleet.sim.fidelity", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="1,3")
    p.add_argument("--routings", default="round-robin,prefix-affinity")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--prefix-tokens", type=int, default=256)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per pod (real and simulated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-profile", type=Path, default=DEFAULT_CPU_PROFILE)
    p.add_argument("--verbose", action="store_true", help="also print each real request's TTFT (stderr)")
    args = p.parse_args(argv)
    if not args.cpu_profile.is_file():
        print(
            f"{args.cpu_profile} does not exist: run `tokenfleet simulate calibrate` first", file=sys.stderr
        )
        return 2
    print(
        "| replicas | routing | real TTFT p50 s | sim TTFT p50 s | error | real E2E p50 s | sim E2E p50 s | error "
        "| prefix hits real / sim |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        trace = tmp / "trace.jsonl"
        write_trace(
            trace,
            args.requests,
            args.rate,
            args.tenants,
            args.prefix_tokens,
            args.suffix_tokens,
            args.output_tokens,
            args.seed,
        )
        run = 0
        for replicas in (int(x) for x in args.replicas.split(",")):
            for routing in args.routings.split(","):
                run += 1
                seed = args.seed + run  # own token ids: no run reuses another's cache
                real = asyncio.run(real_run(trace, seed, replicas, routing, args.num_blocks, tmp))
                sim = sim_run(trace, seed, replicas, routing, args.num_blocks, args.cpu_profile)
                err_t = sim["ttft_p50"] / real["ttft_p50"] - 1
                err_e = sim["e2e_p50"] / real["e2e_p50"] - 1
                print(
                    f"| {replicas} | {routing} | {real['ttft_p50']:.3f} | {sim['ttft_p50']:.3f} | {err_t:+.0%} "
                    f"| {real['e2e_p50']:.3f} | {sim['e2e_p50']:.3f} | {err_e:+.0%} "
                    f"| {real['prefix_hit_rate']:.0%} / {sim['prefix_hit_rate']:.0%} |"
                    + ("" if real["ok"] == real["requests"] else f" ({real['ok']}/{real['requests']} ok)"),
                    flush=True,
                )
                if args.verbose:
                    ttfts = " ".join("-" if t is None else f"{t:.3f}" for t in real["ttfts"])
                    print(f"real TTFTs ({replicas}, {routing}): {ttfts}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
