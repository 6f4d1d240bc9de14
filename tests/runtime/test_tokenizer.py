"""Our GGUF-built tokenizer and chat templates against HF transformers' tokenizer from the same file."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.errors import InvalidRequest
from tokenfleet.runtime.model.gguf_file import GGUFFile
from tokenfleet.runtime.model.gguf_tokenizer import build_gguf_tokenizer
from tokenfleet.runtime.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "unicode: café naïve 日本語のテキスト 한국어 emoji 🚀🎉 Ünïcödé",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # code\n",
    "special <|im_start|>user\nhi<|im_end|> <|endoftext|> inside text",
    "mixed   \u00a0non-breaking\u2009thin spaces, ‘quotes’ — dashes…",
    "",
    "I'm sure they'll've done it; we're isn't DON'T",
]


@pytest.fixture(scope="module")
def ours(default_model_path) -> Tokenizer:
    md = GGUFFile(default_model_path).metadata
    return Tokenizer(
        build_gguf_tokenizer(md),
        eos_token_ids=[md["tokenizer.ggml.eos_token_id"]],
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        chat_template=md["tokenizer.chat_template"],
    )


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(ours, hf_tokenizer, text):
    assert ours.encode(text) == hf_tokenizer(text)["input_ids"]


def test_decode_round_trips_and_skips_specials(ours, hf_tokenizer):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_vocab(ours, hf_tokenizer):
    assert ours.vocab_size == len(hf_tokenizer)
    assert ours.encode("<|im_end|>") == [2]
    assert ours.special_token_ids >= {0, 1, 2}
    assert ours.bos_token_id == hf_tokenizer.bos_token_id


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Write code:\n```py\nprint(1)\n```"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(ours, hf_tokenizer, messages, add_generation_prompt):
    rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert rendered == expected
    assert (
        ours.encode(rendered, add_special_tokens=False)
        == hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    )


def test_template_helpers_tojson_and_raise_exception():
    from tokenfleet.runtime.model.chat_template import render_chat_template

    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}{% if add_generation_prompt %}>{% endif %}"
    )
    messages = [{"role": "user", "content": "é"}]
    out = render_chat_template(
        template, messages, add_generation_prompt=True, special_tokens={"bos_token": "<s>"}
    )
    assert out == '<s>[{"role": "user", "content": "é"}]>'
    with pytest.raises(InvalidRequest, match="first message must be user"):
        render_chat_template(
            template, [{"role": "assistant", "content": "x"}], add_generation_prompt=False, special_tokens={}
        )


def test_sandbox_blocks_attribute_escape():
    from tokenfleet.runtime.model.chat_template import render_chat_template

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidRequest):
        render_chat_template(evil, [], add_generation_prompt=False, special_tokens={})
