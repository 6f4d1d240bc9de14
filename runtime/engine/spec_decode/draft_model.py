"""Draft-model proposer: a smaller checkpoint with the same tokenizer, with its own paged KV cache.

The draft cache mirrors the target's slot for slot: same block ids, same block size, its own tensors
(`[num_blocks, block_size, draft_kv_heads, draft_head_dim]` per draft layer). The invariant that makes it
correct under every scheduler feature at once — chunked prefill, prefix caching, preemption, rejection:

    every forward pass of the target is replayed by the draft with the same tokens, positions and slots
    (`observe`), so draft KV is valid exactly where target KV is valid.

A prefix-cache hit on a block therefore hits the draft's KV for that block too (whoever computed the
block ran both models over it), and rolled-back slots are stale for both and rewritten before use.
Drafting itself (`greedy_draft`) writes draft KV at the proposed positions; the next replay overwrites them.
The price of the replay is one draft forward over the target's batch per step — the draft is small.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenfleet.runtime.config import ModelConfig, SpeculativeConfig
from tokenfleet.runtime.engine.spec_decode.greedy_draft import greedy_draft
from tokenfleet.runtime.engine.spec_decode.proposer import ProposalInput, Proposer, register
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.attention.base import AttentionMetadata
from tokenfleet.runtime.model.llama import KVCache
from tokenfleet.runtime.model.loader import LoadedModel, load_model

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Same tokenizer vocabulary (ids mean the same text) and a context at least as long as the target's."""
    t_vocab, d_vocab = target.tokenizer.vocab_size, draft.tokenizer.vocab_size
    if t_vocab != d_vocab:
        raise ConfigError(
            f"draft tokenizer has {d_vocab} tokens, the target's {t_vocab}: not the same tokenizer"
        )
    probe = list(range(0, t_vocab, max(1, t_vocab // 997)))
    if [target.tokenizer.id_to_token(i) for i in probe] != [draft.tokenizer.id_to_token(i) for i in probe]:
        raise ConfigError("the draft model's tokenizer maps ids to different tokens than the target's")
    if draft.arch.vocab_size < t_vocab:
        raise ConfigError(f"draft embedding has {draft.arch.vocab_size} rows < {t_vocab} tokens")
    if draft.max_model_len < target.max_model_len:
        raise ConfigError(
            f"draft context length {draft.max_model_len} < the target's max_model_len {target.max_model_len}"
        )


class DraftModelProposer(Proposer):
    writes_kv = True

    def __init__(self, draft: LoadedModel, target_vocab: int, device: torch.device):
        self.draft = draft
        self.model = draft.model
        self.device = device
        self.target_vocab = target_vocab
        self.kv_caches: list[KVCache] = []
        self._block_size = 0

    def kv_bytes_per_block(self, block_size: int) -> int:
        arch = self.draft.arch
        elem = torch.empty((), dtype=self.draft.dtype).element_size()
        return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem

    def bind(self, kv_caches: list[KVCache], num_blocks: int, block_size: int) -> None:
        arch = self.draft.arch
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        dtype = self.draft.dtype
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(arch.num_layers)
        ]
        self._block_size = block_size

    @torch.inference_mode()
    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        self.model(input_ids, positions, self.kv_caches, meta)

    def propose(self, batch: Sequence[ProposalInput]) -> list[list[int]]:
        if not self.kv_caches:
            raise RuntimeError("DraftModelProposer used before bind()")
        return greedy_draft(
            self.model, self.kv_caches, batch, self._block_size, self.device, vocab_limit=self.target_vocab
        )


@register("draft")
def _build(config: SpeculativeConfig, target: LoadedModel, device: torch.device) -> Proposer:
    if not config.draft_model:
        raise ConfigError("speculative.method 'draft' needs speculative.draft_model")
    draft_config = ModelConfig(
        model=config.draft_model,
        dtype=_DTYPE_NAMES[target.dtype],  # type: ignore[arg-type]
        max_model_len=target.max_model_len,
        device=device.type,  # type: ignore[arg-type]
        attention_backend=target.attention_backend,  # type: ignore[arg-type]
    )
    draft = load_model(draft_config, device)
    check_compatible(target, draft)
    return DraftModelProposer(draft, target.arch.vocab_size, device)
