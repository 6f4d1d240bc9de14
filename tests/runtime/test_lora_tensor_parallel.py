"""LoRA adapters under tensor parallelism (CPU, gloo, real worker processes) against HF + PEFT.

A tiny random Llama (4 heads, one KV head replicated on both ranks) split 2 ways, three PEFT adapters of
different ranks and targets: each rank holds its part of every adapter (column-parallel projections their
rows of B, row-parallel ones their columns of A), and a mixed batch of the base model and the adapters is
token-identical to HF + PEFT on the whole model.
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM, LoRARequest
from tokenfleet.runtime.engine.sampling_params import SamplingParams

from .lora_adapters import ADAPTERS, adapter_dir, make_adapters, peft_greedy
from .test_tensor_parallel import checkpoints  # noqa: F401 (the tiny random checkpoints, a fixture)

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_adapters(checkpoints, tmp_path_factory):  # noqa: F811
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("tiny_adapters")
    peft_model = make_adapters(hf, out, seed=1)
    return peft_model, {name: adapter_dir(out, name) for name in ADAPTERS}


def test_mixed_adapters_at_tp2_equal_peft(checkpoints, tiny_adapters):  # noqa: F811
    peft_model, paths = tiny_adapters
    prompts = [[5, 17, 42, 99, 7, 250, 31, 64, 12], [200, 3, 3, 18], [77, 78, 79, 80, 81, 82], [9, 150]]
    names = [None, "qv8", "mlp4", "all16"]
    expected = [peft_greedy(peft_model, n, p, MAX_NEW) for n, p in zip(names, prompts, strict=True)]
    base = [peft_greedy(peft_model, None, p, MAX_NEW) for p in prompts[1:]]
    assert all(e != b for e, b in zip(expected[1:], base, strict=True))  # every adapter changes its output
    llm = LLM(
        config=RuntimeConfig.model_validate(
            {
                "model": {"model": checkpoints["llama"], "dtype": "float32"},
                "cache": {"block_size": 8, "num_blocks": 32},
                "parallel": {"tensor_parallel_size": 2},
                "lora": {"enable": True, "max_loras": 2, "max_cpu_loras": 3},
            }
        )
    )
    try:
        loras = [None if n is None else LoRARequest(n, 0, str(paths[n])) for n in names]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras, use_tqdm=False
        )
        assert [o.outputs[0].token_ids for o in outs] == expected
        # Two slots for three adapters: one slot was filled twice, on every rank.
        assert llm.engine.lora.num_slot_loads == 3
    finally:
        llm.shutdown()
