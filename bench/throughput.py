"""Offline throughput: tokenfleet vs HF transformers on the same seeded workload, in one run.

Workload: N requests with seeded random prompt lengths (sampled real text, re-tokenized) and output
lengths; greedy, EOS ignored so every system produces exactly the requested tokens. Throughput counts the
*requested* output tokens (as vLLM's benchmark_throughput does): a static batch that pads to its longest
member pays for that waste.

Peers: HF `generate` in static padded batches (left padding, batch size = --hf-batch), and HF's own
continuous batching (`generate_batch`) when the installed transformers has it.

    python bench/throughput.py [--num-requests 32] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from tokenfleet.runtime.config import ModelConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.model.loader import load_model
from tokenfleet.runtime.model.source import resolve_source

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "what",
    "out",
    "up",
    "more",
    "no",
    "into",
    "time",
    "model",
    "cache",
    "token",
    "request",
    "server",
    "cluster",
    "pod",
    "latency",
    "memory",
    "block",
    "prefix",
    "schedule",
    "batch",
    "decode",
]


def workload(n: int, seed: int, tokenizer, min_in: int, max_in: int, min_out: int, max_out: int):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        target = rng.randint(min_in, max_in)
        text = " ".join(rng.choice(WORDS) for _ in range(target * 2))
        ids = tokenizer.encode(text)[:target]
        reqs.append((ids, rng.randint(min_out, max_out)))
    return reqs


def bench_tokenfleet(loaded, reqs, args) -> float:
    llm = LLM(loaded=loaded, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens)
    llm.generate([reqs[0][0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, out in reqs]
    start = time.perf_counter()
    outs = llm.generate([ids for ids, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [out for _, out in reqs]
    return elapsed


def hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def bench_hf_generate(model, reqs, batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (ids, _) in enumerate(chunk):  # left padding, as decoder-only generation needs
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = 1
        new = max(out for _, out in chunk)
        model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start


@torch.inference_mode()
def bench_hf_continuous(model, reqs) -> float | None:
    if not hasattr(model, "generate_batch"):
        return None
    from transformers import GenerationConfig

    new = max(out for _, out in reqs)  # generate_batch takes one max_new_tokens for all requests
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    model.generate_batch([ids for ids, _ in reqs], generation_config=config, progress_bar=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-input", type=int, default=16)
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=96)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=1024)
    ap.add_argument("--skip-hf-continuous", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    loaded = load_model(ModelConfig(dtype="float32"), torch.device("cpu"))
    reqs = workload(
        args.num_requests,
        args.seed,
        loaded.tokenizer,
        args.min_input,
        args.max_input,
        args.min_output,
        args.max_output,
    )
    n_in = sum(len(ids) for ids, _ in reqs)
    n_out = sum(out for _, out in reqs)
    print(f"workload: {len(reqs)} requests, {n_in} prompt tokens, {n_out} output tokens (seed {args.seed})")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, fp32, CPU")

    rows = [("tokenfleet", bench_tokenfleet(loaded, reqs, args))]
    model = hf_model(resolve_source("smollm2-135m-instruct").path)
    rows.append(
        (f"HF generate (static batches of {args.hf_batch})", bench_hf_generate(model, reqs, args.hf_batch))
    )
    if not args.skip_hf_continuous:
        cb = bench_hf_continuous(model, reqs)
        if cb is not None:
            rows.append(("HF generate_batch (continuous batching)", cb))

    base = rows[0][1]
    print(f"\n{'system':<44}{'time s':>9}{'out tok/s':>11}{'total tok/s':>13}{'tokenfleet x':>14}")
    for name, secs in rows:
        print(
            f"{name:<44}{secs:>9.2f}{n_out / secs:>11.1f}{(n_in + n_out) / secs:>13.1f}{secs / base:>14.2f}"
        )


if __name__ == "__main__":
    main()
