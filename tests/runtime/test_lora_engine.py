"""LoRA adapters in the engine against HF + PEFT on the real default model: greedy, fp32, token for token.

The adapters are made with PEFT (three ranks, different target modules, random non-zero B); the base model
and the three adapters share one batch — one step — and each request must produce exactly PEFT's tokens.
Then what must not change with adapters: the prefix cache never serves one adapter's KV to another (or to
the base, or to the same name loaded with other weights), one slot serves several adapters in turn, and
every bad adapter is refused with a message and leaves the engine as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenfleet.runtime.config import ModelConfig, RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM, LoRARequest
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.errors import AdaptersBusy, ConfigError, InvalidRequest, ModelNotFound
from tokenfleet.runtime.model import load_model
from tokenfleet.runtime.model.lora_adapter import InvalidAdapter, load_adapter

from .lora_adapters import peft_greedy

MAX_NEW = 10
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is the boiling point of water at sea level?\nA:",
]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(lora_adapters):
    return lora_adapters


@pytest.fixture(scope="module")
def fresh_model():
    """A model of its own: an engine with LoRA hooks its projections (removed again at shutdown)."""
    return load_model(ModelConfig(dtype="float32", attention_backend="torch"), torch.device("cpu"))


def lora_llm(model, **lora) -> LLM:
    config = RuntimeConfig.model_validate(
        {
            "model": {"dtype": "float32", "attention_backend": "torch"},
            "cache": {"num_blocks": 256},
            "lora": {"enable": True, "max_lora_rank": 16, **lora},
        }
    )
    return LLM(config=config, loaded=model)


def test_mixed_batch_equals_peft_in_one_step(adapters, fresh_model, hf_tokenizer):
    peft_model, paths = adapters
    ids = [hf_tokenizer.encode(p) for p in PROMPTS]
    names = [None, "qv8", "mlp4", "all16"]
    expected = [peft_greedy(peft_model, name, i, MAX_NEW) for name, i in zip(names, ids, strict=True)]
    # The adapters do act: each changes its prompt's output.
    base = [peft_greedy(peft_model, None, i, MAX_NEW) for i in ids[1:]]
    assert all(e != b for e, b in zip(expected[1:], base, strict=True))

    llm = lora_llm(fresh_model, max_loras=3)
    try:
        steps = []
        loras = [None] + [LoRARequest(n, k + 1, str(paths[n])) for k, n in enumerate(names[1:])]
        outs = llm.generate(
            [{"prompt_token_ids": i} for i in ids],
            GREEDY,
            lora_request=loras,
            use_tqdm=False,
            on_step=steps.append,
        )
        assert [o.outputs[0].token_ids for o in outs] == expected
        # All four prefilled in the first step: one forward mixed the base and three adapters.
        assert {d.request_id for d in steps[0]} == {"0", "1", "2", "3"}
        assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks
        assert all(a.in_flight == 0 for a in llm.engine.lora.adapters())
    finally:
        llm.shutdown()
    assert getattr(fresh_model.model, "lora", None) is None  # hooks gone with the engine


def test_prefix_cache_is_keyed_by_adapter_and_weights(adapters, fresh_model, hf_tokenizer):
    peft_model, paths = adapters
    prompt = PROMPTS[2]  # three full blocks
    ids = hf_tokenizer.encode(prompt)
    llm = lora_llm(fresh_model, max_loras=1, max_cpu_loras=2)
    try:

        def run(lora):
            out = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)[0]
            return out.outputs[0].token_ids, out.num_cached_tokens

        tokens, cached = run(None)
        assert tokens == peft_greedy(peft_model, None, ids, MAX_NEW) and cached == 0
        tokens, cached = run(LoRARequest("x", 1, str(paths["qv8"])))
        assert cached == 0, "the base model's KV served to an adapter"
        assert tokens == peft_greedy(peft_model, "qv8", ids, MAX_NEW)
        tokens, cached = run(LoRARequest("x", 1, str(paths["qv8"])))
        assert cached > 0 and tokens == peft_greedy(peft_model, "qv8", ids, MAX_NEW)
        # The same name with other weights, into the same slot: nothing cached under the old weights is hit.
        llm.engine.lora.unregister("x")
        tokens, cached = run(LoRARequest("x", 1, str(paths["all16"])))
        assert cached == 0 and tokens == peft_greedy(peft_model, "all16", ids, MAX_NEW)
        tokens, cached = run(None)
        assert cached > 0 and tokens == peft_greedy(peft_model, None, ids, MAX_NEW)
    finally:
        llm.shutdown()


def test_one_slot_serves_three_adapters_in_turn(adapters, fresh_model, hf_tokenizer):
    """max_loras=1: the scheduler never runs two adapters at once, and base requests pass them by."""
    peft_model, paths = adapters
    names = ["qv8", None, "mlp4", "all16", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    llm = lora_llm(fresh_model, max_loras=1, max_cpu_loras=3)
    try:
        loras = [None if n is None else LoRARequest(n, 0, str(paths[n])) for n in names]
        outs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
        for name, prompt, out in zip(names, prompts, outs, strict=True):
            assert out.outputs[0].token_ids == peft_greedy(
                peft_model, name, hf_tokenizer.encode(prompt), MAX_NEW
            )
        assert llm.engine.lora.num_slot_loads == 3
    finally:
        llm.shutdown()


def test_loading_past_the_host_limit_evicts_an_idle_adapter_or_refuses(adapters, fresh_model):
    _, paths = adapters
    llm = lora_llm(fresh_model, max_loras=1, max_cpu_loras=2)
    manager = llm.engine.lora
    try:
        manager.register("a", str(paths["qv8"]))
        manager.register("b", str(paths["mlp4"]))
        manager.acquire("b")  # "a" is now the least recently used
        manager.register("c", str(paths["all16"]))
        assert [a.name for a in manager.adapters()] == ["b", "c"]
        c = manager.acquire("c")
        with pytest.raises(AdaptersBusy, match="in flight"):
            manager.register("d", str(paths["qv8"]))
        assert [a.name for a in manager.adapters()] == ["b", "c"]
        manager.release(c)
        # "a" was evicted from host memory, not forgotten: asked for again, it is loaded from its path
        # (evicting "c", idle now and the least recently used).
        assert [n for n, _, _ in manager.known()] == ["a", "b", "c"]
        llm.engine.add_request("r", [1, 2, 3], GREEDY, lora_name="a")
        assert [a.name for a in manager.adapters()] == ["a", "b"]
        llm.engine.abort("r")
        manager.unregister("a")  # forgotten: new requests get 404
        with pytest.raises(ModelNotFound):
            llm.engine.add_request("r2", [1, 2, 3], GREEDY, lora_name="a")
        assert not llm.engine.has_unfinished()
        with pytest.raises(InvalidRequest, match="already been loaded"):
            manager.register("b", str(paths["qv8"]))
    finally:
        llm.shutdown()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such adapter path"),
        ("pickle", "pickle"),
        ("corrupt", "not a readable safetensors"),
        ("rank", "over max_lora_rank 8"),
        ("dora", "DoRA"),
        ("other_model", "another base model"),
        ("target", "not served"),
    ],
)
def test_bad_adapters_are_refused_with_the_reason(adapters, fresh_model, tmp_path, case, message):
    _, paths = adapters
    src = paths["all16"]
    path = tmp_path / case
    max_rank = 16
    if case == "missing":
        pass
    elif case == "pickle":
        path.mkdir()
        shutil.copy(src / "adapter_config.json", path)
        (path / "adapter_model.bin").write_bytes(b"\x80\x04")
    elif case == "corrupt":
        _copy(src, path)
        data = (path / "adapter_model.safetensors").read_bytes()
        (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    elif case == "rank":
        _copy(src, path)
        max_rank = 8
    elif case == "dora":
        _copy(src, path)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    elif case in ("other_model", "target"):
        from safetensors.torch import save_file

        _copy(src, path)
        name = "base_model.model.model.layers.0.self_attn.q_proj"
        if case == "target":
            name = "base_model.model.model.layers.0.self_attn.c_attn"
        a = torch.zeros(4, 4096 if case == "other_model" else 576)
        save_file(
            {f"{name}.lora_A.weight": a, f"{name}.lora_B.weight": torch.zeros(576, 4)},
            path / "adapter_model.safetensors",
        )
    arch = fresh_model.arch
    with pytest.raises(InvalidAdapter, match=message):
        load_adapter(path, arch, max_rank, torch.float32)
    # Through the engine: refused, nothing loaded, the engine keeps serving.
    llm = lora_llm(fresh_model, max_loras=1, max_lora_rank=max_rank)
    try:
        with pytest.raises(InvalidAdapter, match=message):
            llm.engine.lora.register("bad", str(path))
        assert llm.engine.lora.adapters() == []
        assert len(llm.generate(["hi"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_NEW
    finally:
        llm.shutdown()


def test_start_up_modules_are_checked(adapters, fresh_model, tmp_path):
    with pytest.raises(ConfigError, match=r"lora\.modules bad: .*no such adapter path"):
        lora_llm(fresh_model, modules=[{"name": "bad", "path": str(tmp_path / "nope")}])
    assert getattr(fresh_model.model, "lora", None) is None  # a failed start leaves no hooks behind


@pytest.mark.parametrize(
    "settings",
    [
        {"scheduler": {"max_num_batched_tokens": 7}},  # chunked prefill
        {"cache": {"num_blocks": 5, "block_size": 16}},  # preemption (and recompute) under adapters
        {"speculative": {"method": "ngram", "num_speculative_tokens": 3, "ngram_min": 1, "ngram_max": 2}},
        {"speculative": {"method": "self", "num_speculative_tokens": 2, "draft_layers": 4}},
    ],
    ids=["chunked", "preempted", "ngram", "self-draft"],
)
def test_adapters_with_chunking_preemption_and_speculation_equal_peft(
    adapters, fresh_model, hf_tokenizer, settings
):
    """The draft of self-speculation runs the base model's first layers without the adapter: it may
    propose worse tokens, never other outputs."""
    peft_model, paths = adapters
    names = ["all16", None, "mlp4", "qv8"]
    ids = [hf_tokenizer.encode(p) for p in PROMPTS]
    data = {
        "model": {"dtype": "float32", "attention_backend": "torch"},
        "cache": {"num_blocks": 256},
        "lora": {"enable": True, "max_loras": 3, "max_lora_rank": 16},
    }
    for section, values in settings.items():
        data[section] = {**data.get(section, {}), **values}
    llm = LLM(config=RuntimeConfig.model_validate(data), loaded=fresh_model)
    try:
        loras = [None if n is None else LoRARequest(n, 0, str(paths[n])) for n in names]
        outs = llm.generate(
            [{"prompt_token_ids": i} for i in ids], GREEDY, lora_request=loras, use_tqdm=False
        )
        for name, prompt, out in zip(names, ids, outs, strict=True):
            assert out.outputs[0].token_ids == peft_greedy(peft_model, name, prompt, MAX_NEW), name
        if "cache" in settings:
            assert llm.engine.scheduler.num_preemptions_total > 0
        km = llm.engine.kv_manager
        assert km.num_free_blocks == km.num_blocks
    finally:
        llm.shutdown()
