"""MoE models: tiny random Mixtral / Qwen2-MoE (shared expert, a dense layer) / OLMoE (q-k norm, clip_qkv)
checkpoints match HF transformers, and the default model upcycled into identical experts reproduces the
dense model's greedy output exactly (a real-weights check of the whole MoE path)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenfleet.kernels.fp8_quant import FP8_DTYPE
from tokenfleet.runtime.config import ModelConfig
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model import load_model
from tokenfleet.runtime.model.attention import SeqSpec, build_attention_metadata, build_positions
from tokenfleet.runtime.model.attention.base import get_attention_backend
from tokenfleet.runtime.model.llama import LlamaForCausalLM
from tokenfleet.runtime.model.moe import MoEBlock
from tokenizers import Tokenizer as HFTokenizerBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

BLOCK_SIZE = 8
SMALL = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On the shared 2-core box two OpenMP threads contend with other processes (8x slower here)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(**SMALL, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)


def _qwen2_moe():
    from transformers import Qwen2MoeConfig

    # Layer 0 stays dense (mlp_only_layers); layer 1 has 5 routed experts, top-3 unnormalised, and a shared one.
    return Qwen2MoeConfig(
        **SMALL,
        intermediate_size=80,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        num_experts=5,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        mlp_only_layers=[0],
    )


def _olmoe():
    from transformers import OlmoeConfig

    return OlmoeConfig(
        **SMALL, intermediate_size=32, num_experts=6, num_experts_per_tok=2, clip_qkv=1.5, norm_topk_prob=True
    )


CASES = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "olmoe": _olmoe}


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    backend = HFTokenizerBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["mixture of experts routes each token to a few experts"] * 10, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    backend.save(str(path))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_json) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Each case saved once as safetensors (HF's per-expert names), with the HF model as the oracle."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    saved = {}
    for case, make_config in CASES.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_config()).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                # HF's init (std 0.02) makes router logits nearly equal: spread them so routing is decisive
                # and varied, and make the shared-expert gate and OLMoE's clamp actually matter.
                if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                    param.normal_(0.0, 0.5)
                elif name.endswith("proj.weight") and case == "olmoe":
                    param.normal_(0.0, 0.3)
        directory = tmp_path_factory.mktemp(case)
        model.save_pretrained(directory, safe_serialization=True)
        PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer_json), eos_token="<|endoftext|>"
        ).save_pretrained(directory)
        saved[case] = (directory, model)
    return saved


def _caches(arch, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]


@torch.inference_mode()
def _run(model: LlamaForCausalLM, token_ids: list[int], spans, caches, blocks) -> torch.Tensor:
    """Logits of every token, fed in `spans` (prefill chunk, then decode steps) through the paged cache."""
    logits = []
    for start, end in spans:
        specs = [SeqSpec(start, end - start, blocks)]
        meta = build_attention_metadata(specs, BLOCK_SIZE)
        ids = torch.tensor(token_ids[start:end])
        logits.append(model.compute_logits(model(ids, build_positions(specs), caches, meta)))
    return torch.cat(logits)


@torch.inference_mode()
def _greedy(model: LlamaForCausalLM, arch, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decode through the paged KV cache: (generated ids, the logits that chose them)."""
    total = len(prompt) + num_new
    blocks = list(range((total + BLOCK_SIZE - 1) // BLOCK_SIZE))[::-1]  # reversed: non-trivial block tables
    caches = _caches(arch, len(blocks))
    tokens, chosen = list(prompt), []
    start = 0
    while len(tokens) < total:
        logits = _run(model, tokens, [(start, len(tokens))], caches, blocks)[-1]
        chosen.append(logits)
        start = len(tokens)
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :], torch.stack(chosen)


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_moe_checkpoint_matches_transformers(case, checkpoints):
    directory, hf_model = checkpoints[case]
    loaded = load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))
    arch = loaded.arch
    layers = loaded.model.model.layers
    if case == "qwen2_moe":
        assert not isinstance(layers[0].mlp, MoEBlock) and isinstance(layers[1].mlp, MoEBlock)
        assert layers[1].mlp.shared_expert is not None
    else:
        assert all(isinstance(layer.mlp, MoEBlock) for layer in layers)

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, arch.vocab_size, (1, 24), generator=generator)
    with torch.inference_mode():
        ref = hf_model(ids).logits[0]
    # Prefill 17 tokens, then decode the rest one by one through the paged cache.
    spans = [(0, 17)] + [(p, p + 1) for p in range(17, ids.shape[1])]
    ours = _run(loaded.model, ids[0].tolist(), spans, _caches(arch, 4), [3, 0, 2])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

    # Greedy continuation equals HF's (recomputed from scratch each step: no shared cache logic).
    prompt = ids[0, :10].tolist()
    ours_ids, _ = _greedy(loaded.model, arch, prompt, 8)
    ref_ids = list(prompt)
    with torch.inference_mode():
        for _ in range(8):
            ref_ids.append(int(hf_model(torch.tensor([ref_ids])).logits[0, -1].argmax()))
    assert ours_ids == ref_ids[len(prompt) :]


def test_fp8_quantizes_experts_but_not_the_router(checkpoints):
    directory, _ = checkpoints["qwen2_moe"]
    config = dict(model=str(directory), dtype="float32")
    full = load_model(ModelConfig(**config), torch.device("cpu"))
    fp8 = load_model(ModelConfig(**config, quantization="fp8"), torch.device("cpu"))
    block = fp8.model.model.layers[1].mlp
    assert block.w13.dtype == FP8_DTYPE and block.w2.dtype == FP8_DTYPE
    assert block.w13_scale.shape == (5, 64) and block.w2_scale.shape == (5, 64)
    assert block.shared_expert.gate_up_proj.weight.dtype == FP8_DTYPE
    assert block.gate.weight.dtype == torch.float32 and block.shared_expert_gate.weight.dtype == torch.float32

    ids = list(range(5, 37))
    spans = [(0, len(ids))]
    ref = _run(full.model, ids, spans, _caches(full.arch, 4), [0, 1, 2, 3])
    out = _run(fp8.model, ids, spans, _caches(fp8.arch, 4), [0, 1, 2, 3])
    rel = (out - ref).norm() / ref.norm()
    assert 0 < rel < 0.05, f"fp8 relative logits error {rel:.4f}"


def _upcycled_weights(
    dense: LlamaForCausalLM, num_experts: int, router: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """The dense model's weights under HF names, its MLPs as Mixtral experts: every expert a copy of it."""
    arch = dense.arch
    for name, param in dense.named_parameters():
        head, _, tail = name.rpartition(".self_attn.qkv_proj.")
        if head:
            sizes = [arch.q_size, arch.kv_size, arch.kv_size]
            for proj, part in zip(("q", "k", "v"), param.split(sizes), strict=True):
                yield f"{head}.self_attn.{proj}_proj.{tail}", part
            continue
        head, _, proj = name.removesuffix(".weight").rpartition(".mlp.")
        if not head:
            yield name, param
            continue
        moe = f"{head}.block_sparse_moe"
        experts = (
            dict(zip(("w1", "w3"), param.chunk(2), strict=True)) if proj == "gate_up_proj" else {"w2": param}
        )
        for e in range(num_experts):
            for w, tensor in experts.items():
                yield f"{moe}.experts.{e}.{w}.weight", tensor
        if proj == "down_proj":
            yield f"{moe}.gate.weight", router[int(head.rsplit(".", 1)[1])]


def test_upcycled_default_model_reproduces_dense_greedy(default_model):
    """E identical experts with renormalised top-k weights compute the dense MLP, whatever the router says."""
    num_experts, top_k = 3, 2
    arch = dataclasses.replace(
        default_model.arch,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=default_model.arch.intermediate_size,
        norm_topk_prob=True,
    )
    router = torch.randn(
        arch.num_layers, num_experts, arch.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    moe_model = LlamaForCausalLM(arch, get_attention_backend("torch"), max_positions=512)
    moe_model.load_weights(_upcycled_weights(default_model.model, num_experts, router))
    moe_model.eval()
    assert all(isinstance(layer.mlp, MoEBlock) for layer in moe_model.model.layers)
    routed: set[tuple[int, ...]] = set()  # expert pairs layer 0 picked, to show the check is not vacuous

    def record(block, inputs, output):
        routed.update(map(tuple, block.gate(inputs[0]).topk(top_k, dim=-1).indices.sort(-1).values.tolist()))

    moe_model.model.layers[0].mlp.register_forward_hook(record)

    prompt = default_model.tokenizer.encode(
        default_model.tokenizer.apply_chat_template([{"role": "user", "content": "Name three planets."}])
    )
    dense_ids, dense_logits = _greedy(default_model.model, default_model.arch, prompt, 8)
    moe_ids, moe_logits = _greedy(moe_model, arch, prompt, 8)
    assert moe_ids == dense_ids
    torch.testing.assert_close(moe_logits, dense_logits, atol=2e-3, rtol=1e-4)
    assert len(routed) == 3  # tokens went to every pair of the 3 experts


def _tiny_moe_arch():
    from tokenfleet.runtime.model.arch import arch_from_hf_config

    return arch_from_hf_config(_mixtral().to_dict())


def test_expert_weights_are_checked_on_load():
    arch = _tiny_moe_arch()
    model = LlamaForCausalLM(arch, get_attention_backend("torch"))
    named = dict(_hf_named_tensors(model, arch))
    model.load_weights(named.items())  # complete: accepted
    # A missing expert projection is reported, not left as uninitialised memory.
    missing = {k: v for k, v in named.items() if k != "model.layers.1.block_sparse_moe.experts.3.w3.weight"}
    with pytest.raises(ConfigError, match=r"lacks weights for .*layers\.1\.mlp\.w13"):
        model.load_weights(missing.items())
    # An expert index the config does not have is an unexpected weight.
    extra = {**named, "model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.zeros(48, 64)}
    with pytest.raises(ConfigError, match="unexpected weight"):
        model.load_weights(extra.items())
    bad_shape = {**named, "model.layers.0.block_sparse_moe.experts.0.w2.weight": torch.zeros(64, 47)}
    with pytest.raises(ConfigError, match="checkpoint shape"):
        model.load_weights(bad_shape.items())


def _hf_named_tensors(model: LlamaForCausalLM, arch) -> Iterator[tuple[str, torch.Tensor]]:
    """A complete Mixtral-named checkpoint with random values for `model`'s shapes."""
    h, inter, kv = arch.hidden_size, arch.moe_intermediate_size, arch.kv_size
    yield "model.embed_tokens.weight", torch.randn(arch.vocab_size, h)
    yield "model.norm.weight", torch.ones(h)
    yield "lm_head.weight", torch.randn(arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", torch.ones(h)
        yield f"{p}.post_attention_layernorm.weight", torch.ones(h)
        for name, rows in (("q", arch.q_size), ("k", kv), ("v", kv)):
            yield f"{p}.self_attn.{name}_proj.weight", torch.randn(rows, h)
        yield f"{p}.self_attn.o_proj.weight", torch.randn(h, arch.q_size)
        yield f"{p}.block_sparse_moe.gate.weight", torch.randn(arch.num_experts, h)
        for e in range(arch.num_experts):
            yield f"{p}.block_sparse_moe.experts.{e}.w1.weight", torch.randn(inter, h)
            yield f"{p}.block_sparse_moe.experts.{e}.w3.weight", torch.randn(inter, h)
            yield f"{p}.block_sparse_moe.experts.{e}.w2.weight", torch.randn(h, inter)


def test_triton_backend_runs_the_moe_kernels(checkpoints):
    """attention_backend="triton" takes the MoE layers onto the Triton kernels too (the interpreter on CPU:
    fp16, as its bf16 is wrong); they agree with the torch-reference model."""
    directory, _ = checkpoints["qwen2_moe"]
    config = dict(model=str(directory), dtype="float16")
    ref = load_model(ModelConfig(**config, attention_backend="torch"), torch.device("cpu"))
    tri = load_model(ModelConfig(**config, attention_backend="triton"), torch.device("cpu"))
    assert tri.model.model.layers[1].mlp.kernel_backend == "triton"
    ids = list(range(3, 23))
    spans = [(0, 16), (16, 17), (17, 20)]
    caches = [(k.half(), v.half()) for k, v in _caches(ref.arch, 4)]
    expected = _run(ref.model, ids, spans, caches, [2, 0, 3])
    caches = [(k.half(), v.half()) for k, v in _caches(tri.arch, 4)]
    got = _run(tri.model, ids, spans, caches, [2, 0, 3])
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
