"""Tiny random HF checkpoints (Llama, Mistral, Qwen2 + bias, sharded, tied, llama3 RoPE) load and match
transformers, prefill and decode through the paged KV cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenfleet.runtime.config import ModelConfig
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model import load_model
from tokenfleet.runtime.model.attention import SeqSpec, build_attention_metadata, build_positions
from tokenizers import Tokenizer as HFTokenizerBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

BLOCK_SIZE = 8
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=320)


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{**SMALL, "num_key_value_heads": 2, **kw})


def _mistral(**kw):
    from transformers import MistralConfig

    return MistralConfig(**{**SMALL, "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 64, **kw})


def _qwen2(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(**{**SMALL, "num_key_value_heads": 2, "rope_theta": 1e6, **kw})


CASES = {
    "llama": (_llama, {}),
    "llama-tied": (_llama, {"tie_word_embeddings": True}),
    "llama-llama3-rope": (
        _llama,
        {
            "max_position_embeddings": 256,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "llama-sharded": (_llama, {}),
    "mistral": (_mistral, {}),
    "qwen2-bias": (_qwen2, {}),
}


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    """A small byte-level BPE trained on the spot, with ChatML special tokens."""
    backend = HFTokenizerBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "serving models on kubernetes",
        "def f(x): return x",
    ]
    backend.train_from_iterator(corpus * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    backend.save(str(path))
    return path


def _save(case: str, directory: Path, tokenizer_json: Path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    make_config, overrides = CASES[case]
    config = make_config(bos_token_id=1, eos_token_id=2, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if case == "qwen2-bias":  # random init leaves biases at zero; make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    max_shard = "40KB" if case == "llama-sharded" else "50GB"
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard)
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json), bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_transformers(case, tmp_path, tokenizer_json):
    hf_model = _save(case, tmp_path, tokenizer_json)
    if case == "llama-sharded":
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1

    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32"), torch.device("cpu"))
    arch = loaded.arch
    assert arch.tie_word_embeddings == (case == "llama-tied")
    if case == "mistral":
        # The window is applied on every layer, not a cap on the context.
        assert (
            arch.layer_windows == (64, 64) and loaded.max_model_len == hf_model.config.max_position_embeddings
        )
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, arch.vocab_size, (1, 40), generator=generator)
    with torch.inference_mode():
        ref = hf_model(ids).logits[0]

    shape = (16, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]
    blocks = [9, 4, 12, 1, 7, 3]
    prompt_len = 33
    logits = []
    with torch.inference_mode():
        # Prefill 33 tokens, then decode the remaining 7 one by one through the paged cache.
        spans = [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, ids.shape[1])]
        for start, end in spans:
            specs = [SeqSpec(start, end - start, blocks)]
            meta = build_attention_metadata(specs, BLOCK_SIZE)
            hidden = loaded.model(ids[0, start:end], build_positions(specs), caches, meta)
            logits.append(loaded.model.compute_logits(hidden))
    ours = torch.cat(logits)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

    tok = loaded.tokenizer
    assert tok.eos_token_ids >= {2}
    messages = [{"role": "user", "content": "serving the fox"}]
    assert (
        tok.apply_chat_template(messages)
        == "<|im_start|>user\nserving the fox<|im_end|>\n<|im_start|>assistant\n"
    )


def test_pickle_checkpoints_are_refused(tmp_path, tokenizer_json):
    (tmp_path / "config.json").write_text(json.dumps(_llama().to_dict()))
    (tmp_path / "tokenizer.json").write_text(tokenizer_json.read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match="pickle"):
        load_model(ModelConfig(model=str(tmp_path)), torch.device("cpu"))


def test_unknown_model_and_too_long_context(tmp_path, tokenizer_json):
    with pytest.raises(ConfigError, match="built-in name"):
        load_model(ModelConfig(model=str(tmp_path / "nowhere")), torch.device("cpu"))
    _save("llama", tmp_path, tokenizer_json)
    with pytest.raises(ConfigError, match="exceeds"):
        load_model(ModelConfig(model=str(tmp_path), max_model_len=10**6), torch.device("cpu"))
