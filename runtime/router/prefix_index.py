"""Which endpoint holds how much of a prompt: an exact index fed by KV events, an approximate one as fallback.

Block hashes are chained (h_i covers every token up to block i), so a pod can reuse block i only if it also
holds blocks 0..i-1: a pod's usable prefix is the run of *leading* hashes it holds, and the walk stops at the
first miss. Both indexes answer `match(hashes, endpoint_ids) -> {endpoint_id: num_leading_blocks}`.

- `ExactPrefixIndex`: the set of block hashes each pod reports cached (stored / removed / cleared events).
  It is as exact as the pod's own cache, with the lag of one event poll.
- `ApproximatePrefixIndex`: the router's own record of which prefixes it sent where, LRU-bounded. It stands
  in for pods whose event stream is unavailable; it cannot see evictions, so it only ages entries out.
- `RecentRoutes`: what the router sent where in the last seconds. A pod announces blocks only once their KV
  is computed, and a long prefill takes seconds (tens on CPU): requests sharing a prefix that arrive
  meanwhile must follow the first one instead of spreading over every pod. The exact index answers for what
  pods hold; this one only bridges that lag, so its entries expire, and a pod's are dropped as soon as that
  pod reports an eviction (from then on its events alone say what it holds).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

_NOBODY: frozenset[str] = frozenset()


def _leading_matches(
    hashes: Sequence[bytes], endpoint_ids: Iterable[str], holders: Mapping[bytes, AbstractSet[str]]
) -> dict[str, int]:
    """endpoint -> how many leading blocks of `hashes` it holds (`holders`: block hash -> endpoints).
    Runs for every routed request, several times: an endpoint's count is written once, when its run
    ends, a block every remaining endpoint holds (the usual case deep in a shared prefix) costs one
    C-level subset test, and a block's holders are one C-level lookup, not a Python call."""
    remaining = set(endpoint_ids)
    result = dict.fromkeys(remaining, 0)
    get = holders.get
    for i, h in enumerate(hashes):
        have = get(h, _NOBODY)
        if remaining <= have:
            continue
        for e in remaining - have:
            result[e] = i
        remaining &= have
        if not remaining:
            return result
    n = len(hashes)
    for e in remaining:
        result[e] = n
    return result


class ExactPrefixIndex:
    """block hash -> endpoints holding it, plus the reverse map so a `cleared` or a resync is O(own blocks)."""

    def __init__(self, on_removal: Callable[[str], None] | None = None) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}
        # Told which endpoint lost blocks (RecentRoutes.forget: after an eviction only events count).
        self._on_removal = on_removal

    def stored(self, endpoint_id: str, hashes: Iterable[bytes]) -> None:
        own = self._blocks.setdefault(endpoint_id, set())
        for h in hashes:
            own.add(h)
            self._holders.setdefault(h, set()).add(endpoint_id)

    def removed(self, endpoint_id: str, hashes: Iterable[bytes]) -> None:
        own = self._blocks.get(endpoint_id)
        if own is None:
            return
        hashes = list(hashes)
        own.difference_update(hashes)
        self._drop_holder(endpoint_id, hashes)

    def clear(self, endpoint_id: str) -> None:
        """Forget everything about an endpoint (its cache was cleared, it left, or its stream is stale)."""
        self._drop_holder(endpoint_id, self._blocks.pop(endpoint_id, set()))

    def _drop_holder(self, endpoint_id: str, hashes: Iterable[bytes]) -> None:
        hashes = list(hashes)
        if hashes and self._on_removal is not None:
            self._on_removal(endpoint_id)
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(endpoint_id)
                if not holders:
                    del self._holders[h]

    def replace(self, endpoint_id: str, hashes: Iterable[bytes]) -> None:
        """Resync: the endpoint's full set of cached blocks, replacing what was known."""
        self.clear(endpoint_id)
        self.stored(endpoint_id, hashes)

    def num_blocks(self, endpoint_id: str) -> int:
        return len(self._blocks.get(endpoint_id, ()))

    def match(self, hashes: Sequence[bytes], endpoint_ids: Iterable[str]) -> dict[str, int]:
        return _leading_matches(hashes, endpoint_ids, self._holders)


class ApproximatePrefixIndex:
    """The router's own memory of routed prefixes: hash -> endpoints, least recently routed evicted first.

    Keeps the reverse map too: `forget` runs on every eviction a pod reports, and must cost what that pod
    has here, not a scan of the whole index."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self._capacity = capacity_blocks
        self._entries: OrderedDict[bytes, set[str]] = OrderedDict()
        self._by_endpoint: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, endpoint_id: str, hashes: Sequence[bytes]) -> None:
        """`endpoint_id` was sent this prompt: after it runs, the pod will have cached these blocks.

        Runs for every routed request over all its blocks: the per-block work is two C calls."""
        entries = self._entries
        get, move_to_end = entries.get, entries.move_to_end
        for h in hashes:
            holders = get(h)
            if holders is None:
                entries[h] = {endpoint_id}
            else:
                holders.add(endpoint_id)
                move_to_end(h)
        self._by_endpoint.setdefault(endpoint_id, set()).update(hashes)
        while len(self._entries) > self._capacity:
            h, holders = self._entries.popitem(last=False)
            for e in holders:
                self._by_endpoint[e].discard(h)

    def forget(self, endpoint_id: str) -> None:
        for h in self._by_endpoint.pop(endpoint_id, ()):
            holders = self._entries[h]
            holders.discard(endpoint_id)
            if not holders:
                del self._entries[h]

    def match(self, hashes: Sequence[bytes], endpoint_ids: Iterable[str]) -> dict[str, int]:
        return _leading_matches(hashes, endpoint_ids, self._entries)


class RecentRoutes:
    """Prefixes routed within the last `ttl_s` (up to 2 * `ttl_s`): two generations of an approximate index,
    the older dropped whole at each rotation, so expiry costs nothing per entry."""

    def __init__(
        self, capacity_blocks: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._capacity = capacity_blocks
        self._ttl_s = ttl_s
        self._clock = clock
        self._current = ApproximatePrefixIndex(capacity_blocks)
        self._previous = ApproximatePrefixIndex(capacity_blocks)
        self._rotated_at = clock()

    def _rotate(self) -> None:
        now = self._clock()
        elapsed = now - self._rotated_at
        if elapsed < self._ttl_s:
            return
        fresh = ApproximatePrefixIndex(self._capacity)
        self._previous = (
            self._current if elapsed < 2 * self._ttl_s else ApproximatePrefixIndex(self._capacity)
        )
        self._current = fresh
        self._rotated_at = now

    def record(self, endpoint_id: str, hashes: Sequence[bytes]) -> None:
        self._rotate()
        self._current.record(endpoint_id, hashes)

    def forget(self, endpoint_id: str) -> None:
        self._current.forget(endpoint_id)
        self._previous.forget(endpoint_id)

    def match(self, hashes: Sequence[bytes], endpoint_ids: Iterable[str]) -> dict[str, int]:
        self._rotate()
        ids = list(endpoint_ids)
        current = self._current.match(hashes, ids)
        previous = self._previous.match(hashes, ids)
        return {e: max(current[e], previous[e]) for e in ids}
