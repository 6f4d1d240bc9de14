"""Gemma 2 and 3 under tensor parallelism: their extra pieces (the embedding scale after the vocab-parallel
all-reduce, four replicated (1 + weight) norms per layer, softcaps on sharded heads and on the gathered
logits, per-layer windows; Gemma 3's replicated per-head q/k norms and two RoPE tables, and a multimodal
checkpoint's language-model names) need nothing beyond what other families shard. Sharded greedy output,
with logprobs, equals one process's on a tiny random checkpoint. Real worker processes (gloo on CPU), as in
test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams

from .test_model_families import _gemma2, _gemma3, _gemma3_multimodal, _save

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)


FAMILIES = {"gemma2": _gemma2, "gemma3": _gemma3, "gemma3_multimodal": _gemma3_multimodal}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["sandwich norms on every rank"] * 10, trainer)
    tok_file = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    backend.save(str(tok_file))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[request.param]()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)  # replicated norms: a rank holding the wrong one would differ
            else:
                param.normal_(0.0, 0.15)
    directory = tmp_path_factory.mktemp(request.param)
    _save(model, directory, tok_file)
    return str(directory)


def _config(tp: int, path: str) -> RuntimeConfig:
    return RuntimeConfig.model_validate(
        {
            "model": {"model": path, "dtype": "float32"},
            "cache": {"block_size": 8, "num_blocks": 32},
            "parallel": {"tensor_parallel_size": tp},
        }
    )


def _run(llm: LLM, prompts: list[list[int]]):
    return [
        (o.token_ids, [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)])
        for o in (r.outputs[0] for r in llm.generate(prompts, GREEDY))
    ]


@pytest.mark.slow
def test_sharded_gemma_equals_one_process(checkpoint):
    prompts = [[5, 9, 17, 23, 40, 41, 42, 60, 61, 70, 71, 72], [90, 91, 92, 5, 9, 93, 94, 95] * 2]
    reference = _run(LLM(config=_config(1, checkpoint)), prompts)
    llm = LLM(config=_config(2, checkpoint))
    try:
        sharded = _run(llm, prompts)
    finally:
        llm.shutdown()
    for (ids1, lps1), (ids2, lps2) in zip(reference, sharded, strict=True):
        assert ids1 == ids2
        assert lps1 == pytest.approx(lps2, abs=1e-4)  # fp32: only the all-reduce summation order differs
    assert len({t for ids, _ in reference for t in ids}) > 3
