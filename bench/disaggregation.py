"""Prefill/decode disaggregation benchmark: the same two real CPU runtime pods behind the router, first as two
ordinary pods (aggregated), then as one prefill pod and one decode pod, one run, one table.

    python bench/disaggregation.py [--chats 12] [--longs 4] [--long-tokens 900] [--max-tokens 32] [--rate 1.0]

Workload: short chat turns (streamed, `max-tokens` each) mixed with long-prompt requests (`long-tokens` of
fresh text, 4 generated tokens), Poisson arrivals, the same pattern in both phases; each phase gets its own
fresh prompts (no phase profits from the cache the other warmed). Figures per phase, from the chat turns at
the client, through the router:
- TTFT p50/p99: time to the first streamed text;
- ITL p50/p99: gaps between streamed text chunks (a long prefill on the same pod shows up here);
- KV moved: blocks the decode pod received (the pods' own `kv_transfer_blocks_total`).
On a GPU the point of disaggregation is decode ITL p99 that long prefills no longer stretch; on a shared
2-core CPU both pods compete for the same cores, so this measures the mechanism's cost more than its win.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from tokenfleet.runtime.router.app import ROUTER, build_app
from tokenfleet.runtime.router.config import RouterConfig
from tokenfleet.runtime.router.main import load_tokenizer
from tokenfleet.sim.real_pod import free_port, start_pod, wait_ready

MODEL = "smollm2-135m-instruct"
WORDS = [
    "river",
    "lamp",
    "stone",
    "window",
    "harbor",
    "paper",
    "garden",
    "violin",
    "engine",
    "meadow",
    "copper",
    "lantern",
    "orchard",
]


async def counter(session: aiohttp.ClientSession, url: str, name: str, labels: str = "") -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for m in re.finditer(rf"^tokenfleet:{name}(?:\{{([^}}]*)\}})? ([0-9.e+-]+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def text_of(rng: random.Random, tokenizer, tokens: int, head: str) -> str:
    words: list[str] = []
    text = head
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        words += [rng.choice(WORDS) for _ in range(40)]
        text = head + " ".join(words)
    return text


def _texts(chunk: bytes) -> int:
    n = 0
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                choices = json.loads(line[6:]).get("choices") or [{}]
            except ValueError:
                continue
            if (choices[0].get("delta") or {}).get("content"):
                n += 1
    return n


async def chat(session, url: str, prompt: str, max_tokens: int, record: dict) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    last = None
    gaps: list[float] = []
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        record["status"] = r.status
        async for chunk in r.content.iter_any():
            if not _texts(chunk):
                continue
            now = time.perf_counter()
            if last is None:
                record["ttft"] = now - t0
            else:
                gaps.append(now - last)
            last = now
    record["itl"] = gaps


async def long_prompt(session, url: str, prompt: str, record: dict) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as r:
        record["status"] = r.status
        await r.read()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_phase(name: str, args, urls: list[str], tokenizer, session) -> dict:
    roles = ("both", "both") if name == "aggregated" else ("prefill", "decode")
    cfg = RouterConfig.model_validate(
        {
            "backends": [
                {"name": f"pod{i}", "model": MODEL, "url": u, "role": role}
                for i, (u, role) in enumerate(zip(urls, roles, strict=True))
            ],
            "routing": {"strategy": "least-load"},
            "discovery": {"probeIntervalSeconds": 0.2},
        }
    )
    app = build_app(cfg, lambda source: tokenizer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    router = f"http://127.0.0.1:{port}"
    await app[ROUTER].tokenizers_loaded()
    await asyncio.sleep(0.5)
    rng = random.Random(f"{args.seed}-{name}")  # fresh prompts per phase, same arrival pattern
    arrivals = random.Random(args.seed)
    kinds = ["chat"] * args.chats + ["long"] * args.longs
    arrivals.shuffle(kinds)
    moved0 = await counter(session, urls[1], "kv_transfer_blocks_total", 'direction="received"')
    records: list[dict] = []
    tasks = []
    t = 0.0
    start = time.perf_counter()
    for i, kind in enumerate(kinds):
        t += arrivals.expovariate(args.rate)
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        rec = {"kind": kind}
        records.append(rec)
        if kind == "chat":
            prompt = f"Chat {i}: " + text_of(rng, tokenizer, 40, "Say something kind about ")
            tasks.append(asyncio.create_task(chat(session, router, prompt, args.max_tokens, rec)))
        else:
            prompt = text_of(rng, tokenizer, args.long_tokens, f"Document {i}: ")
            tasks.append(asyncio.create_task(long_prompt(session, router, prompt, rec)))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    await runner.cleanup()
    moved = await counter(session, urls[1], "kv_transfer_blocks_total", 'direction="received"') - moved0
    chats = [r for r in records if r["kind"] == "chat" and r.get("status") == 200 and "ttft" in r]
    ttft = [r["ttft"] for r in chats]
    itl = [g for r in chats for g in r["itl"]]
    return {
        "phase": name,
        "ok": sum(r.get("status") == 200 for r in records),
        "n": len(records),
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "itl_p50": pct(itl, 0.5),
        "itl_p99": pct(itl, 0.99),
        "itl_mean": statistics.fmean(itl) if itl else float("nan"),
        "kv_blocks_moved": moved,
        "wall_s": wall,
    }


async def main_async(args) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-disagg-"))
    ports = [free_port(), free_port()]
    procs = [start_pod(tmp, p, 512) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await asyncio.gather(*(wait_ready(session, u, p, 600) for u, p in zip(urls, procs, strict=True)))
            tokenizer = load_tokenizer(MODEL)
            return [
                await run_phase(name, args, urls, tokenizer, session)
                for name in ("aggregated", "disaggregated")
            ]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def print_table(results: list[dict], args) -> None:
    print(
        f"2 CPU pods, {args.chats} chat turns ({args.max_tokens} tokens, streamed) + {args.longs} long prompts "
        f"(~{args.long_tokens} tokens), Poisson {args.rate}/s, seed {args.seed}"
    )
    print(
        f"{'phase':<15}{'ok':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'KV blocks':>10}{'wall s':>8}"
    )
    for r in results:
        print(
            f"{r['phase']:<15}{r['ok']:>3}/{r['n']:<2}{r['ttft_p50']:>10.3f}{r['ttft_p99']:>10.3f}"
            f"{r['itl_p50']:>9.3f}{r['itl_p99']:>9.3f}{r['kv_blocks_moved']:>10.0f}{r['wall_s']:>8.1f}"
        )
    agg, dis = results
    print(
        f"disaggregated / aggregated: TTFT p50 {dis['ttft_p50'] / agg['ttft_p50']:.2f}x, "
        f"ITL p99 {dis['itl_p99'] / agg['itl_p99']:.2f}x"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chats", type=int, default=12)
    p.add_argument("--longs", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=900)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print_table(asyncio.run(main_async(args)), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
