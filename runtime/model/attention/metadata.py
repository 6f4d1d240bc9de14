"""Build the AttentionMetadata of one step from each sequence's (start position, new tokens, block ids)."""

from __future__ import annotations

import dataclasses
import itertools
import operator
from array import array
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
    starts = [s.start_pos for s in seq_specs]
    query_lens = [s.num_new_tokens for s in seq_specs]
    return _positions(torch.tensor(starts, dtype=torch.int64), query_lens, sum(query_lens)).to(device)


def build_attention_metadata(
    seq_specs: Sequence[SeqSpec], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    meta, _ = build_step_metadata(
        [s.start_pos for s in seq_specs],
        [s.num_new_tokens for s in seq_specs],
        [s.block_ids for s in seq_specs],
        block_size,
    )
    return metadata_to(meta, device)


def build_step_metadata(
    starts: Sequence[int],
    query_lens: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    block_tables: torch.Tensor | None = None,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """CPU AttentionMetadata and int64 positions [T] of one step, from per-sequence lists (start position,
    new tokens, block table). `block_tables`: the same tables as an int32 [sequences, max blocks] tensor,
    zero-padded, when the caller keeps one across steps (`PersistentBlockTable`); else built here.

    Built with whole-batch tensor operations: per-sequence tensor calls (an arange, a row copy) cost a few
    microseconds each, which at hundreds of sequences made this the largest host cost of a decode step.
    """
    num_seqs = len(starts)
    query_lens = tuple(query_lens)
    seq_lens = tuple(map(operator.add, starts, query_lens))
    num_tokens = sum(query_lens)
    table_lens = list(map(len, block_ids))
    if num_seqs and (min(query_lens) <= 0 or min(starts) < 0):
        bad = next(i for i in range(num_seqs) if query_lens[i] <= 0 or starts[i] < 0)
        raise ValueError(f"invalid sequence spec: start {starts[bad]}, {query_lens[bad]} new tokens")
    for n, seq_len in zip(table_lens, seq_lens, strict=True):
        # The engine allocates blocks before it schedules; a short table here is a bug upstream.
        if n * block_size < seq_len:
            raise ValueError(f"{n} blocks of {block_size} cannot hold {seq_len} tokens")

    width = max(max(table_lens, default=0), 1)
    if block_tables is None:
        block_tables = block_table_tensor(block_ids, width)
    elif tuple(block_tables.shape) != (num_seqs, width):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} for {num_seqs} tables of {width} blocks")
    starts_t = torch.tensor(starts, dtype=torch.int64)
    positions = _positions(starts_t, query_lens, num_tokens)
    if num_tokens == num_seqs:  # all decodes: sequence i owns token i
        block_of_token = (
            block_tables[:, 0]
            if width == 1
            else block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        )
    else:
        seq_index = torch.repeat_interleave(
            torch.arange(num_seqs), torch.tensor(query_lens, dtype=torch.int64)
        )
        block_of_token = block_tables[seq_index, positions // block_size]
    slot_mapping = block_of_token.to(torch.int64) * block_size + positions % block_size

    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_lens=query_lens,
        seq_lens_list=seq_lens,
    )
    return meta, positions


def block_table_tensor(block_ids: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """int32 [len(block_ids), width]: each sequence's block ids, then zeros."""
    if not block_ids:
        return torch.zeros((0, width), dtype=torch.int32)
    pad = (0,) * width
    flat = array(
        "i", itertools.chain.from_iterable(itertools.chain(t, pad[: width - len(t)]) for t in block_ids)
    )
    return torch.frombuffer(flat, dtype=torch.int32).view(len(block_ids), width)


def _positions(starts: torch.Tensor, query_lens: Sequence[int], num_tokens: int) -> torch.Tensor:
    if num_tokens == len(query_lens):
        return starts.clone()
    lens = torch.tensor(query_lens, dtype=torch.int64)
    # Token t of sequence i sits at starts[i] + (t - first token of i).
    offsets = starts - (torch.cumsum(lens, 0) - lens)
    return torch.arange(num_tokens, dtype=torch.int64) + torch.repeat_interleave(offsets, lens)


def metadata_to(meta: AttentionMetadata, device: torch.device | str) -> AttentionMetadata:
    """The same metadata with its tensors on `device` (one host -> device copy; see `to_device`)."""
    slot_mapping, query_start_loc, seq_lens, block_tables = to_device(
        (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables), device
    )
    return dataclasses.replace(
        meta,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
    )


def to_device(tensors: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Integer CPU tensors moved to `device` in one asynchronous copy (same shapes and dtypes).

    On CUDA a plain `.to(device)` of pageable memory synchronises the stream: one per tensor, several per
    step, each leaving the host waiting. Instead they are packed into one pinned int64 buffer, copied
    without blocking (the pinned allocator keeps the buffer until the copy is done) and cut into views.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    packed = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
    if device.type == "cuda":
        packed = packed.pin_memory()
    on_device = packed.to(device, non_blocking=True)
    out = []
    offset = 0
    for t in tensors:
        n = t.numel()
        part = on_device[offset : offset + n].view(t.shape)
        out.append(part if t.dtype == torch.int64 else part.to(t.dtype))
        offset += n
    return out
