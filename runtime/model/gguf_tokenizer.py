"""Build a `tokenizers.Tokenizer` from GGUF metadata (llama.cpp's `tokenizer.ggml.*` keys).

GGUF files carry no tokenizer.json: the vocabulary, merges, token types and special ids are metadata, and
`tokenizer.ggml.pre` names the pre-tokenizer the vocabulary was trained with. Two tokenizer models
(`tokenizer.ggml.model`):
- `gpt2`: byte-level BPE, with the split rules of the original model (as llama.cpp applies them);
- `llama`: SentencePiece BPE (Llama 2, Mistral v0.1, Phi-3, Gemma): pieces spelled with `▁` for a space, one
  score per piece and no merges; a character outside the vocabulary falls back to its UTF-8 bytes
  (`<0xNN>` pieces). SentencePiece merges the adjacent pair whose joined piece scores best, which BPE with
  every split of every piece ranked by that piece's score reproduces (as transformers rebuilds it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenfleet.runtime.errors import ConfigError
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp token types
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the rest (controls, space, soft hyphen) are shifted to code points from 256 up, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    for offset, b in enumerate(shifted):
        mapping[b] = chr(256 + offset)
    return mapping


@functools.cache
def _byte_letters() -> frozenset[str]:
    return frozenset(byte_alphabet().values())


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    # SmolLM / StarCoder vocabularies were trained with every digit on its own.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


# Llama 3 splits numbers in groups of up to three; Qwen2 splits every digit.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> pre-tokenizer builder; anything unlisted falls back to GPT-2's byte-level regex.
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _byte_level,
    "gpt-2": _byte_level,
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
    "llama-bpe": _split_then_bytes(_LLAMA3_PATTERN),
    "llama3": _split_then_bytes(_LLAMA3_PATTERN),
    "qwen2": _split_then_bytes(_QWEN2_PATTERN),
}


def _byte_level_spelling(token: str) -> str:
    """Vocabulary entries in byte-level spelling; a few converters store raw UTF-8 text instead."""
    if set(token) <= _byte_letters():
        return token
    alphabet = byte_alphabet()
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: Sequence[str]) -> tokenizers.Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", ())]
    vocab = {_byte_level_spelling(tok): i for i, tok in enumerate(tokens)}
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    tokenizer.pre_tokenizer = PRE_TOKENIZERS.get(pre, _byte_level)()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, best joined score first (ties: shorter left part, then
    shorter right part, then the parts' ids), the order SentencePiece's BPE applies them in."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked: list[tuple[str, str, float]] = []
    for piece, score in dict(zip(tokens, scores, strict=True)).items():
        splits = [
            (piece[:i], piece[i:], float(score))
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        ranked += sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: id order within ties
    return [(left, right) for left, right, _ in ranked]


# SentencePiece vocabularies whose files need reading differently, by `general.architecture`.
_GEMMA = frozenset({"gemma", "gemma2", "gemma3"})


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: Sequence[str]) -> tokenizers.Tokenizer:
    architecture = metadata.get("general.architecture")
    scores = metadata.get("tokenizer.ggml.scores")
    if architecture in _GEMMA:
        # Gemma files store a piece of several spaces as real spaces, and its scores do not follow its
        # merge order: the pieces' order in the file does.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    if scores is None or len(scores) != len(tokens):
        raise ConfigError("GGUF SentencePiece tokenizer needs one tokenizer.ggml.scores entry per token")
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        merges = sentencepiece_merges(tokens, scores)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = tokenizers.Tokenizer(
        models.BPE(
            vocab={tok: i for i, tok in enumerate(tokens)},
            merges=merges,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # SentencePiece's dummy prefix: "▁" before the text (not before each piece between special tokens);
    # spaces become "▁" but the text is not split on them (pieces may span words). Gemma has no prefix.
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True)) and architecture not in _GEMMA
    if architecture == "phi3":
        # Phi-3's tokenizer.json prefixes the whole text with a normalizer (so "  hi" keeps three "▁"
        # where Metaspace would see an existing one and add none).
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False
        )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


# `tokenizer.ggml.model` -> builder of the base tokenizer (vocabulary, merges, pre-tokenizer, decoder), and
# whether it adds BOS when the file does not say (llama.cpp adds it for SentencePiece vocabularies).
TOKENIZER_MODELS: dict[
    str, tuple[Callable[[Mapping[str, Any], Sequence[str]], tokenizers.Tokenizer], bool]
] = {
    "gpt2": (_byte_level_bpe, False),
    "llama": (_sentencepiece_bpe, True),
}


def build_gguf_tokenizer(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    model_kind = metadata.get("tokenizer.ggml.model")
    if model_kind not in TOKENIZER_MODELS:
        raise ConfigError(
            f"GGUF tokenizer model {model_kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE)"
        )
    build, bos_by_default = TOKENIZER_MODELS[model_kind]
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    token_types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer = build(metadata, tokens)
    vocab = tokenizer.get_vocab()

    # Control tokens (<|im_start|>, <|endoftext|>) and user-defined ones must match whole in the text.
    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, token_types, strict=True)
        # Skip mislabelled ones outside the byte alphabet: adding them would grow the vocabulary.
        if kind == TOKEN_CONTROL and tok in vocab
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, token_types, strict=True)
        if kind == TOKEN_USER_DEFINED and tok in vocab
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)

    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", bos_by_default) and bos_id is not None
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False) and eos_id is not None
    if add_bos or add_eos:
        bos = f"{tokens[bos_id]} " if add_bos else ""
        eos = f" {tokens[eos_id]}" if add_eos else ""
        ids = ([(tokens[bos_id], bos_id)] if add_bos else []) + (
            [(tokens[eos_id], eos_id)] if add_eos else []
        )
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}$A{eos}", pair=f"{bos}$A{eos} {bos}$B{eos}", special_tokens=list(dict(ids).items())
        )
    return tokenizer


def gguf_eos_token_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    """EOS plus the end-of-turn / end-of-message ids llama.cpp also stops on."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return tuple(dict.fromkeys(int(metadata[k]) for k in keys if metadata.get(k) is not None))
