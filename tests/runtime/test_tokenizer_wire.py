"""The tokenizer a pod serves on /v1/tokenizer, rebuilt by a router: same token ids, same chat prompts.

Round trip: the pod's `Tokenizer` (GGUF-built and HF-file-built) -> wire payload (JSON) -> the router's
`Tokenizer`. The digest covers the content: an altered payload is refused.
"""

from __future__ import annotations

import pytest
from tokenfleet.runtime.model.gguf_loader import load_gguf
from tokenfleet.runtime.model.safetensors_loader import load_hf_dir
from tokenfleet.runtime.openai.tokenizer_wire import TokenizerPayload
from tokenfleet.runtime.router.pod_tokenizers import tokenizer_from_payload
from tokenfleet.runtime.server.tokenizer_endpoint import tokenizer_payload

from .tiny_checkpoints import write_gguf, write_hf_dir

TEXTS = [
    "Hello, world!",
    "numbers 1234567890 3.14",
    "unicode: café 日本語 🚀",
    "<|im_start|>user\nhi<|im_end|>",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there 42"}]


@pytest.fixture(scope="module")
def gguf_tokenizer(default_model_path):
    return load_gguf(default_model_path).tokenizer


def _round_trip(tok):
    wire = tokenizer_payload("m", tok).model_dump_json()
    payload = TokenizerPayload.model_validate_json(wire).verified()
    return payload, tokenizer_from_payload(payload)


def _assert_same(ours, theirs):
    for text in TEXTS:
        assert theirs.encode(text) == ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    assert theirs.apply_chat_template(CHAT) == ours.apply_chat_template(CHAT)
    assert theirs.eos_token_ids == ours.eos_token_ids


def test_gguf_tokenizer_round_trips(gguf_tokenizer):
    payload, rebuilt = _round_trip(gguf_tokenizer)
    assert payload.digest.startswith("sha256:") and payload.chat_template
    _assert_same(gguf_tokenizer, rebuilt)


def test_hf_dir_and_gguf_file_tokenizers_round_trip(gguf_tokenizer, default_model_path, tmp_path):
    """Models that are not built in: an HF directory and a GGUF file written from it."""
    directory = write_hf_dir(tmp_path / "hf", default_model_path)
    hf = load_hf_dir(directory).tokenizer
    _, rebuilt = _round_trip(hf)
    _assert_same(hf, rebuilt)
    _assert_same(gguf_tokenizer, rebuilt)  # the same tokenizer files: the same ids and chat prompts
    tiny = load_gguf(write_gguf(tmp_path / "tiny.gguf", directory, default_model_path)).tokenizer
    tiny_payload, tiny_rebuilt = _round_trip(tiny)
    _assert_same(tiny, tiny_rebuilt)
    assert tiny_payload.digest == tokenizer_payload("m", gguf_tokenizer).digest  # same metadata, same digest


def test_an_altered_payload_is_refused(gguf_tokenizer):
    payload = tokenizer_payload("m", gguf_tokenizer)
    assert payload.verified() is payload
    tampered = payload.model_copy(update={"chat_template": "{{ 'x' }}"})
    with pytest.raises(ValueError, match="digest mismatch"):
        tampered.verified()
    assert payload.model_copy(update={"model": "renamed"}).verified()  # the name is not content
