"""The sampler's cost per step on a served model's own logits, beside HF transformers' sampling of the same rows.

Rows: greedy, temperature 0.7, temperature 0.2 + top-p 0.9 (`make serve`'s built-in model's generation
defaults), temperature 1.0 + top-p 0.95 and temperature 1.5 + top-p 0.95 (flat rows: top-p's boundary lies
tens of thousands of tokens deep), at 1, 8 and 64 rows. The peer is what HF `generate` runs per
step on the same logits: its logits warpers (temperature, top-p), softmax and `torch.multinomial`, or the
argmax. The two are interleaved in one run; medians of `--reps`. CPU by default, where the sampler's
vocabulary-wide passes cost most relative to the model.

The logits are the built-in model's (its 49k vocabulary), recorded from the engine's first decode steps of
`max(--rows)` prompts, so rows are as peaked or as flat as a served model's are: how flat a row is decides
how much of the vocabulary top-p has to look at.

    python bench/sampler.py [--rows 1 8 64] [--reps 20] [--threads 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampler import Sampler, SamplingMetadata
from tokenfleet.runtime.engine.sampling_params import SamplingParams

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "T 0.7": {"temperature": 0.7},
    "T 0.2, top-p 0.9": {"temperature": 0.2, "top_p": 0.9},
    "T 1.0, top-p 0.95": {"temperature": 1.0, "top_p": 0.95},
    "T 1.5, top-p 0.95": {"temperature": 1.5, "top_p": 0.95},  # a nucleus of 10-20k tokens
}

PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain recursion to a child.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a name for a cat.",
    "How do I boil an egg?",
]


def record_logits(num_rows: int, device: str) -> torch.Tensor:
    """[num_rows, vocab] float32: the built-in model's logits at its decode steps, one row per stream."""
    llm = LLM(device=device, max_num_seqs=num_rows)
    runner = llm.engine.runner
    sampler = runner.sampler
    seen: list[torch.Tensor] = []

    def recording(logits: torch.Tensor, meta: SamplingMetadata):
        if logits.shape[0] == num_rows:
            seen.append(logits.float().clone())
        return sampler(logits, meta)

    runner.sampler = recording
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (#{i})" for i in range(num_rows)]
    llm.generate(prompts, SamplingParams(temperature=0.7, max_tokens=4, seed=0))
    runner.sampler = sampler
    if not seen:
        raise RuntimeError("no decode step with every stream in it was recorded")
    return seen[-1]


def hf_sample(logits: torch.Tensor, params: dict) -> torch.Tensor:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    if params["temperature"] == 0.0:
        return logits.argmax(dim=-1)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params["temperature"])])
    if "top_p" in params:
        warpers.append(TopPLogitsWarper(params["top_p"]))
    scores = warpers(None, logits.clone())
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = record_logits(max(args.rows), args.device)
    print(
        f"device {args.device}, {args.threads} torch threads, vocab {logits.shape[1]}; ms per step, medians"
    )
    print("| rows | setting | tokenfleet | HF warpers + multinomial | HF / tokenfleet |")
    print("|---:|---|---:|---:|---:|")
    sampler = Sampler(seed=0)
    for rows in args.rows:
        batch = logits[:rows].contiguous()
        for name, params in SETTINGS.items():
            requests = [Request(f"r{i}", [1], SamplingParams(**params)) for i in range(rows)]
            meta = SamplingMetadata.build(requests, {}, batch.device)
            sampler(batch, meta)  # warm-up: first calls pay one-off allocations
            hf_sample(batch, params)
            ours: list[float] = []
            peer: list[float] = []
            for _ in range(args.reps):
                start = time.perf_counter()
                sampler(batch, meta)
                ours.append(time.perf_counter() - start)
                start = time.perf_counter()
                hf_sample(batch, params)
                peer.append(time.perf_counter() - start)
            a, b = statistics.median(ours) * 1e3, statistics.median(peer) * 1e3
            print(f"| {rows} | {name} | {a:.2f} | {b:.2f} | {b / a:.2f} |", flush=True)


if __name__ == "__main__":
    main()
