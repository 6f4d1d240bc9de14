"""Build the AttentionMetadata of one step from each sequence's (start position, new tokens, block ids)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenfleet.runtime.model.attention.base import AttentionMetadata


@dataclass(frozen=True, slots=True)
class SeqSpec:
    """One sequence's share of a step: tokens at positions `start_pos ... start_pos + num_new_tokens - 1`."""

    start_pos: int
    num_new_tokens: int
    block_ids: Sequence[int]  # physical blocks holding positions 0.. (at least the whole context)


def build_positions(seq_specs: Sequence[SeqSpec], device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [T]: the position of every new token, sequences concatenated in order."""
    parts = [torch.arange(s.start_pos, s.start_pos + s.num_new_tokens, dtype=torch.int64) for s in seq_specs]
    return torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.int64, device=device)


def build_attention_metadata(
    seq_specs: Sequence[SeqSpec], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    query_lens = tuple(s.num_new_tokens for s in seq_specs)
    seq_lens = tuple(s.start_pos + s.num_new_tokens for s in seq_specs)
    max_blocks = max((len(s.block_ids) for s in seq_specs), default=0)
    for spec, seq_len in zip(seq_specs, seq_lens, strict=True):
        # The engine allocates blocks before it schedules; a short table here is a bug upstream.
        if spec.num_new_tokens <= 0 or spec.start_pos < 0:
            raise ValueError(f"invalid sequence spec {spec}")
        if len(spec.block_ids) * block_size < seq_len:
            raise ValueError(f"{len(spec.block_ids)} blocks of {block_size} cannot hold {seq_len} tokens")

    # Built on the CPU in one go, then moved: a handful of small copies instead of per-token indexing.
    block_tables = torch.zeros((len(seq_specs), max(max_blocks, 1)), dtype=torch.int32)
    for row, spec in enumerate(seq_specs):
        block_tables[row, : len(spec.block_ids)] = torch.as_tensor(list(spec.block_ids), dtype=torch.int32)

    positions = build_positions(seq_specs)
    seq_index = torch.repeat_interleave(
        torch.arange(len(seq_specs)), torch.tensor(query_lens, dtype=torch.int64)
    )
    block_of_token = block_tables[seq_index, positions // block_size].to(torch.int64)
    slot_mapping = block_of_token * block_size + positions % block_size

    query_start_loc = torch.zeros(len(seq_specs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_lens=query_lens,
        seq_lens_list=seq_lens,
    )
