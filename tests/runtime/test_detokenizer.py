"""IncrementalDetokenizer and stop strings, over real `tokenizers` tokenizers trained in the test session:
a byte-level BPE (GPT-2 / SmolLM2 style: emoji and CJK split across tokens) and a SentencePiece-style BPE
with byte fallback (Llama / Mistral style: "▁" word marks, <0xXX> byte tokens)."""

from __future__ import annotations

import json

import pytest
from tokenfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.stop_checker import find_stop, safe_length
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

CORPUS = [
    "The capital of France is a city on the Seine.",
    "Hello world!\n\nA new paragraph starts here.",
    "Paris, Berlin and Rome are capitals; Paris is the largest.",
    "Numbers: 1, 2, 3. The end.",
] * 10


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([*CORPUS, "emoji 😀 and 世界"] * 3, trainer)
    return tok


def _sentencepiece_like() -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=True))
    # No "▁" prepended: completions here start with their own space, as a model's continuation does.
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    # Newlines stay out of the learned vocabulary: they become <0x0A> byte tokens, one per "\n".
    tok.train_from_iterator([line.replace("\n", " ") for line in CORPUS], trainer)
    # The trainer knows nothing of byte fallback: add the 256 <0xXX> tokens, as Llama vocabularies have.
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok.model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True)
    return tok


@pytest.fixture(scope="session", params=["byte_level", "sentencepiece"])
def tokenizer(request) -> Tokenizer:
    return _byte_level() if request.param == "byte_level" else _sentencepiece_like()


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def stream(tok, prompt: str, completion: str, flush: bool = True, **params):
    """Feed the completion's tokens one by one; return (deltas, detokenizer, completion ids)."""
    detok = IncrementalDetokenizer(tok, ids_of(tok, prompt), SamplingParams(**params))
    completion_ids = ids_of(tok, completion)
    deltas = [detok.update([t]) for t in completion_ids]
    if flush:
        deltas.append(detok.flush())
    return deltas, detok, completion_ids


def expected_text(tok, prompt: str, completion_ids: list[int]) -> str:
    """What a full decode of prompt + completion shows after the prompt's own text."""
    prompt_ids = ids_of(tok, prompt)
    return tok.decode(prompt_ids + completion_ids)[len(tok.decode(prompt_ids)) :]


@pytest.mark.parametrize(
    "completion", [" Hello 😀 世界 and café!", "😀😀 crème brûlée 東京タワー 🇫🇷.", " plain text"]
)
def test_multibyte_characters_are_never_emitted_broken(tokenizer, completion):
    deltas, detok, ids = stream(tokenizer, "Say:", completion)
    split = [i for i in range(len(ids)) if "\ufffd" in tokenizer.decode(ids[: i + 1])]
    if completion != " plain text":
        assert split, "precondition: some character is split across tokens"
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == expected_text(tokenizer, "Say:", ids) == detok.output_text
    assert detok.stop_reason is None


def test_first_tokens_decode_in_the_prompts_context(tokenizer):
    # SentencePiece drops the leading "▁" at the start of a decode; inside the sequence it is a space.
    deltas, _, ids = stream(tokenizer, "The capital of France is", " Paris, Berlin")
    assert "".join(deltas) == expected_text(tokenizer, "The capital of France is", ids)
    assert "".join(deltas).startswith(" Paris")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(tokenizer, include):
    completion = " Hello world!\n\nA new paragraph starts here."
    ids = ids_of(tokenizer, completion)
    newline_tokens = [i for i in ids if "\n" in tokenizer.decode([i])]
    assert len(newline_tokens) == 2, "precondition: each newline is its own token"
    deltas, detok, _ = stream(
        tokenizer, "Q:", completion, flush=False, stop=["\n\n"], include_stop_str_in_output=include
    )
    text = "".join(deltas)
    assert detok.finished and detok.stop_reason == "\n\n"
    assert text == detok.output_text == (" Hello world!\n\n" if include else " Hello world!")
    # A client never saw the first "\n" before the stop was known (unless the stop is kept anyway).
    first_newline_step = ids.index(newline_tokens[0])
    assert "\n" not in "".join(deltas[: first_newline_step + 1]) or include
    assert detok.update(ids_of(tokenizer, " more")) == "" and detok.flush() == ""


def test_stop_string_split_by_tokenization(tokenizer):
    completion = " Paris is the largest. The end."
    assert len(ids_of(tokenizer, "Paris.")) > 1, "precondition: 'Paris.' is several tokens"
    deltas, detok, _ = stream(tokenizer, "Capital?", completion, flush=False, stop=["largest.", "Rome"])
    assert detok.stop_reason == "largest."
    assert "".join(deltas) == detok.output_text == " Paris is the "
    # Nothing after the stop string leaks, even though the same token may carry it.
    assert all("." not in d for d in deltas)


def test_held_back_text_is_released_when_no_stop_matches(tokenizer):
    completion = " Numbers: 1, 2, 3"
    deltas, detok, ids = stream(tokenizer, "Count:", completion, flush=False, stop=[", 3.", "zzz"])
    streamed = "".join(deltas)
    # ", 3" could still become ", 3." : held back; everything before it was streamed at once.
    assert streamed == " Numbers: 1, 2"
    tail = detok.flush()
    assert streamed + tail == expected_text(tokenizer, "Count:", ids) == detok.output_text
    assert detok.stop_reason is None and detok.finished


def test_earliest_stop_wins_and_min_tokens_delays_stops(tokenizer):
    completion = " Hello world!\n\nA new paragraph starts here."
    _, detok, _ = stream(tokenizer, "Q:", completion, flush=False, stop=["paragraph", "world"])
    assert detok.stop_reason == "world" and detok.output_text == " Hello "

    ids = ids_of(tokenizer, completion)
    world_end = next(i for i in range(len(ids)) if "world" in tokenizer.decode(ids[: i + 1]))
    _, detok, _ = stream(
        tokenizer, "Q:", completion, flush=False, stop=["world", "here"], min_tokens=world_end + 1
    )
    assert detok.stop_reason == "here"


def test_special_tokens_skipped_or_kept(tokenizer):
    special = tokenizer.token_to_id("<|im_end|>") or tokenizer.token_to_id("</s>")
    name = tokenizer.id_to_token(special)
    ids = [*ids_of(tokenizer, " Hello world"), special, *ids_of(tokenizer, " Rome")]
    for skip in (True, False):
        detok = IncrementalDetokenizer(
            tokenizer, ids_of(tokenizer, "Hi"), SamplingParams(skip_special_tokens=skip)
        )
        text = "".join(detok.update([t]) for t in ids) + detok.flush()
        assert (name in text) is not skip
        assert text.replace(name, "").replace("  ", " ").strip() == "Hello world Rome"


class _CountingTokenizer:
    """A real tokenizer, observed: records the length of every decode call."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.window_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.window_lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decoding_uses_a_short_window_not_the_whole_sequence(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    prompt = ids_of(tokenizer, "The capital of France is a city. " * 20)
    completion = ids_of(tokenizer, " Hello world! 😀 世界 Paris is the largest." * 10)
    detok = IncrementalDetokenizer(counting, prompt, SamplingParams())
    text = "".join(detok.update([t]) for t in completion) + detok.flush()
    assert text == expected_text(tokenizer, "The capital of France is a city. " * 20, completion)
    assert max(counting.window_lengths) <= 12  # context token(s) + one possibly split character
    assert len(counting.window_lengths) <= 2 * len(completion) + 1


def test_several_tokens_per_update_match_one_at_a_time(tokenizer):
    completion = " Hello 😀 world!\n\nParis is the largest."
    ids = ids_of(tokenizer, completion)
    detok = IncrementalDetokenizer(tokenizer, ids_of(tokenizer, "Q:"), SamplingParams(stop=["largest"]))
    text = "".join(detok.update(ids[i : i + 3]) for i in range(0, len(ids), 3))
    assert text == detok.output_text == " Hello 😀 world!\n\nParis is the "
    assert detok.num_output_tokens <= len(ids)


def test_stop_checker_rules():
    assert find_stop("abc\n\nd", ["\n\n"], new_start=4) == (3, "\n\n")
    assert find_stop("abc\n\nd", ["\n\n"], new_start=6) is None  # ended before the new text: seen already
    assert find_stop("xxstopyy", ["yy", "stop", "sto"], new_start=5) == (2, "stop")
    assert safe_length("Hello", ["\n\n"]) == 5
    assert safe_length("Hello\n", ["\n\n"]) == 5
    assert safe_length("Paris is the larg", ["largest.", "Rome"]) == len("Paris is the ")
    assert safe_length("ab", ["abcdef"]) == 0
