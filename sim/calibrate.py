"""`tokenfleet simulate calibrate`: time the real engine on this machine and fit the `cpu` step-cost profile.

The engine (`EngineCore`, the default model on CPU) runs steps whose shape is known exactly from what it
was given: a fresh prompt of P tokens on an idle engine is one prefill step of P tokens; B requests that
have all finished their prompts make decode steps of B tokens at their current context lengths (read from
the scheduler's running requests before each step). Each timed step is a row (features, seconds); a
non-negative least-squares fit over [1, tokens, sequences, attention work] gives the `LinearCost`. The fit's
relative error on its own rows is printed so a bad fit is visible.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tokenfleet.sim.cost_model import BatchShape, LinearCost
from tokenfleet.sim.model_profile import model_profile

PREFILLS = (32, 128, 384, 768)
DECODES = ((1, 48), (4, 48), (12, 48), (24, 48), (6, 600))


def _features(s: BatchShape) -> list[float]:
    return [1.0, s.num_tokens, s.num_seqs, s.attn_work]


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (drop the most negative one and refit until none is)."""
    active = list(range(a.shape[1]))
    while True:
        x, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (x >= 0).all() or len(active) == 1:
            out = np.zeros(a.shape[1])
            out[active] = np.maximum(x, 0)
            return out
        active.pop(int(np.argmin(x)))


def measure(decode_steps: int = 6, log=print) -> list[tuple[BatchShape, float]]:
    from tokenfleet.runtime.config import RuntimeConfig, SchedulerConfig
    from tokenfleet.runtime.engine.engine_core import EngineCore
    from tokenfleet.runtime.engine.sampling_params import SamplingParams

    config = RuntimeConfig(scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048))
    t0 = time.perf_counter()
    core = EngineCore(config)
    log(f"loaded {core.model_name} in {time.perf_counter() - t0:.1f} s")
    rng = np.random.Generator(np.random.PCG64(0))
    rows: list[tuple[BatchShape, float]] = []
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
        rows.append((BatchShape(p, 1, 1, p * (p + 1) / 2, p), time.perf_counter() - t))
        drain()
        log(f"prefill {p:5d} tokens: {rows[-1][1] * 1000:7.1f} ms")
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
            rows.append((shape, times[-1]))
        drain()
        log(f"decode  batch {batch:3d} at ~{p} ctx: {np.median(times) * 1000:7.1f} ms/step")
    return rows


def fit(rows: list[tuple[BatchShape, float]], kv_cache_bytes: float = 2**30) -> tuple[LinearCost, float]:
    a = np.array([_features(s) for s, _ in rows], dtype=np.float64)
    b = np.array([t for _, t in rows], dtype=np.float64)
    # Relative error matters (a 30 ms decode and a 2 s prefill alike): weight rows by 1 / time.
    w = 1.0 / b
    x = _nnls(a * w[:, None], b * w)
    model = model_profile("smollm2-135m")
    cost = LinearCost(float(x[0]), float(x[1]), float(x[2]), 0.0, float(x[3]), kv_cache_bytes, model)
    pred = np.array([cost.step_seconds(s) for s, _ in rows])
    return cost, float(np.median(np.abs(pred - b) / b))


def calibrate(out: Path, decode_steps: int = 6, log=print) -> LinearCost:
    rows = measure(decode_steps, log)
    cost, err = fit(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(cost.to_json() + "\n")
    log(
        f"fit: base {cost.base_s * 1e3:.2f} ms + {cost.per_token_s * 1e3:.3f} ms/token + "
        f"{cost.per_seq_s * 1e3:.3f} ms/seq + {cost.per_attn_s * 1e9:.2f} ns/attention-pair; "
        f"median relative error {err:.1%} over {len(rows)} steps -> {out}"
    )
    return cost
