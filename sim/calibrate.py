"""`tokenfleet simulate calibrate`: time the real engine on this machine and fit the `cpu` step-cost profile.

Two ways to time it:

- through served pods (`via="server"`, the default): real `tokenfleet serve` processes of the default
  model, the first behind the real router, timed by a streaming client as the fidelity harness and any
  user sees them. A fresh prompt of P tokens on an idle pod is one prefill step (its time to first
  token); so is a prompt whose first tokens are cached (the prefix of a tenant, a session's earlier
  turns), which still reads that context; B streams started together decode in lock step, B tokens per
  step at known contexts (the gaps between their events once all have begun). What serving adds to every
  step (the pod's event loop sharing the GIL and the cores with its engine thread) is then in the
  profile, and what it adds per request (the hops, validation, the first event's way back) is fitted
  apart. Last, the same prefill and the same decode batch on one pod alone and on two at once measure
  how much engines on this host slow each other (`CoreUsage`, for `fleet.cpu_shared_host`).
- the bare engine (`via="engine"`): `EngineCore.step()` in this process, each step timed alone (the
  shape read from the scheduler's running requests before each step). Faster than a served pod; the
  lower bound of what serving costs here.

Each timed step is a row (features, seconds); a non-negative least-squares fit over [1, tokens, sequences,
attention work, context read, first token] gives the `LinearCost` (the last feature, 1 on
time-to-first-token rows, fits the request's overhead outside the steps). The fit's relative error on its
own rows is printed so a bad fit is visible.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tokenfleet.sim.cost_model import BatchShape, CoreUsage, LinearCost
from tokenfleet.sim.model_profile import model_profile

PREFILLS = (32, 128, 384, 768)
# (cached prefix, new tokens): the prompt of a tenant or a session's next turn, whose prefix is cached.
PREFIX_HITS = ((256, 16), (1024, 32), (2048, 64))
DECODES = ((1, 48), (2, 48), (3, 48), (4, 48), (12, 48), (24, 48), (6, 600))
# Steps of this few tokens get their own measured excess over the fit (LinearCost.small_batch_extra_s):
# on a CPU two and three rows cost about twice and three times one, four rows less than three.
SMALL_BATCH_TOKENS = (2, 3)


class Timed(NamedTuple):
    shape: BatchShape
    seconds: float
    first_token: bool = False  # a client's time to first token: the request's overhead + the step


def _features(s: BatchShape, first_token: bool) -> list[float]:
    return [1.0, s.num_tokens, s.num_seqs, s.attn_work, s.kv_read_tokens, 1.0 if first_token else 0.0]


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0 (Lawson-Hanson active set), on columns scaled to one magnitude: the
    features span ten decades (a constant 1 beside attention work of ~1e6), which leaves a plain least
    squares solve badly conditioned."""
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max() * np.abs(b).max()))
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        if passive.all() or (gradient[~passive] <= tol).all():
            break
        passive[int(np.argmax(np.where(passive, -np.inf, gradient)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step toward z until a coefficient reaches zero; it leaves the passive set.
            neg = passive & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x / scale


def measure(decode_steps: int = 6, log=print) -> list[Timed]:
    from tokenfleet.runtime.config import RuntimeConfig, SchedulerConfig
    from tokenfleet.runtime.engine.engine_core import EngineCore
    from tokenfleet.runtime.engine.sampling_params import SamplingParams

    config = RuntimeConfig(scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048))
    t0 = time.perf_counter()
    core = EngineCore(config)
    log(f"loaded {core.model_name} in {time.perf_counter() - t0:.1f} s")
    rng = np.random.Generator(np.random.PCG64(0))
    rows: list[Timed] = []
    ids = iter(range(10**9))

    def add(n_prompt: int, max_tokens: int) -> None:
        prompt = rng.integers(100, 30000, size=n_prompt).tolist()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        core.add_request(f"cal-{next(ids)}", prompt, params)

    def drain() -> None:
        while core.has_unfinished():
            core.step()

    add(16, 2)  # warm-up: first calls allocate
    drain()
    for p in PREFILLS:
        add(p, 1)
        t = time.perf_counter()
        core.step()
        rows.append(Timed(BatchShape(p, 1, 1, p * (p + 1) / 2, p), time.perf_counter() - t))
        drain()
        log(f"prefill {p:5d} tokens: {rows[-1].seconds * 1000:7.1f} ms")
    for batch, p in DECODES:
        for _ in range(batch):
            add(p, decode_steps + 2)
        sched = core.scheduler
        while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
            core.step()
        times = []
        for _ in range(decode_steps):
            running = list(sched.running)
            if len(running) != batch or any(r.num_computed_tokens != r.num_tokens - 1 for r in running):
                break
            ctx = [r.num_computed_tokens + 1 for r in running]
            shape = BatchShape(batch, batch, batch, float(sum(ctx)), sum(ctx))
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
            rows.append(Timed(shape, times[-1]))
        drain()
        log(f"decode  batch {batch:3d} at ~{p} ctx: {np.median(times) * 1000:7.1f} ms/step")
    return rows


def measure_served(decode_tokens: int = 12, log=print) -> tuple[list[Timed], CoreUsage]:
    """The same steps as `measure`, through real `tokenfleet serve` pods, timed by a streaming client;
    also how much two engines on this host slow each other."""
    return asyncio.run(_measure_served(decode_tokens, log))


async def _decode_step(session, url: str, prompts: list[list[int]], num_tokens: int) -> float:
    """Median time per step of streams started together that decode in lock step (seconds)."""
    from tokenfleet.sim.real_pod import StreamTiming, stream_completion

    timings = [StreamTiming() for _ in prompts]
    await asyncio.gather(
        *(stream_completion(session, url, p, num_tokens, t) for p, t in zip(prompts, timings, strict=True))
    )
    if any(t.status != 200 or len(t.token_times) < 2 for t in timings):
        raise RuntimeError("calibration stream failed or sent fewer than two events")
    # The prompts' chunks interleave with the first streams' decodes: only gaps after every stream has
    # its first token are pure decode steps of the whole batch. A token whose text is held back sends no
    # event (a double gap): the median ignores it.
    begin = max(t.token_times[0] for t in timings)
    gaps = [b - a for t in timings for a, b in itertools.pairwise(t.token_times) if a >= begin]
    if not gaps:
        raise RuntimeError("calibration streams never decoded together")
    return float(np.median(gaps))


async def _ttft(session, url: str, prompt: list[int]) -> float:
    from tokenfleet.sim.real_pod import StreamTiming, stream_completion

    timing = StreamTiming()
    await stream_completion(session, url, prompt, 1, timing)
    if timing.status != 200 or timing.ttft is None:
        raise RuntimeError(f"calibration request failed: HTTP {timing.status}")
    return timing.ttft


async def _measure_served(decode_tokens: int, log) -> tuple[list[Timed], CoreUsage]:
    import tempfile

    import aiohttp
    from tokenfleet.sim.real_pod import free_port, real_router, start_pod, stop_pods, wait_ready

    rng = np.random.Generator(np.random.PCG64(0))
    rows: list[Timed] = []

    def prompt(n: int) -> list[int]:
        return rng.integers(100, 30000, size=n).tolist()  # fresh ids: never a prefix-cache hit

    with tempfile.TemporaryDirectory() as tmp_name:
        ports = [free_port(), free_port()]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        t0 = time.perf_counter()
        # The second pod idles until the contention measurement at the end.
        procs = [start_pod(Path(tmp_name), port, num_blocks=4096) for port in ports]
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                for url, proc in zip(urls, procs, strict=True):
                    await wait_ready(session, url, proc)
                log(f"pods ready in {time.perf_counter() - t0:.1f} s")
                for url in urls:  # warm-up: first calls allocate
                    for _ in range(2):
                        await _decode_step(session, url, [prompt(16)], 4)
                # Through the real router, as every client request goes: its hop is part of the overhead.
                async with real_router(urls[:1]) as url:
                    for _ in range(2):  # the router's first requests open its connections
                        await _decode_step(session, url, [prompt(16)], 4)
                    for p in PREFILLS:  # the median of three: one slow request must not skew the fit
                        ttft = float(np.median([await _ttft(session, url, prompt(p)) for _ in range(3)]))
                        rows.append(Timed(BatchShape(p, 1, 1, p * (p + 1) / 2, p), ttft, True))
                        log(f"prefill {p:5d} tokens: {ttft * 1000:7.1f} ms (time to first token)")
                    for cached, new in PREFIX_HITS:
                        prefix = prompt(cached)
                        await _ttft(session, url, prefix + prompt(new))  # caches the prefix
                        ttfts = [await _ttft(session, url, prefix + prompt(new)) for _ in range(3)]
                        ttft = float(np.median(ttfts))
                        n = cached + new
                        attn = new * cached + new * (new + 1) / 2
                        rows.append(Timed(BatchShape(new, 1, 1, attn, n), ttft, True))
                        log(
                            f"prefill {new:5d} tokens after {cached} cached: {ttft * 1000:7.1f} ms (time to first token)"
                        )
                    for batch, p in DECODES:
                        prompts = [prompt(p) for _ in range(batch)]
                        step = await _decode_step(session, url, prompts, decode_tokens)
                        ctx = p + decode_tokens / 2  # mean context over the decode steps
                        shape = BatchShape(batch, batch, batch, batch * ctx, int(batch * ctx))
                        rows.append(Timed(shape, step))
                        log(f"decode  batch {batch:3d} at ~{p} ctx: {step * 1000:7.1f} ms/step (served)")
                usage = await _contention(session, urls, prompt, decode_tokens, log)
        finally:
            stop_pods(procs)
    return rows, usage


async def _contention(session, urls: list[str], prompt, decode_tokens: int, log) -> CoreUsage:
    """How much two engines on this host slow each other: the same prefill, and the same decode batch, on
    one pod alone and on both pods at once. Under the sharing model (a step stretches by the engines'
    core demand over the host's cores) two alike engines slow by 2u / cores, so u = slowdown x cores / 2;
    at least cores / 2, since a neighbour cannot make an engine faster. (The pods' CPU time over wall time
    would overstate it: the idle threads of a parallel region spin, and burn CPU, between operators.)"""
    cores = os.cpu_count() or 1
    p, batch, rounds = PREFILLS[-2], 4, 3
    alone_prefill, both_prefill, alone_decode, both_decode = [], [], [], []
    for _ in range(rounds):
        alone_prefill.append(await _ttft(session, urls[0], prompt(p)))
        both_prefill.extend(await asyncio.gather(*(_ttft(session, u, prompt(p)) for u in urls)))
        batch_prompts = [prompt(48) for _ in range(batch)]
        alone_decode.append(await _decode_step(session, urls[0], batch_prompts, decode_tokens))
        both_decode.extend(
            await asyncio.gather(
                *(_decode_step(session, u, [prompt(48) for _ in range(batch)], decode_tokens) for u in urls)
            )
        )
    slow_prefill = float(np.median(both_prefill) / np.median(alone_prefill))
    slow_decode = float(np.median(both_decode) / np.median(alone_decode))
    log(
        f"two engines at once: prefill {slow_prefill:.2f}x, decode {slow_decode:.2f}x as slow as one alone "
        f"({cores} cores)"
    )
    return CoreUsage(cores, max(slow_prefill, 1.0) * cores / 2, max(slow_decode, 1.0) * cores / 2)


def fit(
    rows: list[Timed], kv_cache_bytes: float = 2**30, cores: CoreUsage | None = None
) -> tuple[LinearCost, float]:
    """The linear terms fitted on every row but the small-batch decode steps, whose excess over the fit
    is then taken as measured (`LinearCost.small_batch_extra_s`); and the median relative error."""
    small = [r for r in rows if not r.first_token and r.shape.num_tokens in SMALL_BATCH_TOKENS]
    linear_rows = [r for r in rows if not any(r is s for s in small)]
    a = np.array([_features(r.shape, r.first_token) for r in linear_rows], dtype=np.float64)
    b = np.array([r.seconds for r in linear_rows], dtype=np.float64)
    # Relative error matters (a 30 ms decode and a 2 s prefill alike): weight rows by 1 / time.
    w = 1.0 / b
    x = _nnls(a * w[:, None], b * w)
    model = model_profile("smollm2-135m")
    base, per_token, per_seq, per_attn, per_kv_read, overhead = (float(v) for v in x)
    cost = LinearCost(
        base,
        per_token,
        per_seq,
        0.0,
        per_attn,
        kv_cache_bytes,
        model,
        "cpu",
        request_overhead_s=overhead,
        cores=cores,
        per_kv_read_s=per_kv_read,
    )
    if small:
        extra = [0.0] * (max(SMALL_BATCH_TOKENS) + 1)
        for n in SMALL_BATCH_TOKENS:
            excess = [r.seconds - cost.step_seconds(r.shape) for r in small if r.shape.num_tokens == n]
            if excess:
                extra[n] = float(np.median(excess))
        cost = dataclasses.replace(cost, small_batch_extra_s=tuple(extra))
    pred = np.array(
        [cost.step_seconds(r.shape) + (cost.request_overhead_s if r.first_token else 0.0) for r in rows]
    )
    seconds = np.array([r.seconds for r in rows], dtype=np.float64)
    return cost, float(np.median(np.abs(pred - seconds) / seconds))


def calibrate(out: Path, decode_steps: int = 6, via: str = "server", log=print) -> LinearCost:
    if via == "server":
        rows, cores = measure_served(2 * decode_steps, log)
    else:
        rows, cores = measure(decode_steps, log), None
    cost, err = fit(rows, cores=cores)
    extra = cost.small_batch_extra_s
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(cost.to_json() + "\n")
    small = ", ".join(f"{n} tokens {extra[n] * 1e3:+.1f} ms" for n in SMALL_BATCH_TOKENS if n < len(extra))
    log(
        f"fit: base {cost.base_s * 1e3:.2f} ms + {cost.per_token_s * 1e3:.3f} ms/token + "
        f"{cost.per_seq_s * 1e3:.3f} ms/seq + {cost.per_attn_s * 1e9:.2f} ns/attention-pair + "
        f"{cost.per_kv_read_s * 1e6:.2f} us/context token read per step, "
        f"{cost.request_overhead_s * 1e3:.1f} ms per request"
        + (f"; steps of {small} beyond that" if small else "")
        + f"; median relative error {err:.1%} over {len(rows)} rows (timed through the {via}) -> {out}"
    )
    return cost
