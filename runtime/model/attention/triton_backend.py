"""Attention backend on the Triton kernels: cache write, paged decode, varlen prefill over a paged prefix.

A step mixes sequences with one new token (decode), a few (speculative verification) and many (prompt
chunks). Two kernels share one output tensor, each serving its own sequences through a `seq_ids` list, so
nothing is re-packed:
  - decode kernel for sequences with at most DECODE_MAX_QUERY_LEN new tokens: it packs the query heads of a
    KV head (x the query tokens) into one tile, so each K/V row is read once per KV head — decode is
    memory-bound, and this is where its bandwidth goes; long contexts split over several programs;
  - prefill kernel for the rest: flash attention tiled over queries, compute-bound; new K/V come from the
    step's tensors (contiguous, full precision), the cached prefix from the paged blocks.
The split is planned once per step from the metadata's host lists (no device sync) and reused by every layer.

FP8 (e4m3) caches store K/V divided by a per-tensor scale; without calibrated scales the scale is 1.0
(values beyond ±448 saturate), as in vLLM's default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenfleet.kernels import custom_ops  # noqa: F401 (registers tokenfleet::triton_paged_decode)
from tokenfleet.kernels.cache_ops import write_kv_cache
from tokenfleet.kernels.paged_attention import MAX_DECODE_ROWS, paged_decode_attention
from tokenfleet.kernels.prefill_attention import prefill_attention
from tokenfleet.runtime.model.attention.base import AttentionBackend, AttentionMetadata, DecodeMetadata

# 1 (decode) + up to 7 speculative tokens; longer chunks are prompt work and go to the prefill kernel.
DECODE_MAX_QUERY_LEN = 8


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """Which sequences each kernel serves in one step, with the bounds the launchers need."""

    decode_ids: torch.Tensor | None  # int32 [n_decode] batch indices, None when there are none
    decode_max_query_len: int
    decode_max_seq_len: int
    prefill_ids: torch.Tensor | None  # int32 [n_prefill]
    prefill_max_query_len: int


def plan_launches(meta: AttentionMetadata, queries_per_kv: int, device: torch.device) -> LaunchPlan:
    """Route each sequence to the decode or the prefill kernel (pure function of the host-side lists)."""
    decode, prefill = [], []
    for seq, q_len in enumerate(meta.query_lens):
        short = q_len <= DECODE_MAX_QUERY_LEN and q_len * queries_per_kv <= MAX_DECODE_ROWS
        (decode if short else prefill).append(seq)

    def ids(seqs: list[int]) -> torch.Tensor | None:
        return torch.tensor(seqs, dtype=torch.int32).to(device) if seqs else None

    return LaunchPlan(
        decode_ids=ids(decode),
        decode_max_query_len=max((meta.query_lens[s] for s in decode), default=0),
        decode_max_seq_len=max((meta.seq_lens_list[s] for s in decode), default=0),
        prefill_ids=ids(prefill),
        prefill_max_query_len=max((meta.query_lens[s] for s in prefill), default=0),
    )


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    traceable_decode = True  # DecodeMetadata steps go through tokenfleet::triton_paged_decode

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0):
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"KV-cache scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
        self._scale_values = (float(k_scale), float(v_scale))
        self._scales: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # Every layer of a step sees the same metadata object: plan once, launch many times.
        self._planned_for: AttentionMetadata | None = None
        self._plan: LaunchPlan | None = None

    def _fp8_scales(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._scales:
            k, v = self._scale_values
            self._scales[device] = (
                torch.tensor([k], dtype=torch.float32, device=device),
                torch.tensor([v], dtype=torch.float32, device=device),
            )
        return self._scales[device]

    def _plan_for(self, meta: AttentionMetadata, queries_per_kv: int, device: torch.device) -> LaunchPlan:
        if self._planned_for is not meta or self._plan is None:
            self._plan = plan_launches(meta, queries_per_kv, device)
            self._planned_for = meta
        return self._plan

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata | DecodeMetadata,
        scale: float,
        softcap: float | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        k_scale = v_scale = None
        if k_cache.dtype == torch.float8_e4m3fn:
            k_scale, v_scale = self._fp8_scales(q.device)
        if isinstance(meta, DecodeMetadata):
            return torch.ops.tokenfleet.triton_paged_decode(
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens,
                scale,
                k_scale,
                v_scale,
                softcap,
                sliding_window,
            )
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        plan = self._plan_for(meta, q.shape[1] // k.shape[1], q.device)
        out = torch.empty_like(q)
        common = {
            "block_tables": meta.block_tables,
            "seq_lens": meta.seq_lens,
            "query_start_loc": meta.query_start_loc,
            "scale": scale,
            "k_scale": k_scale,
            "v_scale": v_scale,
            "out": out,
            "softcap": softcap,
            "sliding_window": sliding_window,
        }
        if plan.decode_ids is not None:
            paged_decode_attention(
                q,
                k_cache,
                v_cache,
                seq_ids=plan.decode_ids,
                max_query_len=plan.decode_max_query_len,
                max_seq_len=plan.decode_max_seq_len,
                **common,
            )
        if plan.prefill_ids is not None:
            prefill_attention(
                q,
                k,
                v,
                k_cache,
                v_cache,
                seq_ids=plan.prefill_ids,
                max_query_len=plan.prefill_max_query_len,
                **common,
            )
        return out
