"""The engine side of the cache policy: host-tier tensors, pinned-prefix prefill, live application.

`KVCacheManager` decides (TTL, eviction, pins, which blocks move between tiers); this class owns what
needs the model and its tensors, and runs on the engine thread only:
- the host tier: `HostKVTier` (bookkeeping, in the manager) + `HostKVBuffers` (host tensors) sized from
  `cache.cpu_offload_gib` and the bytes of one block; the manager runs the copies through it at the end
  of each call that records some (before any forward pass can write a reused block);
- pinned prefixes: each entry of `cache.pinned_prefixes` is a text (tokenized without added special
  tokens: write it as it starts the rendered prompt, e.g. "<|im_start|>system\\n...") or a list of token
  ids. A new pin is computed by a max_tokens=1 request; when it is freed the manager pins its full blocks.
  Constructing this class only queues those requests; at start-up `EngineCore.prefill_pins()` runs them.
  Pins no longer listed are released;
- `apply(cache)`: the live fields of a new CacheConfig (config reload; see config_watch.py).
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

from tokenfleet.runtime.config import CacheConfig
from tokenfleet.runtime.engine.kv_cache.offload import HostKVTier, KVTransfer
from tokenfleet.runtime.engine.kv_cache.offload_copy import HostKVBuffers
from tokenfleet.runtime.engine.kv_cache.pins import PinKey
from tokenfleet.runtime.engine.parallel.host_kv import (
    HostKVAlloc,
    HostKVCopy,
    HostKVFree,
    HostKVOp,
    HostKVResize,
)
from tokenfleet.runtime.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenfleet.runtime.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

PIN_REQUEST_PREFIX = "tokenfleet-pin-"  # internal requests; their outputs reach no client


def host_slots_for(cpu_offload_gib: float, bytes_per_block: int) -> int:
    return int(cpu_offload_gib * 2**30 // bytes_per_block)


class CachePolicyRuntime:
    def __init__(self, core: EngineCore):
        self._core = core
        self.host_buffers: HostKVBuffers | None = None
        self._pin_ids = itertools.count()
        self._bytes_per_block = sum(
            t[0].numel() * t.element_size() for pair in core.runner.kv_caches for t in pair
        )
        # Queues the prefill requests of new pins; the engine's owner runs them (`EngineCore.prefill_pins`).
        self.apply(core.config.cache)

    def _run_transfers(self, transfers: list[KVTransfer]) -> None:
        assert self.host_buffers is not None
        self.host_buffers.run(transfers, self._core.runner.kv_caches)
        self._mirror(HostKVCopy(tuple(transfers)))

    def _mirror(self, op: HostKVOp) -> None:
        """Tensor parallel: each rank holds its own heads' KV, so every host-tier operation rank 0 runs on
        its shard is replayed by the workers on theirs (with the next step; see parallel/host_kv.py)."""
        if self._core.workers is not None:
            self._core.workers.queue_host_kv(op)

    def apply(self, cache: CacheConfig) -> None:
        km = self._core.kv_manager
        km.apply_policy(cache)
        self._apply_offload(cache.cpu_offload_gib)
        if km.enable_caching:
            self._apply_pins(cache.pinned_prefixes)

    # ---- host tier --------------------------------------------------------------------------------------

    def _apply_offload(self, cpu_offload_gib: float) -> None:
        km = self._core.kv_manager
        num_slots = host_slots_for(cpu_offload_gib, self._bytes_per_block)
        if cpu_offload_gib > 0 and num_slots < 1:
            logger.warning(
                "cpu_offload_gib=%s holds no %d-byte block: offload stays off",
                cpu_offload_gib,
                self._bytes_per_block,
            )
        if num_slots < 1 or not km.enable_caching:
            if km.host is not None:
                logger.info("KV host tier off")
            km.attach_host_tier(None)
            if self.host_buffers is not None:
                self._mirror(HostKVFree())
            self.host_buffers = None
            return
        if km.host is None or self.host_buffers is None:
            host = HostKVTier(num_slots)
            self.host_buffers = HostKVBuffers(self._core.runner.kv_caches, num_slots)
            self._mirror(HostKVAlloc(num_slots))
            km.attach_host_tier(host, self._run_transfers)
        elif km.host.num_slots != num_slots:
            moves = km.host.resize(num_slots)
            self.host_buffers.resize(moves, num_slots)
            self._mirror(HostKVResize(moves, num_slots))
        else:
            return
        logger.info(
            "KV host tier: %d blocks (%.2f GiB)", num_slots, num_slots * self._bytes_per_block / 2**30
        )

    # ---- pins ---------------------------------------------------------------------------------------------

    def _pin_key(self, entry: str | tuple[int, ...]) -> PinKey:
        if isinstance(entry, str):
            return tuple(self._core.tokenizer.encode(entry, add_special_tokens=False))
        return tuple(entry)

    def _apply_pins(self, entries: tuple[str | tuple[int, ...], ...]) -> None:
        core = self._core
        pins = core.kv_manager.pins
        wanted = list(dict.fromkeys(self._pin_key(e) for e in entries))
        for key in pins.pin_keys():
            if key not in wanted:
                pins.unpin(key)
                logger.info("unpinned a prefix of %d tokens", len(key))
        held = set(pins.pin_keys())
        for key in wanted:
            if key in held:
                continue
            if len(key) <= core.kv_manager.block_size:
                logger.warning("pinned prefix of %d tokens fills no whole block: nothing to pin", len(key))
                continue
            request_id = f"{PIN_REQUEST_PREFIX}{next(self._pin_ids)}"
            pins.expect(request_id, key)
            # max_tokens=1: the prompt's KV is what a pin needs; the one sampled token is discarded.
            core.add_request(request_id, list(key), SamplingParams(max_tokens=1, temperature=0.0))
            logger.info("pinning a prefix of %d tokens (request %s)", len(key), request_id)
