"""Routing benchmark: N real CPU runtime pods behind the router, four strategies, one run, one table.

    python bench/routing.py [--replicas 3] [--tenants 6] [--zipf 1.0] [--system-tokens 1000] [--requests 30]
                            [--rate R | --utilization 0.6] [--model-path PATH] [--pod-keys]

--model-path serves a model that is not built in (an HF directory or a .gguf file): the routers then have
no tokenizer of their own and must learn it from the pods (GET /v1/tokenizer). --pod-keys runs the
deployment as it is secured: pods with a client key and the internal key, routers asking clients for the
client key and calling pods with the internal key. The "-x2" strategies run two router replicas
(active-active) and send every other request to each.

Workload: `tenants` system prompts of about `system-tokens` tokens, many short user turns, Poisson arrivals;
tenant k is picked with weight 1/(k+1)^zipf (uneven tenants: the first has several times the traffic of the
last; --zipf 0 = uniform). Each strategy gets its own fresh system prompts (so no strategy profits from the
cache another one warmed) and the same arrival pattern. Strategies: round-robin, least-load, prefix
affinity with the exact (KV-event) index and no work bound ("prefix-exact"), the same with the work bound
that keeps max/min load near 1.4 ("prefix-balanced", the default policy), and optionally the approximate
index ("prefix-approx"). Figures per strategy:
- prefix hit rate: the pods' own `prefix_cache_hits_total / prefix_cache_queries_total` over the run;
- TTFT p50/p99: time to the first streamed chunk, at the client, through the router;
- throughput: completed requests per second of wall time;
- max/min load: most over fewest requests served per pod.
Target: exact prefix-affinity TTFT p50 <= 0.5x round-robin with max/min load <= 1.5.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
from tokenfleet.runtime.router.main import load_tokenizer
from tokenfleet.sim.real_pod import free_port, real_router, start_pod, wait_ready

MODEL = "smollm2-135m-instruct"
WORDS = [
    "policy",
    "account",
    "invoice",
    "shipping",
    "refund",
    "warranty",
    "customer",
    "order",
    "product",
    "delivery",
    "support",
    "billing",
    "address",
    "payment",
    "subscription",
    "upgrade",
    "password",
    "security",
    "privacy",
    "contract",
    "service",
    "region",
    "language",
    "schedule",
    "priority",
    "escalation",
    "ticket",
    "manager",
    "agent",
    "response",
    "summary",
    "detail",
    "example",
]

# name -> (routing spec, follow the pods' KV events, router replicas)
STRATEGIES = {
    "round-robin": ({"strategy": "round-robin"}, False, 1),
    "least-load": ({"strategy": "least-load"}, False, 1),
    "prefix-exact": ({"strategy": "prefix-affinity", "balance": {"maxRatio": None}}, True, 1),
    "prefix-balanced": ({"strategy": "prefix-affinity"}, True, 1),
    "prefix-approx": ({"strategy": "prefix-affinity"}, False, 1),
    "prefix-exact-x2": ({"strategy": "prefix-affinity", "balance": {"maxRatio": None}}, True, 2),
    "prefix-balanced-x2": ({"strategy": "prefix-affinity"}, True, 2),
}
CLIENT_KEY = "bench-client-key"
INTERNAL_KEY = "bench-internal-key"
DEFAULT_STRATEGIES = ["round-robin", "least-load", "prefix-exact", "prefix-balanced"]


async def pod_counters(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()

    def value(name: str) -> float:
        m = re.search(rf"^tokenfleet:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return value("prefix_cache_hits_total"), value("prefix_cache_queries_total")


def system_prompt(rng: random.Random, tokenizer, target_tokens: int) -> str:
    words: list[str] = []
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < target_tokens:
        words += [rng.choice(WORDS) for _ in range(50)]
        text = "You are a support assistant. Rules: " + " ".join(words)
    return text


def _has_text(chunk: bytes) -> bool:
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                choices = json.loads(line[6:]).get("choices") or [{}]
            except ValueError:
                continue
            if (choices[0].get("delta") or {}).get("content"):
                return True
    return False


async def one_request(session, url, system, user, max_tokens, record, model: str = MODEL) -> None:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        record["endpoint"] = r.headers.get("x-tokenfleet-endpoint")
        record["status"] = r.status
        async for chunk in r.content.iter_any():
            # TTFT = the first generated text, not the role-only chunk a chat stream opens with.
            if "ttft" not in record and _has_text(chunk):
                record["ttft"] = time.perf_counter() - t0
    record["e2e"] = time.perf_counter() - t0


def router_options(args) -> dict:
    """How the routers are set up for this run (a model that is not built in; keys)."""
    opts: dict = {"model": args.served_name, "local_tokenizer": args.model_path is None}
    if args.pod_keys:
        opts |= {"backend": {"internalKeyFile": str(args.internal_key_file)}, "api_keys": [CLIENT_KEY]}
    return opts


async def run_strategy(name, args, pod_urls, tokenizer, arrivals, session) -> dict:
    routing, kv_events, replicas = STRATEGIES[name]
    async with contextlib.AsyncExitStack() as stack:
        routers = [
            await stack.enter_async_context(
                real_router(pod_urls, routing, kv_events, probe_interval=0.2, **router_options(args))
            )
            for _ in range(replicas)
        ]
        rng = random.Random(f"{args.seed}-{name}")
        systems = [system_prompt(rng, tokenizer, args.system_tokens) for _ in range(args.tenants)]
        before = [await pod_counters(session, u) for u in pod_urls]
        records: list[dict] = [{} for _ in arrivals]
        start = time.perf_counter()
        tasks = []
        for i, (rec, (at, tenant, user)) in enumerate(zip(records, arrivals, strict=True)):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            url = routers[i % replicas]  # active-active: the replicas take turns
            tasks.append(
                asyncio.create_task(
                    one_request(session, url, systems[tenant], user, args.max_tokens, rec, args.served_name)
                )
            )
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        after = [await pod_counters(session, u) for u in pod_urls]
    ok = [r for r in records if r.get("status") == 200 and "ttft" in r]
    ttfts = sorted(r["ttft"] for r in ok)
    per_pod = Counter(r["endpoint"] for r in ok)
    counts = [per_pod.get(u, 0) for u in pod_urls]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return {
        "strategy": name,
        "ok": len(ok),
        "requests": len(records),
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50": statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan"),
        "throughput": len(ok) / wall,
        "load_ratio": max(counts) / max(min(counts), 1),
        "per_pod": counts,
    }


async def miss_capacity(session, urls, tokenizer, args) -> float:
    """Cold prompts per second this machine serves with every pod busy: one fresh system prompt per pod, all
    at once, straight to the pods. Offered load is set from it (--utilization), so the comparison runs below
    saturation on any machine; past it, every strategy's TTFT is just its position in an ever-growing queue."""
    warm: list[dict] = [{} for _ in urls]  # a pod's first request pays one-off start-up costs
    await asyncio.gather(
        *(
            one_request(session, u, "Hi.", "Hi?", 1, r, args.served_name)
            for u, r in zip(urls, warm, strict=True)
        )
    )
    rng = random.Random(f"{args.seed}-calibration")
    systems = [system_prompt(rng, tokenizer, args.system_tokens) for _ in urls]
    records: list[dict] = [{} for _ in urls]
    t0 = time.perf_counter()
    await asyncio.gather(
        *(
            one_request(session, u, s, "Hello?", args.max_tokens, r, args.served_name)
            for u, s, r in zip(urls, systems, records, strict=True)
        )
    )
    wall = time.perf_counter() - t0
    if any(r.get("status") != 200 for r in records):
        raise RuntimeError(f"calibration requests failed: {[r.get('status') for r in records]}")
    return len(urls) / wall


def make_arrivals(args) -> list[tuple[float, int, str]]:
    rng = random.Random(args.seed)
    weights = [1.0 / (k + 1) ** args.zipf for k in range(args.tenants)]
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        tenant = rng.choices(range(args.tenants), weights)[0]
        out.append((t, tenant, f"Question {i}: " + " ".join(rng.choices(WORDS, k=6)) + "?"))
    return out


async def main_async(args) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="tf-bench-routing-"))
    ports = [free_port() for _ in range(args.replicas)]
    model = {"model": args.model_path, "served_name": args.served_name} if args.model_path else None
    server = None
    headers = {}
    if args.pod_keys:
        args.internal_key_file = tmp / "internal-key"
        args.internal_key_file.write_text(INTERNAL_KEY + "\n")
        server = {"api_keys": [CLIENT_KEY], "internal_api_key_file": str(args.internal_key_file)}
        headers = {"Authorization": f"Bearer {CLIENT_KEY}"}  # the client's key: routers and pods take it
    procs = [start_pod(tmp, p, args.num_blocks, model=model, server=server) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        timeout = aiohttp.ClientTimeout(total=args.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            print(f"starting {args.replicas} pods (logs in {tmp}) ...", file=sys.stderr)
            # The bench's own tokenizer only sizes the system prompts; the routers get theirs from the pods.
            tokenizer_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, args.model_path or MODEL))
            await asyncio.gather(
                *(wait_ready(session, u, p, args.start_timeout) for u, p in zip(urls, procs, strict=True))
            )
            tokenizer = await tokenizer_task
            if args.rate is None:
                capacity = await miss_capacity(session, urls, tokenizer, args)
                args.rate = args.utilization * capacity
                print(f"capacity {capacity:.2f} cold prompts/s -> rate {args.rate:.2f}/s", file=sys.stderr)
            arrivals = make_arrivals(args)
            results = []
            for name in args.strategies:
                print(f"running {name} ...", file=sys.stderr)
                results.append(await run_strategy(name, args, urls, tokenizer, arrivals, session))
            return results
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def print_table(results: list[dict], args) -> None:
    head = f"{'strategy':<20}{'ok':>7}{'hit rate':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'req/s':>8}{'max/min':>9}  per pod"
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['strategy']:<20}{r['ok']:>4}/{r['requests']:<2}{r['hit_rate']:>10.1%}{r['ttft_p50']:>9.2f}s"
            f"{r['ttft_p99']:>9.2f}s{r['throughput']:>8.2f}{r['load_ratio']:>9.2f}  {r['per_pod']}"
        )
    by = {r["strategy"]: r for r in results}
    for name in ("prefix-exact", "prefix-balanced"):
        if name in by and f"{name}-x2" in by:
            print(f"\n{name}: hit rate with two routers (active-active) {by[f'{name}-x2']['hit_rate']:.1%} "
                  f"vs one router {by[name]['hit_rate']:.1%}")  # fmt: skip
        if "round-robin" in by and name in by:
            ratio = by[name]["ttft_p50"] / by["round-robin"]["ttft_p50"]
            lr = by[name]["load_ratio"]
            verdict = "met" if ratio <= 0.5 and lr <= 1.5 else "NOT met"
            print(f"\n{name}: TTFT p50 = {ratio:.2f}x round-robin, max/min load {lr:.2f} "
                  f"(target <= 0.5x and <= 1.5: {verdict})")  # fmt: skip
    keys = ", client + internal keys on" if args.pod_keys else ""
    print(f"\nsetup: {args.replicas} CPU pods of {args.model_path or MODEL}{keys}, {args.tenants} tenants (zipf {args.zipf}) x "
          f"~{args.system_tokens}-token system prompts, {args.requests} requests at {args.rate:.2f}/s Poisson, "
          f"max_tokens {args.max_tokens}")  # fmt: skip
    print("json: " + json.dumps(results))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--zipf", type=float, default=1.0, help="tenant k has weight 1/(k+1)^zipf; 0 = uniform")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument(
        "--rate", type=float, default=None, help="Poisson arrivals per second (default: from --utilization)"
    )
    p.add_argument(
        "--utilization",
        type=float,
        default=0.6,
        help="offered load as a fraction of the measured cold-prompt capacity (used when --rate is unset)",
    )
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=768, help="KV blocks per pod")
    p.add_argument("--strategies", nargs="+", default=DEFAULT_STRATEGIES, choices=list(STRATEGIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument(
        "--model-path",
        default=None,
        help="serve this model (an HF directory or a .gguf file) instead of the built-in one; routers learn "
        "its tokenizer from the pods",
    )
    p.add_argument("--pod-keys", action="store_true", help="client keys and the internal key on")
    args = p.parse_args(argv)
    args.served_name = "bench-model" if args.model_path else MODEL
    args.internal_key_file = None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print_table(asyncio.run(main_async(args)), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
