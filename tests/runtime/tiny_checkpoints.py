"""Tiny random-weight Llama checkpoints that are NOT built-in models, in both formats tokenfleet serves:
an HF directory (safetensors + the built-in model's tokenizer, chat template and special tokens) and a GGUF
file (the same weights, the tokenizer as `tokenizer.ggml.*` metadata copied from the built-in GGUF).

Random weights generate nonsense quickly; what these exercise is everything around the model: loading from
a path, serving, and a router that must learn the tokenizer from the pod.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file
from tokenfleet.runtime.model.gguf_file import GGUFFile
from tokenfleet.runtime.model.gguf_loader import _GLOBAL_TENSORS, _LAYER_TENSORS

from .test_spec_decode_engine import write_tiny_llama


def write_hf_dir(directory: Path, base_gguf: Path, layers: int = 1, hidden: int = 64) -> Path:
    md = GGUFFile(base_gguf).metadata
    from tokenfleet.runtime.model.gguf_loader import load_gguf

    tok = load_gguf(base_gguf).tokenizer
    write_tiny_llama(directory, tok.vocab_size, tok.backend.to_str(), layers=layers, hidden=hidden)
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = md["tokenizer.ggml.eos_token_id"]
    config["bos_token_id"] = md["tokenizer.ggml.bos_token_id"]
    (directory / "config.json").write_text(json.dumps(config))
    tokens = md["tokenizer.ggml.tokens"]
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": md["tokenizer.chat_template"],
                "bos_token": tokens[md["tokenizer.ggml.bos_token_id"]],
                "eos_token": tokens[md["tokenizer.ggml.eos_token_id"]],
            }
        )
    )
    return directory


def write_gguf(path: Path, hf_dir: Path, base_gguf: Path) -> Path:
    """`hf_dir`'s weights as an F32 GGUF. Q/K rows are stored as they are (no llama.cpp RoPE permutation):
    with random weights the two files need not compute the same thing, only load and serve."""
    config = json.loads((hf_dir / "config.json").read_text())
    base = GGUFFile(base_gguf).metadata
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_vocab_size(config["vocab_size"])
    for key, value in base.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))
    to_gguf = {hf: g for g, hf in _GLOBAL_TENSORS.items()}
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if name in to_gguf:
            gname = to_gguf[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}." + next(g for g, hf in _LAYER_TENSORS.items() if hf == rest)
        w.add_tensor(gname, tensor.float().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
