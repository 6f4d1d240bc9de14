"""Fidelity: the calibrated `cpu` profile against real `tokenfleet serve` pods on this machine, same workload.

    python -m tokenfleet.sim.fidelity [--replicas 1,3] [--routings round-robin,prefix-affinity]
                                      [--requests 16] [--rate 0.5] [--cpu-profile PATH]

One seeded JSONL trace (tenants' shared prefixes + unique suffixes, fixed output lengths, Poisson arrivals)
is replayed twice per (replicas, routing): through the real router (in this process) to real pods of the
default model, as completions whose prompts are the trace's exact token ids (`ignore_eos`, `max_tokens` =
the output length, streamed), and through the simulator with the `cpu` profile, the pods' scheduler
defaults and their KV block count. Each (replicas, routing) gets fresh pods and its own token ids, so no run
profits from a cache another warmed. Printed: TTFT p50 and E2E p50 of both and the simulator's error.

The simulator gives each replica its own hardware; real pods on this machine share its cores, so with more
pods than idle cores the real steps are slower than the profile (timed on one idle engine) says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODEL = "smollm2-135m-instruct"


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


def _start_pod(tmp: Path, port: int, num_blocks: int) -> subprocess.Popen:
    import yaml

    cfg = {
        "model": {"model": MODEL},
        "cache": {"num_blocks": num_blocks},
        "server": {"host": "127.0.0.1", "port": port},
    }
    path = tmp / f"pod-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "tokenfleet.runtime.cli", "serve", "--config", str(path)]
    with open(tmp / f"pod-{port}.log", "w") as log:
        # cwd: never the repo root, whose `operator/` folder would shadow the stdlib module.
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_ready(session, url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pod {url} exited ({proc.returncode}); see its log")
        try:
            async with session.get(url + "/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(1.0)
    raise TimeoutError(f"pod {url} not ready after {timeout} s")


async def _one(session, url: str, sreq, record: dict) -> None:
    body = {
        "model": MODEL,
        "prompt": sreq.prompt,
        "max_tokens": len(sreq.output),
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        record["status"] = r.status
        async for chunk in r.content.iter_any():
            if "ttft" not in record and b'"choices"' in chunk:
                record["ttft"] = time.perf_counter() - t0
    record["e2e"] = time.perf_counter() - t0


async def real_run(trace: Path, seed: int, replicas: int, routing: str, num_blocks: int, tmp: Path) -> dict:
    import aiohttp
    from aiohttp import web
    from tokenfleet.runtime.router.app import ROUTER, build_app
    from tokenfleet.runtime.router.config import RouterConfig
    from tokenfleet.runtime.router.main import load_tokenizer
    from tokenfleet.sim.trace import TraceWorkload

    requests = list(TraceWorkload(trace, seed).arrivals())
    ports = [_free_port() for _ in range(replicas)]
    procs = [_start_pod(tmp, p, num_blocks) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    timeout = aiohttp.ClientTimeout(total=1800)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tokenizer = await asyncio.to_thread(load_tokenizer, MODEL)
            for url, proc in zip(urls, procs, strict=True):
                await _wait_ready(session, url, proc)
            cfg = RouterConfig.model_validate(
                {
                    "port": 0,
                    "backends": [{"name": f"pod{i}", "model": MODEL, "url": u} for i, u in enumerate(urls)],
                    "routing": {
                        "strategy": routing,
                        "retries": {"firstByteTimeoutSeconds": 900, "idleTimeoutSeconds": 900},
                    },
                    "discovery": {"kvEvents": True, "probeIntervalSeconds": 0.5},
                }
            )
            app = build_app(cfg, lambda source: tokenizer)
            runner = web.AppRunner(app)
            await runner.setup()
            port = _free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            router = f"http://127.0.0.1:{port}"
            try:
                await app[ROUTER].tokenizers_loaded()
                fleet = app[ROUTER].fleet
                while not all(fleet.kv_events_live().values()):
                    await asyncio.sleep(0.1)
                records = [{} for _ in requests]
                start = time.perf_counter()
                tasks = []
                for rec, sreq in zip(records, requests, strict=True):
                    delay = start + sreq.arrival - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(_one(session, router, sreq, rec)))
                await asyncio.gather(*tasks)
            finally:
                await runner.cleanup()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    ok = [r for r in records if r.get("status") == 200 and "ttft" in r]
    return {
        "ok": len(ok),
        "requests": len(records),
        "ttft_p50": statistics.median(r["ttft"] for r in ok) if ok else float("nan"),
        "e2e_p50": statistics.median(r["e2e"] for r in ok) if ok else float("nan"),
    }


def sim_run(trace: Path, seed: int, replicas: int, routing: str, num_blocks: int, profile: Path) -> dict:
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
            },
            "scheduler": {},  # the pods' defaults
            "routing": {"strategy": routing},
            "probe_interval_s": 0.5,
            "trace": str(trace),
            "workload": {"seed": seed},
        }
    )
    r = simulate(config)
    return {"ttft_p50": r["latency_s"]["ttft"]["p50"], "e2e_p50": r["latency_s"]["e2e"]["p50"]}


def main(argv: list[str] | None = None) -> int:
    from tokenfleet.sim.api import DEFAULT_CPU_PROFILE

    p = argparse.ArgumentParser(prog="python -m tokenfleet.sim.fidelity", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="1,3")
    p.add_argument("--routings", default="round-robin,prefix-affinity")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--prefix-tokens", type=int, default=256)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per pod (real and simulated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-profile", type=Path, default=DEFAULT_CPU_PROFILE)
    args = p.parse_args(argv)
    if not args.cpu_profile.is_file():
        print(
            f"{args.cpu_profile} does not exist: run `tokenfleet simulate calibrate` first", file=sys.stderr
        )
        return 2
    print(
        "| replicas | routing | real TTFT p50 s | sim TTFT p50 s | error | real E2E p50 s | sim E2E p50 s | error |"
    )
    print("|---|---|---|---|---|---|---|---|")
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
                    f"| {real['e2e_p50']:.3f} | {sim['e2e_p50']:.3f} | {err_e:+.0%} |"
                    + ("" if real["ok"] == real["requests"] else f" ({real['ok']}/{real['requests']} ok)"),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
