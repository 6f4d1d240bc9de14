"""Tokenizer: a `tokenizers.Tokenizer` plus what serving needs from the checkpoint (EOS ids, chat template)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenfleet.runtime.errors import InvalidRequest
from tokenfleet.runtime.model.chat_template import render_chat_template


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Iterable[int],
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, tok in added.items() if tok.special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in the text (`<|im_start|>`) become their ids, as in HF tokenizers.

        `add_special_tokens` adds what the checkpoint's post-processor adds (e.g. BOS); chat prompts are
        rendered with their special tokens already in the text and should pass False.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if self.chat_template is None:
            raise InvalidRequest("this model has no chat template; use the completions API", param="messages")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens={"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""},
            **extra,
        )
