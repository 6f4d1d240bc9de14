"""Compiled decode steps on the real default model: the same greedy tokens as the eager path and as HF.

The engine-level test compiles two buckets (1, 2) of the whole model with inductor's C++ backend: minutes
on 2 shared cores, so it is marked slow. The cheap tests check the static-shape path itself (padding rows,
the attention custom op, bucket choice, when compiling is refused) without inductor, and the compiled
graphs' bookkeeping on a tiny random model through dynamo's "eager" backend (seconds).
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from pydantic import ValidationError
from tokenfleet.runtime.config import ModelConfig, RuntimeConfig, SpeculativeConfig
from tokenfleet.runtime.engine.compiled_decode import (
    CompiledDecode,
    decode_buckets,
    default_buckets,
    should_compile,
    unsupported_reason,
)
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.attention.base import DecodeMetadata, get_attention_backend
from tokenfleet.runtime.model.attention.metadata import SeqSpec, build_attention_metadata
from tokenfleet.runtime.model.llama import LlamaForCausalLM

MAX_NEW = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Hi",
]
SYSTEM = "You are a meticulous assistant for a shipping company. Answer with short, factual sentences. "
SHARED = [SYSTEM + q for q in ("Where is my parcel?", "How do I return an item?")]


def test_buckets_are_powers_of_two_capped_by_max_num_seqs():
    assert default_buckets(1) == (1,)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_buckets(48) == (1, 2, 4, 8, 16, 32, 48)


TINY = ModelArch(
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
)


def _tiny_model(backend: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(TINY, get_attention_backend(backend), max_positions=128).eval()


def test_compile_batch_sizes_limit_the_buckets_to_those_the_deployment_names():
    assert decode_buckets(64, None) == (1, 2, 4, 8, 16, 32, 64)  # unset: the powers of two
    assert decode_buckets(64, [64, 8, 1, 8]) == (1, 8, 64)
    assert decode_buckets(16, [64, 8, 1]) == (1, 8)  # sizes above max_num_seqs are never compiled
    with pytest.raises(ConfigError, match="max_num_seqs=4"):
        decode_buckets(4, [8, 16])
    with pytest.raises(ValueError):
        decode_buckets(4, [])
    with pytest.raises(ValidationError):  # the config refuses a non-positive size before any engine runs
        ModelConfig(compile_batch_sizes=[0, 4])


def test_compile_setting(default_model):
    cpu = torch.device("cpu")
    assert not should_compile("off", cpu, default_model.model)
    assert not should_compile("auto", cpu, default_model.model)  # auto compiles on CUDA only
    assert should_compile("on", cpu, default_model.model)


def test_torch_attention_is_not_graph_captured_on_cuda(default_model, caplog):
    """The torch backend's decode op reads seq_lens.max() on the host: on CUDA a sync inside what would be
    captured as a CUDA graph. The decision is made from the model and the device alone (no GPU needed)."""
    cuda = torch.device("cuda")
    model = default_model.model  # torch attention
    assert unsupported_reason(model, torch.device("cpu")) is None
    reason = unsupported_reason(model, cuda)
    assert reason is not None and "attention_backend" in reason
    with caplog.at_level(logging.INFO, logger="tokenfleet.runtime.engine.compiled_decode"):
        assert not should_compile("auto", cuda, model)  # eager, with the reason logged
    assert "attention_backend" in caplog.text
    with pytest.raises(ConfigError, match=r"model\.compile is 'on'.*model\.attention_backend 'torch'"):
        should_compile("on", cuda, model)
    # The Triton backend's op has no host read: compiled on CUDA.
    triton_model = _tiny_model("triton")
    assert unsupported_reason(triton_model, cuda) is None
    assert should_compile("auto", cuda, triton_model)


@torch.inference_mode()
def test_each_instance_keeps_and_drops_its_own_graphs():
    """Engines in one process do not share dynamo's graph cache: each instance holds one graph per bucket
    (three instances with different KV-cache shapes and 4 buckets each would exceed one shared cache's
    limit, an error under fullgraph=True), and the graphs go when the instance does (with them any
    reference to its KV caches)."""
    model, block_size = _tiny_model("torch"), 16
    instances, cache_refs = [], []
    for num_blocks in (4, 5, 6):  # different cache shapes: graphs that cannot be shared
        shape = (num_blocks + 1, block_size, TINY.num_kv_heads, TINY.head_dim)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(TINY.num_layers)]
        compiled = CompiledDecode(
            model,
            caches,
            torch.device("cpu"),
            buckets=(1, 2, 4, 8),
            max_blocks_per_seq=4,
            scratch_slot=num_blocks * block_size,
            backend="eager",
        )
        compiled.warm_up()
        assert compiled.num_graphs == 4
        instances.append(compiled)
        cache_refs.append(weakref.ref(caches[0][0]))
    assert [c.num_graphs for c in instances] == [4, 4, 4]

    # A step of 3 sequences runs in bucket 4 and gives the flat eager step's logits.
    compiled = instances[-1]
    specs = [SeqSpec(20, 1, [3, 4]), SeqSpec(5, 1, [0]), SeqSpec(40, 1, [0, 1, 2])]
    ids, pos = torch.tensor([11, 22, 33]), torch.tensor([20, 5, 40])
    reference = [(k.clone(), v.clone()) for k, v in compiled.kv_caches]
    flat = model.compute_logits(model(ids, pos, reference, build_attention_metadata(specs, block_size)))
    meta = build_attention_metadata(specs, block_size)
    assert compiled.supports(meta) and compiled.bucket_for(3) == 4
    torch.testing.assert_close(compiled.logits(ids, pos, meta), flat, rtol=1e-3, atol=2e-3)
    assert compiled.num_graphs == 4  # served by the warmed-up graph, no recompile

    instances[0].close()
    assert instances[0].num_graphs == 0 and instances[1].num_graphs == 4
    del compiled, caches
    instances.clear()
    gc.collect()
    assert all(ref() is None for ref in cache_refs), "a dropped instance's KV caches are still referenced"


@torch.inference_mode()
def test_padded_static_step_equals_the_flat_step(default_model):
    """Three sequences in a bucket of 4 through DecodeMetadata give the flat path's logits, and the padding
    row writes only the scratch block."""
    model, arch = default_model.model, default_model.arch
    block_size, num_blocks = 16, 12
    shape = (num_blocks + 1, block_size, arch.num_kv_heads, arch.head_dim)
    torch.manual_seed(0)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(arch.num_layers)]
    copies = [(k.clone(), v.clone()) for k, v in caches]
    specs = [SeqSpec(20, 1, [3, 4]), SeqSpec(5, 1, [7]), SeqSpec(40, 1, [0, 1, 2])]
    ids, pos = torch.tensor([11, 22, 33]), torch.tensor([20, 5, 40])
    flat = model.compute_logits(model(ids, pos, copies, build_attention_metadata(specs, block_size)))

    meta = build_attention_metadata(specs, block_size)
    scratch = num_blocks * block_size
    tables = torch.zeros(4, 8, dtype=torch.int32)
    tables[:3, : meta.block_tables.shape[1]] = meta.block_tables
    static = DecodeMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, torch.tensor([scratch])]),
        block_tables=tables,
        seq_lens=torch.cat([meta.seq_lens, torch.tensor([1], dtype=torch.int32)]),
    )
    padded = model.compute_logits(
        model(torch.cat([ids, torch.tensor([0])]), torch.cat([pos, torch.tensor([0])]), caches, static)
    )
    # Batches of 4 and 3 rows take different GEMM paths: rounding differs, the greedy choice does not.
    torch.testing.assert_close(padded[:3], flat, rtol=1e-3, atol=2e-3)
    assert torch.equal(padded[:3].argmax(-1), flat.argmax(-1))
    # Real blocks hold the same K/V as the flat step wrote (a batch of 4 rows may round differently).
    for (k, v), (k0, v0) in zip(caches, copies, strict=True):
        torch.testing.assert_close(k[:num_blocks], k0[:num_blocks], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v[:num_blocks], v0[:num_blocks], rtol=1e-4, atol=1e-4)


def _run(loaded, prompts, config=None, **options):
    llm = LLM(config=config or RuntimeConfig(), loaded=loaded, dtype="float32", **options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = [llm.tokenizer.encode(p) for p in prompts]
    outs = [o.outputs[0].token_ids for o in llm.generate(ids, params)]
    for prompt in SHARED:  # one after the other: the second finds the first's system prompt cached
        outs += [o.outputs[0].token_ids for o in llm.generate([llm.tokenizer.encode(prompt)], params)]
    km = llm.engine.kv_manager
    assert km.num_free_blocks == km.num_blocks, "KV blocks leaked"
    return llm, ids, outs


def _hf_greedy(hf_oracle, ids: list[int]) -> list[int]:
    out, past, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(MAX_NEW):
            res = hf_oracle(input_ids=step, past_key_values=past, use_cache=True)
            past, token = res.past_key_values, int(res.logits[0, -1].argmax())
            out.append(token)
            step = torch.tensor([[token]])
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)  # two cold whole-model compiles: ~100 s each on 2 quiet cores, more under load
def test_compiled_engine_matches_eager_and_hf(default_model, hf_oracle):
    # One compiled engine covers it all, against an eager engine without speculation. max_num_seqs=2: two
    # buckets (1, 2) to compile. 4 blocks of 16 tokens for two running sequences that each grow past 2
    # blocks: the scheduler must preempt; the second shared-prefix prompt hits the first one's cached system
    # prompt; n-gram speculation mixes verify steps (eager) with plain decode steps (compiled).
    options = {"num_blocks": 4, "block_size": 16, "max_num_seqs": 2}
    _eager, ids, expected = _run(default_model, PROMPTS, compile="off", **options)
    spec = RuntimeConfig(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1))
    llm, _, got = _run(default_model, PROMPTS, config=spec, compile="on", **options)
    compiled = llm.engine.runner.compiled
    assert compiled.buckets == (1, 2)
    assert got == expected
    assert compiled.num_steps > 0
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    # Verify steps ran: proposals were checked against the target and some were accepted.
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    for i, tokens in zip(ids, got[: len(ids)], strict=True):
        assert tokens == _hf_greedy(hf_oracle, i)


def test_lora_hooks_stay_out_of_the_compiled_graphs():
    """A server with LoRA on keeps compiled decode for steps without adapters: the graphs are traced with
    the hooks idle (no step batch), hold no LoRA work and give the plain model's logits; a step with an
    adapter runs eagerly with its delta, and the graphs are not recompiled for it."""
    from tokenfleet.kernels.lora import make_lora_batch
    from tokenfleet.runtime.model.lora_adapter import LoRAAdapterWeights, LoRAModule, projection_shapes
    from tokenfleet.runtime.model.lora_slots import LoRASlots

    model, block_size, num_blocks = _tiny_model("torch"), 16, 6
    slots = LoRASlots(model, max_loras=1, max_rank=4, dtype=torch.float32, device="cpu")
    model.lora = slots
    torch.manual_seed(1)
    shapes = projection_shapes(TINY)
    modules = {
        (layer, name): LoRAModule(torch.randn(4, shapes[name][0]), torch.randn(shapes[name][1], 4), 0.5)
        for layer in range(TINY.num_layers)
        for name in ("q_proj", "v_proj", "down_proj")
    }
    slots.load(0, LoRAAdapterWeights("mem", modules, "digest"))
    shape = (num_blocks + 1, block_size, TINY.num_kv_heads, TINY.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(TINY.num_layers)]
    compiled = CompiledDecode(
        model,
        caches,
        torch.device("cpu"),
        buckets=(1, 4),
        max_blocks_per_seq=4,
        scratch_slot=num_blocks * block_size,
        backend="eager",
    )
    try:
        compiled.warm_up()
        specs = [SeqSpec(20, 1, [3, 4]), SeqSpec(5, 1, [0]), SeqSpec(40, 1, [0, 1, 2])]
        ids, pos = torch.tensor([11, 22, 33]), torch.tensor([20, 5, 40])
        with torch.inference_mode():
            reference = [(k.clone(), v.clone()) for k, v in caches]
            meta = build_attention_metadata(specs, block_size)
            plain = model.compute_logits(model(ids, pos, reference, meta))
            slots.batch = make_lora_batch([0, -1, 0], "cpu")
            adapted = model.compute_logits(
                model(ids, pos, reference, build_attention_metadata(specs, block_size))
            )
            slots.batch = None
            got = compiled.logits(ids, pos, build_attention_metadata(specs, block_size))
        torch.testing.assert_close(got, plain, rtol=1e-3, atol=2e-3)
        assert not torch.allclose(adapted[0], plain[0], atol=1e-2)  # the adapter's rows do change
        torch.testing.assert_close(adapted[1], plain[1], rtol=1e-4, atol=1e-4)  # the base row does not
        assert compiled.num_graphs == 2  # one per bucket: the eager adapter step recompiled nothing
    finally:
        compiled.close()
        slots.detach()
