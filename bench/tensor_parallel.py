"""Tensor-parallel throughput: the same greedy workload at TP=1 and TP=N, in one run.

CPU (gloo): every rank is a process with cores // N threads; on a small machine TP cannot beat TP=1 in
FLOPs (the same cores do the same work, plus two all-reduces per layer and the per-step broadcast). TP=1
is measured twice: with all threads, and with the threads one rank gets (on a loaded, shared CPU a
multi-threaded process loses time at OpenMP barriers whenever one of its threads is descheduled, which
one-thread ranks do not: compare TP=N with both rows). On GPUs (NCCL, one device per rank) each rank has its own memory
bandwidth; sizes larger than the visible GPU count are reported as skipped.

The default model is a random-weight Llama with SmolLM2-135M's width but 8 heads / 4 KV heads (SmolLM2's
own 9 heads split only 1 or 3 ways: `--model smollm2-135m-instruct --tp 1 3`). Throughput is output tokens
of the whole batch over wall time, after a warm-up request.

    python bench/tensor_parallel.py [--tp 1 2] [--model random-llama|NAME|PATH] [--num-requests 16]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.parallel.workers import threads_per_rank
from tokenfleet.runtime.engine.sampling_params import SamplingParams


def random_llama(directory: str) -> str:
    """A random Llama checkpoint (safetensors) with a byte-level tokenizer, shaped like a ~100M model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32768,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["a random model for a throughput benchmark"] * 10, trainer)
    backend.save(f"{directory}/tokenizer.json")
    PreTrainedTokenizerFast(
        tokenizer_file=f"{directory}/tokenizer.json", eos_token="<|endoftext|>"
    ).save_pretrained(directory)
    return directory


def run(model: str, tp: int, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(start-up seconds, output tokens per second) at tensor-parallel size `tp`."""
    # Eager at every size: tensor-parallel decode is never compiled, so TP=1 compiled (auto on CUDA) would
    # compare CUDA graphs with eager collectives, and its start-up compile would not fit a short GPU check.
    config = RuntimeConfig.model_validate(
        {
            "model": {"model": model, "dtype": "float32", "compile": "off"},
            "parallel": {"tensor_parallel_size": tp},
        }
    )
    start = time.perf_counter()
    llm = LLM(config=config)
    startup = time.perf_counter() - start
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    return startup, sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--model", default="random-llama")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = random_llama(tmp) if args.model == "random-llama" else args.model
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 300) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device = f"{gpus} CUDA device(s)" if gpus else f"CPU, {torch.get_num_threads()} threads"
        print(
            f"model {args.model}, {args.num_requests} requests x ({args.prompt_len} in, {args.max_tokens} out), {device}"
        )
        print(f"{'TP':>4}{'threads':>9}{'start s':>10}{'out tok/s':>12}{'vs TP=1':>10}")
        base = None
        all_threads = torch.get_num_threads()
        rows = []
        for tp in args.tp:
            rows.append((tp, all_threads if tp == 1 else threads_per_rank(tp)))
            if tp == 1 and not gpus and max(args.tp) > 1:
                # The same threads one rank gets: on a shared CPU, OpenMP barriers across threads of one
                # process suffer when a thread is descheduled, which N one-thread ranks do not pay.
                rows.append((1, threads_per_rank(max(args.tp))))
        for tp, threads in rows:
            if gpus and tp > gpus:
                print(f"{tp:>4}  skipped: {gpus} GPU(s) visible, one per rank needed")
                continue
            if tp == 1:
                torch.set_num_threads(threads)
            startup, tok_s = run(model, tp, prompts, args.max_tokens)
            base = base or (tok_s if tp == 1 else None)
            ratio = f"{tok_s / base:.2f}x" if base else "-"
            print(f"{tp:>4}{threads:>9}{startup:>10.1f}{tok_s:>12.1f}{ratio:>10}", flush=True)


if __name__ == "__main__":
    main()
