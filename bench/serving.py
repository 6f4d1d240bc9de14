"""Serving benchmark: an OpenAI-API load generator in the manner of `vllm bench serve`.

    python bench/serving.py --base-url http://127.0.0.1:8000 --num-prompts 32 --request-rate 4

Requests arrive as a Poisson process at `--request-rate` per second (inf: all at once), optionally capped
at `--max-concurrency` in flight. Prompts are seeded synthetic token-id lists sent to /v1/completions
(exact input lengths whatever the tokenizer): `random` (lengths uniform in input_len * [1-r, 1+r]) or
`shared-prefix` (`--num-prefixes` groups sharing a `--prefix-len` token prefix, which exercises prefix
caching). Output lengths are exact (`ignore_eos`). Every request streams; the report gives request
throughput, output tokens/s, TTFT / TPOT / ITL / E2E mean, p50 and p99, and goodput under an SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def random_dataset(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    rng: random.Random,
    token_range: tuple[int, int],
) -> list[BenchRequest]:
    lo_in, hi_in = max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio)))
    lo_out, hi_out = max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio)))
    return [
        BenchRequest(
            [rng.randrange(*token_range) for _ in range(rng.randint(lo_in, hi_in))],
            rng.randint(lo_out, hi_out),
        )
        for _ in range(n)
    ]


def shared_prefix_dataset(
    n: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    rng: random.Random,
    token_range: tuple[int, int],
) -> list[BenchRequest]:
    prefixes = [[rng.randrange(*token_range) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    out = []
    for i in range(n):
        suffix = [rng.randrange(*token_range) for _ in range(suffix_len)]
        out.append(BenchRequest(prefixes[i % num_prefixes] + suffix, output_len))
    rng.shuffle(out)
    return out


def arrival_delays(n: int, rate: float, rng: random.Random) -> list[float]:
    """Gaps between consecutive arrivals: exponential (a Poisson process), or zero for rate=inf."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.expovariate(rate) for _ in range(n)]


async def send(
    session: aiohttp.ClientSession, url: str, model: str, req: BenchRequest, headers: dict[str, str]
) -> RequestResult:
    body = {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False, prompt_len=len(req.prompt_token_ids))
    start = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = True
    except aiohttp.ClientError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run(args: argparse.Namespace, requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await default_model(session, args.base_url, headers)
        url = args.base_url.rstrip("/") + "/v1/completions"
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        delays = arrival_delays(len(requests), args.request_rate, random.Random(args.seed + 1))

        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                return await send(session, url, model, req, headers)
            async with limit:
                return await send(session, url, model, req, headers)

        start = time.perf_counter()
        tasks = []
        for req, delay in zip(requests, delays, strict=True):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def default_model(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str:
    async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:  # linear interpolation, as numpy's default
        k = (len(ordered) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered) * 1000, "p50": pct(0.5) * 1000, "p99": pct(0.99) * 1000}


def summarize(results: list[RequestResult], duration: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """Figures in ms for latencies, per second for rates; goodput counts requests meeting both SLOs."""
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_len for r in ok)
    good = [
        r for r in ok if r.ttft * 1000 <= slo_ttft_ms and (r.tpot is None or r.tpot * 1000 <= slo_tpot_ms)
    ]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (output + prompt) / duration,
        "goodput": len(good) / duration,
        "ttft_ms": _pcts([r.ttft for r in ok]),
        "tpot_ms": _pcts([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _pcts([g for r in ok for g in r.itl]),
        "e2e_ms": _pcts([r.e2e for r in ok]),
    }


def format_table(s: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> str:
    rows = [
        ("Successful requests", f"{s['completed']}"),
        ("Failed requests", f"{s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
        (f"Goodput (req/s, TTFT<={slo_ttft_ms:g}ms, TPOT<={slo_tpot_ms:g}ms)", f"{s['goodput']:.2f}"),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        for stat in ("mean", "p50", "p99"):
            rows.append(
                (
                    f"{stat.capitalize() if stat == 'mean' else stat.upper()} {name} (ms)",
                    f"{s[key][stat]:.2f}",
                )
            )
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v:>12}" for k, v in rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="default: the first model of /v1/models")
    p.add_argument("--api-key")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson arrivals")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--token-range", type=int, nargs=2, default=(1000, 20000), help="token ids drawn from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds without a byte before giving up")
    p.add_argument("--json", help="also write the figures to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rng = random.Random(args.seed)
    token_range = tuple(args.token_range)
    if args.dataset == "random":
        requests = random_dataset(
            args.num_prompts, args.input_len, args.output_len, args.range_ratio, rng, token_range
        )
    else:
        requests = shared_prefix_dataset(
            args.num_prompts,
            args.num_prefixes,
            args.prefix_len,
            args.input_len,
            args.output_len,
            rng,
            token_range,
        )
    results, duration = asyncio.run(run(args, requests))
    summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "json")}
    print(f"serving benchmark: {json.dumps(config, default=str)}")
    print(format_table(summary, args.slo_ttft_ms, args.slo_tpot_ms))
    for r in results:
        if not r.ok:
            print(f"failed: {r.error}", file=sys.stderr)
            break
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "summary": summary, "results": [asdict(r) for r in results]}, f)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
