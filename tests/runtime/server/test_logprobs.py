"""Token rendering for logprobs: byte-level BPE pieces map back to their raw bytes."""

from __future__ import annotations

from tokenfleet.runtime.engine.outputs import TokenLogprobs
from tokenfleet.runtime.server.logprobs import TokenRenderer, byte_level_decoder, chat_logprobs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def test_byte_level_table_is_the_inverse_of_the_alphabet():
    table = byte_level_decoder()
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 32 and table["Ċ"] == 10 and table["a"] == 97


class _Wrapped:
    """The shape of tokenfleet.runtime.model.tokenizer.Tokenizer that the renderer relies on."""

    def __init__(self, backend: Tokenizer):
        self.backend = backend

    def decode(self, ids, skip_special_tokens=True):
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id):
        return self.backend.id_to_token(token_id)


def test_partial_utf8_token_reports_its_raw_bytes():
    # "é" is C3 A9 in UTF-8; a vocabulary that splits it gives each half its own token.
    table = {v: k for k, v in byte_level_decoder().items()}
    vocab = {table[0xC3]: 0, table[0xA9]: 1, "Ġhi": 2}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.ByteLevel()
    renderer = TokenRenderer(_Wrapped(backend))
    assert renderer.render(0)[1] == [0xC3]
    assert renderer.render(1)[1] == [0xA9]
    assert renderer.render(2) == (" hi", [32, 104, 105])
    out = chat_logprobs(renderer, [TokenLogprobs(0, float("-inf"), ((2, -0.1),))])
    assert out.content[0].bytes == [0xC3]
    assert out.content[0].logprob == -9999.0  # JSON has no -inf
    assert out.content[0].top_logprobs[0].token == " hi"
