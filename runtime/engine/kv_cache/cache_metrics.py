"""KVCacheMetrics: the cache policy's counters, one snapshot (EngineStats and /metrics read it).

Counts are in blocks. Lookups count once per request admission: each block of the longest prefix a
request could reuse is a device hit, a host hit (copied back instead of recomputed) or a miss.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheMetrics:
    device_hit_blocks: int
    host_hit_blocks: int
    miss_blocks: int
    evicted_ttl_blocks: int  # free cached blocks dropped because their TTL ran out
    evicted_pressure_blocks: int  # free cached blocks reused for new allocations
    pinned_blocks: int
    offloaded_blocks: int  # device -> host copies
    loaded_blocks: int  # host -> device copies
    host_evicted_blocks: int  # host entries dropped for room
    host_used_blocks: int
    host_total_blocks: int  # 0 when there is no host tier
