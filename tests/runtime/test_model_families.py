"""Qwen3 (per-head q/k norms), Qwen3-MoE, Phi-3 (fused q/k/v and gate/up tensors), Gemma 2 (sandwich
norms, GeGLU, scaled embeddings, soft-capped attention and logits, sliding window on alternate layers),
Gemma 3 (Gemma 2's layer with per-head (1 + weight) q/k norms, a second RoPE base for the sliding layers,
linear-scaled RoPE on the full ones; also the language model of a multimodal checkpoint), and Mistral and Qwen2
with the sliding windows their configs switch on (every layer; HF's max_window_layers rule): tiny
random checkpoints built from each family's HF config in a tmp dir load through `load_model` and generate
greedily exactly what HF transformers generates; checkpoints the runtime cannot reproduce are refused with a
message that says why.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenfleet.runtime.config import ModelConfig
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model import load_model
from tokenfleet.runtime.model.attention import SeqSpec, build_attention_metadata, build_positions
from tokenfleet.runtime.model.layers import GemmaRMSNorm
from tokenfleet.runtime.model.moe import MoEBlock
from tokenfleet.runtime.model.tensor_parallel import check_tensor_parallel
from tokenizers import Tokenizer as HFTokenizerBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

BLOCK_SIZE = 8
SMALL = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320
)
PROMPT_LEN, NEW_TOKENS = 10, 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On a shared small box two OpenMP threads contend with other processes (much slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _qwen3():
    from transformers import Qwen3Config

    # head_dim 32 != hidden / heads = 16: the q/k norms and o_proj see the config's head_dim, not a derived one.
    return Qwen3Config(**SMALL, intermediate_size=48, head_dim=32, tie_word_embeddings=True)


def _qwen3_bias():
    from transformers import Qwen3Config

    # attention_bias covers q, k, v *and* o in Qwen3.
    return Qwen3Config(**SMALL, intermediate_size=48, head_dim=32, attention_bias=True)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    # Layer 0 dense (mlp_only_layers), layer 1 five experts, top-2 renormalised, no shared expert.
    return Qwen3MoeConfig(
        **SMALL,
        intermediate_size=80,
        moe_intermediate_size=32,
        num_experts=5,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        head_dim=24,
    )


def _phi3():
    from transformers import Phi3Config

    return Phi3Config(**SMALL, intermediate_size=48, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _phi3_longrope():
    from transformers import Phi3Config

    # A long-context Phi-3 (LongRoPE, 64 -> 256 positions); served within its original 64 positions.
    half = SMALL["hidden_size"] // SMALL["num_attention_heads"] // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.4 * i for i in range(half)],
        "long_factor": [4.0 + i for i in range(half)],
        "original_max_position_embeddings": 64,
    }
    return Phi3Config(
        **SMALL,
        intermediate_size=48,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters=rope,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
    )


def _gemma2(**overrides):
    from transformers import Gemma2Config

    # Window 8 < the 10-token prompt: the sliding layers (HF default: even ones) drop keys from the start.
    # query_pre_attn_scalar 24 != head_dim 16, and caps low enough that capping bends the scores / logits.
    options = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=320,
        intermediate_size=48,
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Gemma2Config(**{**options, **overrides})


def _gemma2_layer_types():
    # Explicit layer_types (not HF's alternation), and no caps: the uncapped paths with a window.
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    return _gemma2(layer_types=types, attn_logit_softcapping=None, final_logit_softcapping=None)


GEMMA3_ROPE = {
    # Full layers: base 1000 and linear scaling; sliding layers: base 100 (HF's rope_local_base_freq).
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
}


def _gemma3(**overrides):
    from transformers import Gemma3TextConfig

    # Six layers and no layer_types: HF's default pattern, five sliding (window 8 < the prompt) then one
    # full. No caps (Gemma 3's defaults); query_pre_attn_scalar 24 != head_dim 16.
    options = dict(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=320,
        intermediate_size=48,
        sliding_window=8,
        query_pre_attn_scalar=24,
        rope_parameters=json.loads(json.dumps(GEMMA3_ROPE)),  # HF updates the dict it is given
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Gemma3TextConfig(**{**options, **overrides})


def _gemma3_layer_types():
    # Explicit layer_types, untied head, both caps set: the final one applies, the attention one is ignored
    # by HF's Gemma 3 (and so by us; the parity test shows it).
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    return _gemma3(
        num_hidden_layers=4,
        layer_types=types,
        tie_word_embeddings=False,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0,
    )


def _gemma3_multimodal():
    from transformers import Gemma3Config, SiglipVisionConfig

    # Gemma3ForConditionalGeneration: a (tiny) vision tower beside the language model, which is served.
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    return Gemma3Config(
        text_config=_gemma3(num_hidden_layers=3, sliding_window_pattern=2).to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=317,
        boi_token_index=318,
        eoi_token_index=319,
        eos_token_id=2,
    )


def _mistral_window():
    from transformers import MistralConfig

    # Window 6 on every layer, well inside the 10-token prompt: every step drops keys from the start.
    return MistralConfig(**SMALL, intermediate_size=48, sliding_window=6, bos_token_id=1, eos_token_id=2)


def _qwen2_window():
    from transformers import Qwen2Config

    # use_sliding_window with max_window_layers 1: layer 0 attends fully, layer 1 slides (HF's rule).
    return Qwen2Config(
        **SMALL, intermediate_size=48, use_sliding_window=True, sliding_window=6, max_window_layers=1
    )


CASES = {
    "gemma2": _gemma2,
    "mistral_window": _mistral_window,
    "qwen2_window": _qwen2_window,
    "gemma2_layer_types": _gemma2_layer_types,
    "gemma3": _gemma3,
    "gemma3_layer_types": _gemma3_layer_types,
    "gemma3_multimodal": _gemma3_multimodal,
    "qwen3": _qwen3,
    "qwen3_bias": _qwen3_bias,
    "qwen3_moe": _qwen3_moe,
    "phi3": _phi3,
    "phi3_longrope": _phi3_longrope,
}


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    backend = HFTokenizerBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["each model family normalises its heads in its own way"] * 10, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    backend.save(str(path))
    return path


def _save(model, directory: Path, tokenizer_json: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(directory, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), eos_token="<|endoftext|>").save_pretrained(
        directory
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_json) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Each case saved once as safetensors under HF's own names, with the HF model as the oracle."""
    from transformers import AutoModelForCausalLM

    saved = {}
    for case, make_config in CASES.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_config()).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                # HF's init leaves norms at 1 and biases at 0 (a missing norm or bias would go unnoticed)
                # and makes logits nearly equal: perturb them so each part changes the greedy choice.
                if name.endswith("norm.weight"):
                    param.normal_(1.0, 0.3)  # Gemma's zero-centred norms then scale by ~2
                elif name.endswith(".bias"):
                    param.normal_(0.0, 0.2)
                elif name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, 0.5)  # decisive, varied routing
                else:
                    param.normal_(0.0, 0.15)
        directory = tmp_path_factory.mktemp(case)
        _save(model, directory, tokenizer_json)
        saved[case] = (directory, model)
    return saved


def _caches(arch, num_blocks: int, device=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    return [
        (torch.zeros(shape, device=device), torch.zeros(shape, device=device)) for _ in range(arch.num_layers)
    ]


@torch.inference_mode()
def _greedy(model, arch, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """Prefill, then one decode step per token through the paged KV cache: (new ids, every step's logits)."""
    total = len(prompt) + num_new
    blocks = list(range((total + BLOCK_SIZE - 1) // BLOCK_SIZE))[::-1]  # reversed: non-trivial block table
    device = model.lm_head.weight.device
    caches = _caches(arch, len(blocks), device)
    tokens, step_logits, start = list(prompt), [], 0
    while len(tokens) < total:
        specs = [SeqSpec(start, len(tokens) - start, blocks)]
        meta = build_attention_metadata(specs, BLOCK_SIZE, device)
        inputs = torch.tensor(tokens[start:], device=device)
        hidden = model(inputs, build_positions(specs, device), caches, meta)
        logits = model.compute_logits(hidden)[-1].cpu()
        step_logits.append(logits)
        start = len(tokens)
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :], torch.stack(step_logits)


@torch.inference_mode()
def _hf_greedy(hf_model, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation, each step recomputed from scratch (no cache logic shared with ours)."""
    tokens, step_logits = list(prompt), []
    for _ in range(num_new):
        logits = hf_model(torch.tensor([tokens])).logits[0, -1]
        step_logits.append(logits)
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :], torch.stack(step_logits)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_matches_transformers(case, checkpoints):
    directory, hf_model = checkpoints[case]
    loaded = load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))
    arch = loaded.arch
    if case == "qwen3_moe":
        layers = loaded.model.model.layers
        assert not isinstance(layers[0].mlp, MoEBlock) and isinstance(layers[1].mlp, MoEBlock)
        assert layers[1].mlp.shared_expert is None
    if case.startswith(("qwen3", "gemma3")):
        assert arch.head_qk_norm and loaded.model.model.layers[0].self_attn.q_norm.weight.shape == (
            arch.head_dim,
        )
    if case.startswith("gemma3"):
        # Sliding layers rotate with their own table, full layers with the (scaled) global one.
        model = loaded.model.model
        assert isinstance(model.layers[0].self_attn.q_norm, GemmaRMSNorm)
        for i, layer in enumerate(model.layers):
            sliding = arch.layer_window(i) is not None
            assert layer.self_attn.rotary is (model.sliding_rotary if sliding else model.rotary)
        assert {arch.layer_window(i) for i in range(arch.num_layers)} == {8, None}
        assert arch.text_of_multimodal == (case == "gemma3_multimodal")

    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, arch.vocab_size, (PROMPT_LEN,), generator=generator).tolist()
    ours, our_logits = _greedy(loaded.model, arch, prompt, NEW_TOKENS)
    ref, ref_logits = _hf_greedy(hf_model, prompt, NEW_TOKENS)
    assert ours == ref
    torch.testing.assert_close(our_logits, ref_logits, atol=1e-4, rtol=1e-4)
    # Not vacuous: the continuation is not one token repeated, and every step's winner is clear of the
    # runner-up by more than the tolerance (so agreement is not luck between near-equal logits).
    assert len(set(ours)) > 2
    top2 = ref_logits.topk(2, dim=-1).values
    assert bool(((top2[:, 0] - top2[:, 1]) > 1e-3).all())
    # Logits written into a caller's buffer (the runner's on CPU) are the very same bits, softcap included.
    assert loaded.model.logits_into_buffer
    hidden = torch.randn((5, arch.hidden_size), generator=generator)
    buffer = torch.full((8, arch.vocab_size), float("nan"))
    into = loaded.model.compute_logits(hidden, out=buffer[:5])
    assert into.data_ptr() == buffer.data_ptr() and torch.equal(into, loaded.model.compute_logits(hidden))


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
def test_per_head_norm_weights_change_the_output(checkpoints, tmp_path, tokenizer_json, case):
    """The q/k norm weights are really applied per head: scaling one head's slot changes the logits."""
    directory, _ = checkpoints[case]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    weights = load_file(str(directory / "model.safetensors"))
    weights["model.layers.0.self_attn.q_norm.weight"] = weights["model.layers.0.self_attn.q_norm.weight"] * 3
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    base = load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))
    changed = load_model(ModelConfig(model=str(tmp_path), dtype="float32"), torch.device("cpu"))
    prompt = list(range(3, 3 + PROMPT_LEN))
    _, a = _greedy(base.model, base.arch, prompt, 1)
    _, b = _greedy(changed.model, changed.arch, prompt, 1)
    assert (a - b).abs().max() > 1e-2


def _copy_with_config(directory: Path, target: Path, **overrides) -> Path:
    for path in directory.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    config.update(overrides)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("case", "overrides", "tensor"),
    [
        # The config says 1 KV head; the checkpoint's k projection has rows for 2.
        ("qwen3", {"num_key_value_heads": 1}, "model.layers.0.self_attn.k_proj.weight"),
        # Phi-3 stores q/k/v fused: the error names the fused tensor.
        ("phi3", {"num_key_value_heads": 4}, "model.layers.0.self_attn.qkv_proj.weight"),
        ("phi3", {"intermediate_size": 40}, "model.layers.0.mlp.down_proj.weight"),
        ("qwen3_moe", {"moe_intermediate_size": 16}, "model.layers.1.mlp.experts.0.down_proj.weight"),
    ],
)
def test_config_contradicting_the_weights_names_the_tensor(checkpoints, tmp_path, case, overrides, tensor):
    directory = _copy_with_config(checkpoints[case][0], tmp_path, **overrides)
    with pytest.raises(ConfigError, match=re.escape(tensor) + ": checkpoint shape"):
        load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))


def test_unsupported_architecture_lists_the_supported_ones(checkpoints, tmp_path):
    directory = _copy_with_config(checkpoints["phi3"][0], tmp_path, model_type="gpt_neox")
    with pytest.raises(ConfigError) as error:
        load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))
    message = str(error.value)
    assert "'gpt_neox'" in message
    for supported in ("llama", "qwen3", "qwen3_moe", "phi3", "mixtral"):
        assert f"'{supported}'" in message


def test_phi3_longrope_serves_its_original_context_only(checkpoints):
    """Within the original context HF uses the short factors for every position (the parity test above);
    past it HF re-rotates every cached position, so a longer max_model_len is refused."""
    directory = str(checkpoints["phi3_longrope"][0])
    loaded = load_model(ModelConfig(model=directory, dtype="float32"), torch.device("cpu"))
    assert loaded.max_model_len == 64 and loaded.arch.rope_scaling.rope_type == "longrope"
    with pytest.raises(ConfigError, match="max_model_len 128 exceeds the model's context length 64"):
        load_model(ModelConfig(model=directory, dtype="float32", max_model_len=128), torch.device("cpu"))


def test_unknown_rope_scaling_is_refused(checkpoints, tmp_path):
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    directory = _copy_with_config(checkpoints["phi3"][0], tmp_path, rope_parameters=rope)
    with pytest.raises(ConfigError, match=r"unsupported rope scaling type 'dynamic'.*longrope"):
        load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))


def test_partial_rotary_is_refused(checkpoints, tmp_path):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    directory = _copy_with_config(checkpoints["phi3"][0], tmp_path, rope_parameters=rope)
    with pytest.raises(ConfigError, match=r"partial_rotary_factor 0\.75"):
        load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))


def test_tensor_parallel_accepts_qwen3_and_refuses_fused_phi3(checkpoints):
    qwen3 = load_model(ModelConfig(model=str(checkpoints["qwen3"][0]), dtype="float32"), "cpu").arch
    check_tensor_parallel(qwen3, 2)  # per-head norms follow the heads: nothing to refuse
    phi3 = load_model(ModelConfig(model=str(checkpoints["phi3"][0]), dtype="float32"), "cpu").arch
    with pytest.raises(ConfigError, match="phi3 checkpoints"):
        check_tensor_parallel(phi3, 2)


@pytest.mark.parametrize(
    "overrides",
    [
        {"sliding_window": 4096},  # every window wider than the context: full attention everywhere
        {"layer_types": ["full_attention"] * 4},
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
        {"query_pre_attn_scalar": 16},  # head_dim's scale
    ],
)
def test_each_gemma2_feature_changes_the_logits(checkpoints, tmp_path, overrides):
    """Each option the parity test exercises is really applied: turning it off moves the logits."""
    directory, _ = checkpoints["gemma2"]
    changed_dir = _copy_with_config(directory, tmp_path, **overrides)
    base = load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))
    changed = load_model(ModelConfig(model=str(changed_dir), dtype="float32"), torch.device("cpu"))
    prompt = list(range(3, 3 + PROMPT_LEN))
    _, a = _greedy(base.model, base.arch, prompt, 1)
    _, b = _greedy(changed.model, changed.arch, prompt, 1)
    assert (a - b).abs().max() > 1e-2


def test_gemma2_arch_windows_and_context():
    from tokenfleet.runtime.model.arch import arch_from_hf_config

    arch = arch_from_hf_config(_gemma2().to_dict())
    # HF: even layers slide; the window is applied per layer, so it does not cap the context.
    assert arch.layer_windows == (8, None, 8, None) and arch.all_layers_window is None
    assert arch.tie_word_embeddings and arch.hidden_act == "gelu_pytorch_tanh"
    assert arch.attention_scale == 24**-0.5 and arch.embed_scale == 8.0
    with pytest.raises(ConfigError, match="hidden_activation 'gelu'"):
        arch_from_hf_config({**_gemma2().to_dict(), "hidden_activation": "gelu"})
    with pytest.raises(ConfigError, match="layer_types"):
        arch_from_hf_config({**_gemma2().to_dict(), "layer_types": ["sliding_attention"] * 3})


@pytest.mark.parametrize(
    ("config", "windows"),
    [
        ({"model_type": "mistral", "sliding_window": 6}, (6, 6, 6, 6)),
        ({"model_type": "mistral", "sliding_window": None}, ()),
        (
            {"model_type": "mixtral", "sliding_window": 6, "num_local_experts": 4, "num_experts_per_tok": 2},
            (6,) * 4,
        ),
        ({"model_type": "phi3", "sliding_window": 6}, (6, 6, 6, 6)),
        # A window as wide as the context hides nothing: full attention.
        ({"model_type": "mistral", "sliding_window": 256}, ()),
        # Qwen: the window is used only with use_sliding_window; HF's default layer rules.
        ({"model_type": "qwen2", "sliding_window": 6}, ()),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2},
            (None, None, 6, 6),
        ),
        (
            {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0},
            (6,) * 4,
        ),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 6,
                "layer_types": ["full_attention", "sliding_attention"] * 2,
            },
            (None, 6, None, 6),
        ),
        (
            {
                "model_type": "qwen2_moe",
                "use_sliding_window": True,
                "sliding_window": 6,
                "max_window_layers": 3,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
            },
            (6, None, 6, None),
        ),
        (
            {
                "model_type": "qwen3_moe",
                "use_sliding_window": True,
                "sliding_window": 6,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
            },
            (6,) * 4,
        ),
    ],
)
def test_configured_windows_follow_transformers(config, windows):
    """HF's per-layer rule for each family that makes the window a config option; the window never caps the
    context."""
    from tokenfleet.runtime.model.arch import arch_from_hf_config
    from tokenfleet.runtime.model.loader import resolve_max_model_len

    base = dict(SMALL, num_hidden_layers=4, intermediate_size=48, max_position_embeddings=256)
    arch = arch_from_hf_config({**base, **config})
    assert arch.layer_windows == windows
    assert arch.all_layers_window == (6 if windows and None not in windows else None)
    assert resolve_max_model_len(arch, None) == 256


def test_configured_window_layer_types_are_checked():
    from tokenfleet.runtime.model.arch import arch_from_hf_config

    config = dict(SMALL, intermediate_size=48, model_type="qwen2", use_sliding_window=True, sliding_window=6)
    with pytest.raises(ConfigError, match="qwen2 layer_types"):
        arch_from_hf_config({**config, "layer_types": ["sliding_attention"] * 3})


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_gemma_through_the_engine_matches_transformers(checkpoints, case):
    """Paged KV in 8-token blocks, prompts (13..30 tokens, all longer than the window) prefilled in chunks of
    at most 7 tokens beside other requests' decodes, then a prefix-cache hit: HF's tokens, every one."""
    from tokenfleet.runtime.config import RuntimeConfig
    from tokenfleet.runtime.engine.llm import LLM
    from tokenfleet.runtime.engine.sampling_params import SamplingParams

    directory, hf_model = checkpoints[case]
    loaded = load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))
    assert loaded.max_model_len == 256  # not capped to the window
    generator = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(3, loaded.arch.vocab_size, (n,), generator=generator).tolist() for n in (13, 21, 30)
    ]
    prompts.append(prompts[2][:24] + prompts[0][:5])  # shares three 8-token blocks with prompts[2]
    expected = [_hf_greedy(hf_model, p, NEW_TOKENS)[0] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    llm = LLM(config=RuntimeConfig(), loaded=loaded, dtype="float32", block_size=8, max_num_batched_tokens=7)
    outs = llm.generate(prompts[:3], params)
    assert [o.outputs[0].token_ids for o in outs] == expected[:3]
    assert llm.engine.stats().num_steps > NEW_TOKENS + 3  # the prompts really went in chunks
    hit = llm.generate(prompts[3:], params)[0]
    assert hit.outputs[0].token_ids == expected[3]
    assert hit.num_cached_tokens >= 16


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_gemma_on_the_triton_kernels_matches_transformers(checkpoints, case):
    """The same greedy parity with the Triton attention backend (the interpreter on CPU): the kernels'
    softcap (Gemma 2) and window paths inside the real model, prefill then decode over the paged cache."""
    directory, hf_model = checkpoints[case]
    config = ModelConfig(model=str(directory), dtype="float32", attention_backend="triton")
    loaded = load_model(config, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    assert loaded.attention_backend == "triton"
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, loaded.arch.vocab_size, (PROMPT_LEN,), generator=generator).tolist()
    ours, our_logits = _greedy(loaded.model, loaded.arch, prompt, NEW_TOKENS)
    ref, ref_logits = _hf_greedy(hf_model, prompt, NEW_TOKENS)
    assert ours == ref
    torch.testing.assert_close(our_logits, ref_logits, atol=1e-4, rtol=1e-4)


def _gemma3_rope(full: dict | None = None, sliding: dict | None = None) -> dict:
    return {
        "full_attention": {**GEMMA3_ROPE["full_attention"], **(full or {})},
        "sliding_attention": {**GEMMA3_ROPE["sliding_attention"], **(sliding or {})},
    }


@pytest.mark.parametrize(
    ("case", "overrides"),
    [
        ("gemma3", {"rope_parameters": _gemma3_rope(sliding={"rope_theta": 1000.0})}),  # one base for all
        ("gemma3", {"rope_parameters": _gemma3_rope(full={"rope_type": "default", "factor": None})}),
        ("gemma3", {"sliding_window": 4096}),  # every window wider than the context
        ("gemma3", {"layer_types": ["full_attention"] * 6}),
        ("gemma3", {"query_pre_attn_scalar": 16}),  # head_dim's scale
        ("gemma3_layer_types", {"final_logit_softcapping": None}),
    ],
)
def test_each_gemma3_feature_changes_the_logits(checkpoints, tmp_path, case, overrides):
    """Each option the Gemma 3 parity tests exercise is really applied: turning it off moves the logits."""
    directory, _ = checkpoints[case]
    changed_dir = _copy_with_config(directory, tmp_path, **overrides)
    base = load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))
    changed = load_model(ModelConfig(model=str(changed_dir), dtype="float32"), torch.device("cpu"))
    prompt = list(range(3, 3 + PROMPT_LEN))
    _, a = _greedy(base.model, base.arch, prompt, 1)
    _, b = _greedy(changed.model, changed.arch, prompt, 1)
    assert (a - b).abs().max() > 1e-2


def test_gemma3_config_reading():
    from tokenfleet.runtime.model.arch import RopeScaling, arch_from_hf_config

    arch = arch_from_hf_config(_gemma3().to_dict())
    # HF's default pattern: every sixth layer attends fully; windows applied per layer, context not capped.
    assert arch.layer_windows == (8, 8, 8, 8, 8, None) and arch.all_layers_window is None
    assert arch.max_position_embeddings == 256 and arch.tie_word_embeddings and arch.head_qk_norm
    assert arch.attention_scale == 24**-0.5 and arch.embed_scale == 8.0
    assert arch.attn_logit_softcap is None and arch.final_logit_softcap is None
    assert (arch.rope_theta, arch.rope_scaling) == (1000.0, RopeScaling("linear", 2.0))
    assert (arch.sliding_rope_theta, arch.sliding_rope_scaling) == (100.0, None)
    assert [arch.uses_sliding_rope(i) for i in range(6)] == [True] * 5 + [False]
    capped = arch_from_hf_config(_gemma3_layer_types().to_dict())
    assert capped.final_logit_softcap == 4.0 and capped.attn_logit_softcap is None  # as HF: unused

    # Hub configs written before transformers 5: rope_theta / rope_scaling / rope_local_base_freq and a
    # sliding_window_pattern instead of layer_types. The same model.
    legacy = {k: v for k, v in _gemma3().to_dict().items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(
        rope_theta=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_local_base_freq=100.0,
        sliding_window_pattern=6,
    )
    assert arch_from_hf_config(legacy) == arch
    # A minimal hub config: Gemma3TextConfig's class defaults fill what it leaves out.
    minimal = arch_from_hf_config({"model_type": "gemma3_text", "num_hidden_layers": 7})
    assert (minimal.vocab_size, minimal.hidden_size, minimal.head_dim, minimal.num_kv_heads) == (
        262_208,
        2304,
        256,
        4,
    )
    assert (minimal.rope_theta, minimal.sliding_rope_theta, minimal.rope_scaling) == (1e6, 1e4, None)
    assert minimal.layer_windows == (4096,) * 5 + (None, 4096)
    assert minimal.attention_scale == 256**-0.5 and minimal.eos_token_ids == (1,)

    # No layer slides: no window needed, one RoPE table in use.
    full = arch_from_hf_config(
        {**_gemma3().to_dict(), "sliding_window": None, "layer_types": ["full_attention"] * 6}
    )
    assert full.layer_windows == (None,) * 6 and not any(full.uses_sliding_rope(i) for i in range(6))

    # A multimodal config: its text_config, served as the language model alone.
    multimodal = arch_from_hf_config(_gemma3_multimodal().to_dict())
    assert multimodal.text_of_multimodal and multimodal.model_type == "gemma3"
    assert multimodal.layer_windows == (8, None, 8) and multimodal.eos_token_ids == (2,)

    base = _gemma3().to_dict()
    refused = [
        ({**base, "hidden_activation": "gelu"}, "unsupported gemma3 hidden_activation 'gelu'"),
        ({**base, "use_bidirectional_attention": True}, "use_bidirectional_attention is unsupported"),
        ({**base, "layer_types": ["sliding_attention"] * 3}, "gemma3 layer_types must list"),
        ({**base, "layer_types": ["chunked_attention"] * 6}, "gemma3 layer_types must list"),
        ({**base, "sliding_window": 0}, "gemma3 sliding_window must be >= 1"),
        ({**base, "sliding_window": None}, "gemma3 with sliding_attention layers needs a sliding_window"),
        (
            {**base, "rope_parameters": _gemma3_rope(full={"rope_type": "dynamic"})},
            "unsupported rope scaling type 'dynamic'",
        ),
        ({"model_type": "gemma3", "vision_config": {}}, "gemma3 config has no text_config"),
        (
            {"model_type": "gemma3", "text_config": {**base, "model_type": "gemma2"}},
            "gemma3 text_config of model_type 'gemma2' is unsupported",
        ),
    ]
    for config, message in refused:
        with pytest.raises(ConfigError, match=re.escape(message)):
            arch_from_hf_config(config)


def test_gemma3_multimodal_checkpoint_serves_its_language_model(checkpoints, tmp_path):
    """HF saves Gemma3ForConditionalGeneration under the hub's names (`language_model.model.`, `vision_tower.`);
    transformers >= 5 names the same tensors `model.language_model.` / `model.vision_tower.` in memory. Both
    layouts load the language model (every tensor: load_model refuses a missing one) and skip the vision
    tower and projector, giving the same logits."""
    directory, _ = checkpoints["gemma3_multimodal"]
    stored = load_file(str(directory / "model.safetensors"))
    assert any(name.startswith("vision_tower.") for name in stored)
    assert any(name.startswith("multi_modal_projector.") for name in stored)
    assert any(name.startswith("language_model.model.layers.") for name in stored)
    renamed = {
        re.sub(r"^language_model\.model\.", "model.language_model.", name)
        .replace("vision_tower.", "model.vision_tower.", 1)
        .replace("multi_modal_projector.", "model.multi_modal_projector.", 1): tensor
        for name, tensor in stored.items()
    }
    assert not any(name.startswith("language_model.") for name in renamed)
    _copy_with_config(directory, tmp_path)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hub = load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))
    v5 = load_model(ModelConfig(model=str(tmp_path), dtype="float32"), torch.device("cpu"))
    prompt = list(range(3, 3 + PROMPT_LEN))
    _, a = _greedy(hub.model, hub.arch, prompt, 1)
    _, b = _greedy(v5.model, v5.arch, prompt, 1)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
