"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018) for session affinity.

A session key maps to a point on a ring of virtual nodes; it goes to the first node clockwise whose load is
below `ceil((1 + epsilon) * (total_load + 1) / num_nodes)`. Sessions stay put while their pod is not
overloaded (cache reuse), no pod takes more than (1 + epsilon) times the average (no hot spot), and adding or
removing a pod moves only the keys that hashed to it. The hash is blake2b: stable across router replicas.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping


def _point(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "big")


class BoundedLoadRing:
    def __init__(self, nodes: Iterable[str], vnodes: int = 64) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.nodes = tuple(sorted(set(nodes)))
        ring = sorted((_point(f"{node}#{i}"), node) for node in self.nodes for i in range(vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [n for _, n in ring]

    def capacity(self, total_load: int, epsilon: float) -> int:
        return math.ceil((1.0 + epsilon) * (total_load + 1) / max(len(self.nodes), 1))

    def lookup(self, key: str, loads: Mapping[str, int] | None = None, epsilon: float = 0.25) -> str | None:
        """The node for `key`; with `loads`, skip nodes at capacity. None only when there are no nodes."""
        if not self.nodes:
            return None
        loads = loads or {}
        cap = self.capacity(sum(loads.get(n, 0) for n in self.nodes), epsilon) if loads else None
        start = bisect.bisect_left(self._points, _point(key)) % len(self._points)
        seen: set[str] = set()
        for step in range(len(self._points)):
            node = self._owners[(start + step) % len(self._points)]
            if node in seen:
                continue
            seen.add(node)
            if cap is None or loads.get(node, 0) < cap:
                return node
            if len(seen) == len(self.nodes):
                break
        # Unreachable in theory (the capacity bound guarantees a node below it); stay total anyway.
        return min(self.nodes, key=lambda n: loads.get(n, 0))
