"""Which endpoint holds how much of a prompt: an exact index fed by KV events, an approximate one as fallback.

Block hashes are chained (h_i covers every token up to block i), so a pod can reuse block i only if it also
holds blocks 0..i-1: a pod's usable prefix is the run of *leading* hashes it holds, and the walk stops at the
first miss. Both indexes answer `match(hashes, endpoint_ids) -> {endpoint_id: num_leading_blocks}`.

- `ExactPrefixIndex`: the set of block hashes each pod reports cached (stored / removed / cleared events).
  It is as exact as the pod's own cache, with the lag of one event poll.
- `ApproximatePrefixIndex`: the router's own record of which prefixes it sent where, LRU-bounded. It stands
  in for pods whose event stream is unavailable; it cannot see evictions, so it only ages entries out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


def _leading_matches(hashes: Sequence[bytes], endpoint_ids: Iterable[str], holders) -> dict[str, int]:
    remaining = set(endpoint_ids)
    result = dict.fromkeys(remaining, 0)
    for i, h in enumerate(hashes):
        if not remaining:
            break
        have = holders(h)
        remaining = {e for e in remaining if e in have}
        for e in remaining:
            result[e] = i + 1
    return result


class ExactPrefixIndex:
    """block hash -> endpoints holding it, plus the reverse map so a `cleared` or a resync is O(own blocks)."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}

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
        empty: frozenset[str] = frozenset()
        return _leading_matches(hashes, endpoint_ids, lambda h: self._holders.get(h, empty))


class ApproximatePrefixIndex:
    """The router's own memory of routed prefixes: hash -> endpoints, least recently routed evicted first."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self._capacity = capacity_blocks
        self._entries: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, endpoint_id: str, hashes: Sequence[bytes]) -> None:
        """`endpoint_id` was sent this prompt: after it runs, the pod will have cached these blocks."""
        for h in hashes:
            holders = self._entries.get(h)
            if holders is None:
                self._entries[h] = {endpoint_id}
            else:
                holders.add(endpoint_id)
                self._entries.move_to_end(h)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def forget(self, endpoint_id: str) -> None:
        for h in [h for h, holders in self._entries.items() if endpoint_id in holders]:
            holders = self._entries[h]
            holders.discard(endpoint_id)
            if not holders:
                del self._entries[h]

    def match(self, hashes: Sequence[bytes], endpoint_ids: Iterable[str]) -> dict[str, int]:
        empty: frozenset[str] = frozenset()
        return _leading_matches(hashes, endpoint_ids, lambda h: self._entries.get(h, empty))
