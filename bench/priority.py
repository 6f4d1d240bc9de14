"""Priority benchmark: a batch flood saturating two real CPU pods, sparse interactive requests, a router.

    python bench/priority.py [--quick] [--rounds 3] [--flood-concurrency 24] [--interactive 12]
                             [--max-num-seqs 4] [--max-num-batched-tokens 512] [--flood-prompt-tokens 384]
                             [--flood-max-tokens 96]

Four `tokenfleet serve` pods of the built-in model: two on `scheduler.policy: fcfs` (the pods'
`--scheduling-policy fcfs`, the default) behind one router, two on `priority` behind another. Each router runs
least-load with RoutingPolicy `priorityClasses` interactive = -10 and batch = 10, chosen per request by the
`x-priority-class` header, and forwards the number to the pods in `x-tokenfleet-priority`. Its
`maxInFlightPerEndpoint` is far above the offered concurrency, so every request reaches a pod at once and
nothing waits in the router's queue: what is measured is the pods' scheduler, not the router's.

Phases, the same interactive arrival pattern (seeded gaps) in each, and in (b)/(c) the same seeded prompts:
- (a) idle: the interactive requests alone (on the fcfs pods, idle: the policy plays no part);
- (b) flood on the fcfs pods: a closed-loop flood of `flood-concurrency` streams (each sends its next batch
  request when the last ends), well above the pair's 2 x `max-num-seqs` batch slots; the interactive
  requests start once every pod's batch is full and decoding with more waiting (the first wave's prefills
  done). Under fcfs the waiting queue is still ordered by priority, so an interactive request waits at its
  head for a free slot;
- (c) the same on the priority pods: an interactive request preempts the lowest-priority, newest running
  batch request when the batch is full (the victim resumes later by recompute, its cached blocks reused).
The run is `rounds` rounds, each running (a), (b) and (c) in turn (order rotated, one pair busy at a time,
the other idle), each with its share of the interactive requests: load from anything else on the machine
falls on all three phases alike instead of on whichever ran while it lasted. A block ends by cancelling its
flood; the routers here cancel a request's upstream as soon as its client hangs up (see ROUTER_OPTS), and
the next block waits until the pods and routers hold no request.

Figures: interactive TTFT p50/p99 through the router; batch throughput over the windows from the first
interactive arrival to the last interactive finish (completed batch requests/s; output tok/s from the pods'
`generation_tokens_total` less the interactive tokens); preemptions from the pods'
`num_preemptions_total` (one counter for every cause: KV pressure and priority are not told apart); the mean
engine step under the flood (window / the pods' `engine_steps_total`). Target: (c) TTFT p99 <= (a) TTFT p99 +
one step of the flood's largest prefill chunk, min(flood-prompt-tokens, max-num-batched-tokens) tokens. The
pods export no step-time metric, so that step is measured as the TTFT of a prompt of that size sent straight
to an idle pod (it includes the pod's HTTP overhead), twice per round: lone (the other pod idle) and paired
(both pods at once, as they share the CPU under the flood; on a 2-core machine that is the fair one). Prompts
are random token ids, unique per request (no prefix-cache hits between requests); outputs are exactly their
max_tokens (`ignore_eos`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from tokenfleet.sim.real_pod import (
    MODEL,
    StreamTiming,
    free_port,
    real_router,
    start_pod,
    stop_pods,
    stream_completion,
    wait_ready,
)

CLASSES = [
    {"name": "interactive", "priority": -10, "tiers": []},
    {"name": "batch", "priority": 10, "tiers": []},
]
MAX_IN_FLIGHT = 1024  # per endpoint: far above any offered concurrency, so the router never queues
# A block ends by cancelling its flood. With handler cancellation (as `tokenfleet route` runs) the router
# closes the upstream request (the pod aborts it) at once; without it a request cancelled while it waits on
# a pod would be noticed only at its first token, leaving a pod prefilling abandoned requests for tens of
# seconds, into the next block.
STAGGER_S = 3.0  # the flood's streams send their first requests over this many seconds
SATURATE_TIMEOUT_S = 120.0
ROUTER_OPTS = {"kv_events": False, "probe_interval": 0.2, "handler_cancellation": True}
COUNTERS = ("num_preemptions_total", "generation_tokens_total", "engine_steps_total")
GAUGES = ("num_requests_running", "num_requests_waiting")
POLICIES = ("fcfs", "priority")
PHASES = ("idle", "fcfs", "priority")
PROCS: list = []  # every pod this process started, stopped on any exit (error, SIGINT, SIGTERM)

FULL = {
    "flood_concurrency": 24,
    "interactive": 12,
    "interactive_gap": 2.5,
    "flood_max_tokens": 96,
    "warmup": 4.0,
    "rounds": 3,
}
QUICK = {
    "flood_concurrency": 16,
    "interactive": 8,
    "interactive_gap": 2.0,
    "flood_max_tokens": 64,
    "warmup": 4.0,
    "rounds": 2,
}


def prompt_ids(tag: str, n: int) -> list[int]:
    rng = random.Random(tag)
    return [rng.randrange(100, 40000) for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def scrape(session: aiohttp.ClientSession, urls: list[str]) -> list[dict[str, float]]:
    """Per pod: the counters in COUNTERS and the running/waiting gauges (summed over label sets)."""
    out = []
    for url in urls:
        async with session.get(url + "/metrics") as r:
            text = await r.text()
        values = dict.fromkeys((*COUNTERS, *GAUGES), 0.0)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                name = s.name.removeprefix("tokenfleet:")
                if name in values:
                    values[name] += s.value
        out.append(values)
    return out


async def in_flight(session, router: str) -> float:
    """Requests the router counts in flight to its endpoints."""
    async with session.get(router + "/metrics") as r:
        text = await r.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tokenfleet:router_endpoint_in_flight"
    )


async def quiesce(session, urls: list[str], routers: list[str], timeout: float = 120.0) -> None:
    """Wait until no pod runs or holds a request and the routers count none in flight: a block's cancelled
    flood is aborted everywhere before the next block starts."""
    t0 = time.monotonic()
    while True:
        pods = [(v["num_requests_running"], v["num_requests_waiting"]) for v in await scrape(session, urls)]
        flights = [await in_flight(session, r) for r in routers]
        if not any(x for pod in pods for x in pod) and not any(flights):
            break
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(
                f"still busy after {timeout} s: pods (running, waiting) {pods}, routers {flights}"
            )
        await asyncio.sleep(0.2)
    if time.monotonic() - t0 > 1.0:
        print(
            f"  (waited {time.monotonic() - t0:.1f} s for the last block's requests to end)", file=sys.stderr
        )


async def timed(session, url: str, prompt: list[int], max_tokens: int, cls: str | None = None) -> dict:
    t = StreamTiming()
    sent = time.perf_counter()
    headers = {"x-priority-class": cls} if cls else None
    await stream_completion(session, url, prompt, max_tokens, t, headers)
    return {"sent": sent, "done": time.perf_counter(), "status": t.status, "ttft": t.ttft}


@contextlib.asynccontextmanager
async def pod_pairs(session, args, tmp: Path):
    """Two pods per policy, started together, each warmed with one short and one chunk-sized request:
    {policy: [url, url]}. Only one pair works at a time; an idle pod costs no CPU."""
    env = {"OMP_NUM_THREADS": str(args.pod_threads), "MKL_NUM_THREADS": str(args.pod_threads)}
    ports = {policy: [free_port(), free_port()] for policy in POLICIES}
    procs = []
    try:
        for policy, pair in ports.items():
            sched = {
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "policy": policy,
            }
            for port in pair:
                procs.append(start_pod(tmp, port, args.num_blocks, scheduler=sched, env=env))
                PROCS.append(procs[-1])
        print(f"starting 2 fcfs + 2 priority pods (logs in {tmp}) ...", file=sys.stderr)
        urls = [f"http://127.0.0.1:{port}" for pair in ports.values() for port in pair]
        await asyncio.gather(
            *(wait_ready(session, u, p, args.start_timeout) for u, p in zip(urls, procs, strict=True))
        )
        for i, u in enumerate(urls):  # a pod's first requests pay one-off costs
            await timed(session, u, prompt_ids(f"warm-{i}", 16), 2)
            await timed(session, u, prompt_ids(f"warm-chunk-{i}", args.chunk), 1)
        yield {policy: [f"http://127.0.0.1:{port}" for port in pair] for policy, pair in ports.items()}
    finally:
        stop_pods(procs)
        for p in procs:
            PROCS.remove(p)


def interactive_offsets(args) -> list[list[float]]:
    """Per round, the arrival offsets of its interactive requests (seeded gaps; each round starts at 0)."""
    rng = random.Random(f"{args.seed}-arrivals")
    per_round = [
        args.interactive // args.rounds + (r < args.interactive % args.rounds) for r in range(args.rounds)
    ]
    out = []
    for n in per_round:
        t, offsets = 0.0, []
        for _ in range(n):
            offsets.append(t)
            t += args.interactive_gap * rng.uniform(0.5, 1.5)
        out.append(offsets)
    return out


async def interactive(session, router: str, args, tag: str, offsets: list[float]) -> list[dict]:
    start = time.perf_counter()
    tasks = []
    for i, at in enumerate(offsets):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        prompt = prompt_ids(f"{tag}-{i}", args.interactive_prompt_tokens)
        tasks.append(
            asyncio.create_task(timed(session, router, prompt, args.interactive_max_tokens, "interactive"))
        )
    return await asyncio.gather(*tasks)


async def flood_stream(session, router: str, args, tag: str, done: list[dict]) -> None:
    """One closed-loop batch stream: a first request after a seeded stagger, then back to back. Each request
    generates a seeded max_tokens in [flood-max-tokens / 2, flood-max-tokens], except the first, which
    generates 1 .. flood-max-tokens: what is left of a request already under way in a flood that has run for
    a while, so the batch slots free up at spread times from the start, as in a steady flood, instead of
    the whole first wave finishing together."""
    rng = random.Random(tag)
    await asyncio.sleep(rng.uniform(0, STAGGER_S))
    max_tokens = rng.randint(1, args.flood_max_tokens)
    for k in range(10**9):
        prompt = prompt_ids(f"{tag}-{k}", args.flood_prompt_tokens)
        done.append(await timed(session, router, prompt, max_tokens, "batch"))
        max_tokens = rng.randint(max(1, args.flood_max_tokens // 2), args.flood_max_tokens)


async def saturate(session, urls: list[str], args, start: list[dict[str, float]]) -> None:
    """After --warmup s, wait until the flood holds every pod's batch full of decoding requests with more
    waiting: `max_num_seqs` running, a queue, and 4 x `max_num_seqs` tokens generated since the block began
    (the first wave's prefills are done), so the interactive requests meet the flood's steady state."""
    await asyncio.sleep(args.warmup)
    deadline = time.monotonic() + SATURATE_TIMEOUT_S
    while time.monotonic() < deadline:
        now = await scrape(session, urls)
        if all(
            v["num_requests_running"] >= args.max_num_seqs
            and v["num_requests_waiting"] > 0
            and v["generation_tokens_total"] - b["generation_tokens_total"] >= 4 * args.max_num_seqs
            for v, b in zip(now, start, strict=True)
        ):
            return
        await asyncio.sleep(0.25)
    print(f"  (the flood did not saturate the pods in {SATURATE_TIMEOUT_S:.0f} s; going on)", file=sys.stderr)


async def run_block(phase: str, rnd: int, session, router: str, urls: list[str], args, offsets) -> dict:
    """One round's share of a phase: the flood (unless idle), then this round's interactive requests; the
    window runs from the first interactive arrival to the last interactive finish."""
    flood = phase != "idle"
    batch: list[dict] = []
    # (b) and (c) send the same seeded flood and interactive prompts (on different pods); (a) its own.
    tag = f"{args.seed}-{rnd}-{'idle' if not flood else 'flood'}"
    t_start = time.perf_counter()
    start = await scrape(session, urls)
    workers = [
        asyncio.create_task(flood_stream(session, router, args, f"{tag}-batch-{w}", batch))
        for w in range(args.flood_concurrency if flood else 0)
    ]
    try:
        if flood:
            await saturate(session, urls, args, start)
        before = await scrape(session, urls)
        t0 = time.perf_counter()
        inter = await interactive(session, router, args, f"{tag}-interactive", offsets)
        t1 = time.perf_counter()
        after = await scrape(session, urls)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    ok = [r for r in inter if r["status"] == 200 and r["ttft"] is not None]
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in COUNTERS}
    return {
        "warmup_s": t0 - t_start if flood else 0.0,
        "ttfts": [r["ttft"] for r in ok],
        "n": len(inter),
        "window_s": t1 - t0,
        "batch_done": sum(r["status"] == 200 and t0 <= r["done"] <= t1 for r in batch),
        "batch_failed": sum(r["status"] != 200 for r in batch),
        "batch_tokens": delta["generation_tokens_total"] - len(ok) * args.interactive_max_tokens,
        "preemptions": delta["num_preemptions_total"],
        "steps": [
            a["engine_steps_total"] - b["engine_steps_total"] for a, b in zip(after, before, strict=True)
        ],
    }


def summarize(phase: str, blocks: list[dict]) -> dict:
    ttfts = [t for b in blocks for t in b["ttfts"]]
    window = sum(b["window_s"] for b in blocks)
    flood = phase != "idle"
    steps = [sum(b["steps"][i] for b in blocks) for i in range(2)]
    batch_done = sum(b["batch_done"] for b in blocks)
    return {
        "phase": phase,
        "ok": len(ttfts),
        "n": sum(b["n"] for b in blocks),
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p99": pct(ttfts, 0.99),
        "round_p50": [pct(b["ttfts"], 0.5) for b in blocks],
        "ttfts": [[round(t, 3) for t in b["ttfts"]] for b in blocks],  # per round, in arrival order
        "window_s": window,
        "batch_done": batch_done,
        "batch_failed": sum(b["batch_failed"] for b in blocks),
        "batch_req_s": batch_done / window if flood else None,
        "batch_tok_s": sum(b["batch_tokens"] for b in blocks) / window if flood else None,
        "preemptions": sum(b["preemptions"] for b in blocks),
        "step_s": statistics.fmean(window / s for s in steps) if flood and all(steps) else None,
        "warmup_s": statistics.fmean(b["warmup_s"] for b in blocks),
    }


async def chunk_steps(session, urls: list[str], args, rnd: int) -> tuple[list[float], list[float]]:
    """One step of the flood's largest chunk, as TTFTs of prompts of that size sent straight to idle pods:
    lone (one pod computes, the other is idle) and paired (both pods at once, as they share the CPU under
    the flood)."""
    lone = [
        (await timed(session, u, prompt_ids(f"step-{args.seed}-{rnd}-{i}", args.chunk), 1))["ttft"]
        for i, u in enumerate(urls)
    ]
    paired = await asyncio.gather(
        *(
            timed(session, u, prompt_ids(f"pair-{args.seed}-{rnd}-{i}", args.chunk), 1)
            for i, u in enumerate(urls)
        )
    )
    return lone, [r["ttft"] for r in paired]


async def main_async(args) -> tuple[list[dict], dict[str, list[float]]]:
    tmp = Path(tempfile.mkdtemp(prefix="tf-bench-priority-"))
    offsets = interactive_offsets(args)
    routing = {
        "strategy": "least-load",
        "priorityClasses": CLASSES,
        "maxInFlightPerEndpoint": MAX_IN_FLIGHT,
    }
    blocks: dict[str, list[dict]] = {phase: [] for phase in PHASES}
    steps: dict[str, list[float]] = {"lone": [], "paired": []}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)  # the flood's streams must not queue in the client either
    async with (
        aiohttp.ClientSession(timeout=timeout, connector=connector) as session,
        pod_pairs(session, args, tmp) as pairs,
        real_router(pairs["fcfs"], routing, **ROUTER_OPTS) as fcfs_router,
        real_router(pairs["priority"], routing, **ROUTER_OPTS) as prio_router,
    ):
        where = {
            "idle": (fcfs_router, pairs["fcfs"]),
            "fcfs": (fcfs_router, pairs["fcfs"]),
            "priority": (prio_router, pairs["priority"]),
        }
        for rnd in range(args.rounds):
            order = PHASES[rnd % 3 :] + PHASES[: rnd % 3]  # rotated: no phase always runs first
            for phase in order:
                router, urls = where[phase]
                await quiesce(session, pairs["fcfs"] + pairs["priority"], [fcfs_router, prio_router])
                if phase == "idle":
                    lone, paired = await chunk_steps(session, urls, args, rnd)
                    steps["lone"] += lone
                    steps["paired"] += paired
                print(f"round {rnd + 1}/{args.rounds}: {phase} ...", file=sys.stderr)
                blocks[phase].append(await run_block(phase, rnd, session, router, urls, args, offsets[rnd]))
    return [summarize(phase, blocks[phase]) for phase in PHASES], steps


def print_report(results: list[dict], steps: dict[str, list[float]], args, wall: float) -> None:
    idle, fcfs, prio = results
    lone, paired = statistics.median(steps["lone"]), statistics.median(steps["paired"])
    labels = {"idle": "(a) idle", "fcfs": "(b) flood, fcfs", "priority": "(c) flood, priority"}

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = (
        f"{'phase':<22}{'ok':>7}{'TTFT p50':>10}{'TTFT p99':>10}{'batch req/s':>13}{'batch tok/s':>13}"
        f"{'preempt':>9}{'/interactive':>14}{'/batch done':>13}{'step ms':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        flood = r["phase"] != "idle"
        print(
            f"{labels[r['phase']]:<22}{r['ok']:>4}/{r['n']:<2}{r['ttft_p50']:>9.3f}s{r['ttft_p99']:>9.3f}s"
            f"{num(r['batch_req_s'], '.3f'):>13}{num(r['batch_tok_s'], '.1f'):>13}{r['preemptions']:>9.0f}"
            f"{r['preemptions'] / max(r['n'], 1):>14.2f}"
            f"{num(r['preemptions'] / max(r['batch_done'], 1) if flood else None, '.2f'):>13}"
            f"{num(r['step_s'] and r['step_s'] * 1000, '.0f'):>9}"
        )
    for r in results:
        print(f"  {labels[r['phase']]}: TTFT p50 per round " + " ".join(f"{x:.3f}" for x in r["round_p50"]))
    loss_req = 1 - prio["batch_req_s"] / fcfs["batch_req_s"] if fcfs["batch_req_s"] else float("nan")
    loss_tok = 1 - prio["batch_tok_s"] / fcfs["batch_tok_s"] if fcfs["batch_tok_s"] else float("nan")
    print(f"\nbatch throughput lost, (c) vs (b): {loss_req:.1%} of req/s, {loss_tok:.1%} of output tok/s")
    print(
        f"interactive TTFT, (c) vs (b): p50 {prio['ttft_p50'] / fcfs['ttft_p50']:.2f}x, "
        f"p99 {prio['ttft_p99'] / fcfs['ttft_p99']:.2f}x"
    )
    print(
        f"one step of the largest chunk ({args.chunk} tokens), as the TTFT of a {args.chunk}-token prompt straight "
        f"to an idle pod (median of one per pod and round): {lone:.3f} s with the other pod idle, {paired:.3f} s "
        f"with both pods computing one at once (as they share the CPU under the flood)"
    )
    for name, step in (("paired", paired), ("lone", lone)):
        bound = idle["ttft_p99"] + step
        verdict = "met" if prio["ttft_p99"] <= bound else "NOT met"
        print(
            f"target ({name} step): (c) TTFT p99 {prio['ttft_p99']:.3f} s <= (a) idle p99 {idle['ttft_p99']:.3f} s "
            f"+ {step:.3f} s = {bound:.3f} s: {verdict}"
        )
    print(
        f"\nsetup: per policy, 2 CPU pods of {MODEL} ({args.pod_threads} torch thread each) behind one router "
        f"(least-load, maxInFlightPerEndpoint {MAX_IN_FLIGHT}: no request waits in the router; priorityClasses "
        f"interactive=-10 / batch=10 by x-priority-class); pods: max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}, {args.num_blocks} KV blocks"
    )
    print(
        f"rounds: {args.rounds}, each runs (a), (b), (c) in turn (order rotated), one pair of pods busy at a time"
    )
    print(
        f"flood: {args.flood_concurrency} closed-loop streams (vs 2 x {args.max_num_seqs} batch slots), "
        f"{args.flood_prompt_tokens}-token prompts (largest chunk {args.chunk}), "
        f"{max(1, args.flood_max_tokens // 2)}-{args.flood_max_tokens} output tokens, started over "
        f"{STAGGER_S:.0f} s; interactive once every pod's batch is full and decoding (>= {args.warmup:.0f} s; took "
        f"{fcfs['warmup_s']:.1f} s (b), {prio['warmup_s']:.1f} s (c) on average)"
    )
    print(
        f"interactive: {args.interactive} requests per phase, {args.interactive_prompt_tokens}-token prompts, "
        f"{args.interactive_max_tokens} output tokens, gaps {args.interactive_gap} s x U(0.5, 1.5), seed "
        f"{args.seed}; p99 of {args.interactive} samples is their maximum"
    )
    print(
        "preempt: the pods' num_preemptions_total over the windows (every cause; KV pressure and priority are "
        "not told apart); batch tok/s: the pods' generation_tokens_total less the interactive tokens; "
        "step ms: window / the pods' engine_steps_total, mean of the two pods"
    )
    failed = sum(r["batch_failed"] for r in results)
    print(
        f"timings from a shared 2-core CPU box (another session running tests), one run, {wall:.0f} s wall"
        + (f"; {failed} batch requests failed" if failed else "")
    )
    print("json: " + json.dumps({"chunk_steps_s": steps, "results": results}))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"smaller defaults: {QUICK}")
    p.add_argument(
        "--flood-concurrency",
        type=int,
        help=f"closed-loop batch streams (default {FULL['flood_concurrency']})",
    )
    p.add_argument("--interactive", type=int, help=f"interactive requests (default {FULL['interactive']})")
    p.add_argument("--interactive-gap", type=float, help=f"mean gap, s (default {FULL['interactive_gap']})")
    p.add_argument("--flood-max-tokens", type=int, help=f"default {FULL['flood_max_tokens']}")
    p.add_argument(
        "--warmup",
        type=float,
        help=f"least flood seconds before the first interactive (default {FULL['warmup']}); then it waits "
        "until every pod's batch is full and decoding",
    )
    p.add_argument("--rounds", type=int, help=f"interleaved rounds of (a)/(b)/(c) (default {FULL['rounds']})")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--flood-prompt-tokens", type=int, default=384)
    p.add_argument("--interactive-prompt-tokens", type=int, default=32)
    p.add_argument("--interactive-max-tokens", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks per pod")
    p.add_argument("--pod-threads", type=int, default=1, help="torch threads per pod (OMP_NUM_THREADS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 1 <= args.rounds <= args.interactive:
        p.error("--rounds must be between 1 and --interactive")
    args.chunk = min(args.flood_prompt_tokens, args.max_num_batched_tokens)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt  # unwinds like Ctrl-C: every `finally` stops its pods

    signal.signal(signal.SIGTERM, on_term)
    t0 = time.perf_counter()
    try:
        results, steps = asyncio.run(main_async(args))
    except KeyboardInterrupt:
        stop_pods(PROCS)
        print("interrupted; every pod is stopped", file=sys.stderr)
        return 130
    finally:
        stop_pods(PROCS)  # whatever an interrupted unwind (or an error) left running
    print_report(results, steps, args, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
