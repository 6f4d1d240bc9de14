"""TTFT of a request whose ~1k-token prefix is already cached vs the same request cold.

    python bench/prefix_ttft.py [--prefix-tokens 1024] [--repeats 3]

Cold: the prefix cache is reset before each measurement. Warm: the prefix (a different suffix) was served
just before, so its full blocks are hits and only the suffix is prefilled. Target: warm <= 0.15x cold.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams


def ttft(llm: LLM, ids: list[int]) -> tuple[float, int]:
    first: list[float] = []
    start = time.perf_counter()

    def on_step(outputs) -> None:
        if outputs and not first:
            first.append(time.perf_counter() - start)

    params = SamplingParams(temperature=0, max_tokens=1)
    out = llm.generate([ids], params, use_tqdm=False, on_step=on_step)[0]
    return first[0], out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    llm = LLM(dtype="float32", max_num_batched_tokens=2048)
    vocab = llm.engine.loaded.arch.vocab_size
    prefix = [rng.randrange(1000, vocab) for _ in range(args.prefix_tokens)]
    cold, warm, cached = [], [], []
    for _ in range(args.repeats):
        suffix_a = [rng.randrange(1000, vocab) for _ in range(24)]
        suffix_b = [rng.randrange(1000, vocab) for _ in range(24)]
        llm.engine.kv_manager.reset_prefix_cache()
        cold.append(ttft(llm, prefix + suffix_a)[0])
        t, n = ttft(llm, prefix + suffix_b)
        warm.append(t)
        cached.append(n)
    c, w = statistics.median(cold), statistics.median(warm)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU; prefix {args.prefix_tokens} tokens"
    )
    print(f"{'':<8}{'TTFT ms (median)':>18}{'cached tokens':>15}")
    print(f"{'cold':<8}{c * 1e3:>18.1f}{0:>15}")
    print(f"{'warm':<8}{w * 1e3:>18.1f}{statistics.median(cached):>15.0f}")
    print(f"warm / cold = {w / c:.3f} (target <= 0.15)")


if __name__ == "__main__":
    main()
