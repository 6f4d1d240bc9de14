"""The copies of the host KV tier: device KV blocks <-> host buffers, run once per step before the forward.

Host buffers mirror the device cache layout (per layer a K and a V tensor `[num_slots, block_size, Hkv, D]`,
same dtype), pinned on CUDA so the copies are DMA transfers. Consecutive transfers in one direction run as
one gather + one scatter per tensor; a run is cut where an index repeats, because `index_copy_` with
duplicate destinations has no defined winner and the recorded order must win.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenfleet.runtime.engine.kv_cache.offload import KVTransfer

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _runs(transfers: Sequence[KVTransfer]) -> list[tuple[bool, list[int], list[int]]]:
    """Split into (to_host, device ids, host slots) runs with one direction and no repeated index."""
    runs: list[tuple[bool, list[int], list[int]]] = []
    seen_dev: set[int] = set()
    seen_host: set[int] = set()
    for t in transfers:
        if not runs or runs[-1][0] != t.to_host or t.device_block_id in seen_dev or t.host_slot in seen_host:
            runs.append((t.to_host, [], []))
            seen_dev.clear()
            seen_host.clear()
        runs[-1][1].append(t.device_block_id)
        runs[-1][2].append(t.host_slot)
        seen_dev.add(t.device_block_id)
        seen_host.add(t.host_slot)
    return runs


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 caches are moved as bytes: index_copy_/index_select have no fp8 kernels on CPU."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


class HostKVBuffers:
    def __init__(self, kv_caches: KVCaches, num_slots: int):
        self._pin = kv_caches[0][0].device.type == "cuda"
        self.buffers = [(self._alloc(k, num_slots), self._alloc(v, num_slots)) for k, v in kv_caches]

    def _alloc(self, like: torch.Tensor, num_slots: int) -> torch.Tensor:
        return torch.zeros((num_slots, *like.shape[1:]), dtype=like.dtype, pin_memory=self._pin)

    @torch.inference_mode()
    def run(self, transfers: Sequence[KVTransfer], kv_caches: KVCaches) -> None:
        if not transfers:
            return
        device = kv_caches[0][0].device
        for to_host, dev_ids, host_slots in _runs(transfers):
            dev_idx = torch.tensor(dev_ids, dtype=torch.long, device=device)
            host_idx = torch.tensor(host_slots, dtype=torch.long)
            for dev_pair, host_pair in zip(kv_caches, self.buffers, strict=True):
                for dev_t, host_t in zip(dev_pair, host_pair, strict=True):
                    dev, host = _raw(dev_t), _raw(host_t)
                    if to_host:
                        host.index_copy_(0, host_idx, dev.index_select(0, dev_idx).cpu())
                    else:
                        src = host.index_select(0, host_idx).to(device, non_blocking=self._pin)
                        dev.index_copy_(0, dev_idx, src)

    @torch.inference_mode()
    def resize(self, moves: dict[int, int], num_slots: int) -> None:
        """New buffers of `num_slots`, keeping entry `old` at `moves[old]` (see HostKVTier.resize)."""
        old_idx = torch.tensor(list(moves), dtype=torch.long)
        new_idx = torch.tensor(list(moves.values()), dtype=torch.long)
        resized = []
        for pair in self.buffers:
            new_pair = []
            for old in pair:
                new = self._alloc(old, num_slots)
                if moves:
                    _raw(new).index_copy_(0, new_idx, _raw(old).index_select(0, old_idx))
                new_pair.append(new)
            resized.append((new_pair[0], new_pair[1]))
        self.buffers = resized
