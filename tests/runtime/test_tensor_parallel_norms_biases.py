"""Tensor parallelism over layers whose shards need more than a split: OLMoE's q/k RMSNorm over all heads
(the mean square spans ranks; with one KV head replicated on both ranks) and biases on the row-parallel
o_proj / down_proj (added once, not once per rank). Sharded greedy output equals one process's.

Real worker processes (gloo on CPU), as in test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.tensor_parallel import check_tensor_parallel, shard_slice

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320)


def _config(case: str):
    from transformers import LlamaConfig, OlmoeConfig

    if case == "olmoe":
        # One KV head: at 2 ranks it is replicated, and k_norm's mean square must not count it twice.
        return OlmoeConfig(
            **SMALL,
            num_key_value_heads=1,
            intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            clip_qkv=2.0,
            attention_bias=True,
        )
    return LlamaConfig(
        **SMALL, num_key_value_heads=2, intermediate_size=96, attention_bias=True, mlp_bias=True
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["norms and biases across ranks"] * 10, trainer)
    tok_file = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    backend.save(str(tok_file))
    paths = {}
    for case in ("olmoe", "llama_biases"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(case)).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(1.0, 0.3)  # the norms' per-channel weights must land on the right rank
                elif name.endswith(".bias"):
                    param.normal_(0.0, 0.1)  # a bias added twice would change the output
                elif name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, 0.5)  # decisive, varied routing
                elif name.endswith("proj.weight"):
                    param.normal_(0.0, 0.2)
        directory = tmp_path_factory.mktemp(case)
        model.save_pretrained(directory, safe_serialization=True)
        PreTrainedTokenizerFast(tokenizer_file=str(tok_file), eos_token="<|endoftext|>").save_pretrained(
            directory
        )
        paths[case] = str(directory)
    return paths


def _tp(tp: int, model: dict) -> RuntimeConfig:
    return RuntimeConfig.model_validate(
        {
            "model": model,
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
@pytest.mark.parametrize("case", ["olmoe", "llama_biases"])
def test_sharded_output_equals_one_process(case, checkpoints):
    prompts = [[5, 9, 17, 23, 40, 41, 42, 60, 61, 70], [90, 91, 92, 5, 9, 93, 94, 95] * 2]
    model = {"model": checkpoints[case], "dtype": "float32"}
    reference = _run(LLM(config=_tp(1, model)), prompts)
    llm = LLM(config=_tp(2, model))
    try:
        sharded = _run(llm, prompts)
    finally:
        llm.shutdown()
    for (ids1, lps1), (ids2, lps2) in zip(reference, sharded, strict=True):
        assert ids1 == ids2
        assert lps1 == pytest.approx(lps2, abs=1e-4)  # fp32: only the all-reduce summation order differs
    assert len({t for ids, _ in reference for t in ids}) > 3  # a varied continuation, not one token


def test_norm_slices_follow_the_heads_only_for_norms_over_all_heads():
    olmoe = ModelArch("olmoe", 48, 16, 24, 1, 4, 1, 4, 1e-5, 1e4, 64, qk_norm=True)  # 4 heads, 1 KV head
    check_tensor_parallel(olmoe, 2)
    assert shard_slice("model.layers.0.self_attn.q_norm.weight", olmoe, 1, 2) == (0, 8, 8)
    assert shard_slice("model.layers.0.self_attn.k_norm.weight", olmoe, 1, 2) == (0, 0, 4)  # replicated
    qwen3 = ModelArch("qwen3", 48, 16, 24, 1, 4, 2, 4, 1e-5, 1e4, 64, head_qk_norm=True)
    assert shard_slice("model.layers.0.self_attn.q_norm.weight", qwen3, 1, 2) is None  # head_dim wide
    assert shard_slice("model.layers.0.self_attn.o_proj.bias", olmoe, 1, 2) is None  # whole; rank 0 adds it
