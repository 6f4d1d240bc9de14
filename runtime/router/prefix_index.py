"""Which endpoint holds how much of a prompt: an exact index fed by KV events, an approximate one as fallback.

Block hashes are chained (h_i covers every token up to block i), so a pod can reuse block i only if it also
holds blocks 0..i-1: a pod's usable prefix is the run of *leading* hashes it holds, and the walk stops at the
first miss. Every index answers `match(hashes, endpoint_ids) -> {endpoint_id: num_leading_blocks}`.

- `ExactPrefixIndex`: the set of block hashes each pod reports cached (stored / removed / cleared events).
  It is as exact as the pod's own cache, with the lag of one event poll.
- `ApproximatePrefixIndex`: the router's own record of which prefixes it sent where, LRU-bounded. It stands
  in for pods whose event stream is unavailable; it cannot see evictions, so it only ages entries out.
- `RecentRoutes`: what the router sent where in the last seconds. A pod announces blocks only once their KV
  is computed, and a long prefill takes seconds (tens on CPU): requests sharing a prefix that arrive
  meanwhile must follow the first one instead of spreading over every pod. The exact index answers for what
  pods hold; this one only bridges that lag, so its entries expire, and a pod's are dropped as soon as that
  pod reports an eviction (from then on its events alone say what it holds). It runs on every routed
  request, so it keeps routes in a trie of their shared paths (no entry per block: a route is held by
  reference, or its own part as pointers) and matches by walking the prompt's path once (see the class).

Representation (exact and approximate): block hash -> an int bitset of endpoint *slots* (`EndpointSlots`: a small
integer per endpoint, the lowest free one reused). A match is one pass over the prompt's blocks for all
endpoints together, O(prompt blocks) and not O(blocks x endpoints): the running AND of the blocks' holder
sets (C-level `map` + `accumulate`), whose value only ever loses bits and so only decreases; each endpoint's
leading run ends where its bit leaves, found by bisection. The pass stops as soon as no queried endpoint is
left, in chunks that grow 4x, so a prompt nobody holds costs one small chunk. A bitset is one int per block
(small for up to ~60 endpoints) instead of a set of endpoint names per block, roughly halving the memory per
(block, endpoint) (bench/router_pick.py prints it). Removal costs O(removed blocks): the reverse map
endpoint -> own blocks makes `clear`/`forget` cost what that endpoint holds.
"""

from __future__ import annotations

import heapq
import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import reduce
from itertools import accumulate, compress, islice, repeat
from itertools import count as count_from
from operator import and_, neg, or_, xor

_FIRST_CHUNK = 64
# A chunk's leaving bits are found by a full diff pass while it is at most this many blocks per endpoint
# still matching, else by bisection (measured: the diff wins at 1k-token prompts, bisection at 240k).
_DIFF_PER_BIT = 8


class EndpointSlots:
    """endpoint id <-> bit position in the holder bitsets; the lowest free slot is reused so bitsets stay small."""

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self.bits: dict[str, int] = {}  # endpoint id -> 1 << slot, for a C-level mask of the asked endpoints
        self.owners: list[str | None] = []  # slot -> endpoint id
        self._free: list[int] = []

    def bit(self, endpoint_id: str) -> int:
        """The endpoint's bit, allocating a slot for a new endpoint."""
        slot = self._slot.get(endpoint_id)
        if slot is None:
            if self._free:
                slot = heapq.heappop(self._free)
                self.owners[slot] = endpoint_id
            else:
                slot = len(self.owners)
                self.owners.append(endpoint_id)
            self._slot[endpoint_id] = slot
            self.bits[endpoint_id] = 1 << slot
        return 1 << slot

    def known_bit(self, endpoint_id: str) -> int:
        slot = self._slot.get(endpoint_id)
        return 0 if slot is None else 1 << slot

    def release(self, endpoint_id: str) -> None:
        """Only once no bitset carries the endpoint's bit any more (a reused slot must start empty)."""
        self.reuse(self.retire(endpoint_id))

    def retire(self, endpoint_id: str) -> int:
        """Forget which endpoint the slot was but keep it taken (bitsets still carry its bit): its bit, or 0
        if unknown. The endpoint's next `bit` takes another slot; `reuse` frees this one."""
        slot = self._slot.pop(endpoint_id, None)
        if slot is None:
            return 0
        del self.bits[endpoint_id]
        self.owners[slot] = None
        return 1 << slot

    def reuse(self, bits: int) -> None:
        """Free the retired slots of `bits`, which no bitset carries any more."""
        while bits:
            low = bits & -bits
            heapq.heappush(self._free, low.bit_length() - 1)
            bits ^= low

    def owner(self, slot: int) -> str | None:
        return self.owners[slot]


def leading_matches(
    hashes: Sequence[bytes], endpoint_ids: Iterable[str], holders: Mapping[bytes, int], slots: EndpointSlots
) -> dict[str, int]:
    """endpoint -> how many leading blocks of `hashes` it holds (`holders`: block hash -> slot bitset)."""
    ids = endpoint_ids if isinstance(endpoint_ids, list | tuple) else list(endpoint_ids)
    result = dict.fromkeys(ids, 0)
    if not holders:  # an empty generation of the recent routes: the usual case, answered for free
        return result
    remaining = reduce(or_, map(slots.bits.get, ids, repeat(0)), 0)
    get = holders.get
    owner = slots.owners
    n = len(hashes)
    start, chunk = 0, _FIRST_CHUNK
    while remaining and start < n:
        part = hashes[start : start + chunk]
        # acc[i] = the queried endpoints holding all of part[:i] (and everything before `part`).
        acc = list(accumulate(map(get, part, repeat(0)), and_, initial=remaining))
        last = acc[-1]
        if acc[0] == last:
            pass
        elif len(part) <= _DIFF_PER_BIT * remaining.bit_count():
            # Short chunk, many endpoints: the bits that leave between acc[i] and acc[i + 1] (those endpoints
            # hold start + i blocks), three C-level passes; only the nonzero ones reach Python.
            drops = list(map(xor, acc, islice(acc, 1, None)))
            for count, gone in zip(compress(count_from(start), drops), filter(None, drops), strict=True):
                while gone:
                    low = gone & -gone
                    result[owner[low.bit_length() - 1]] = count
                    gone ^= low
        else:
            # Long chunk: bisect to each place a bit leaves (acc only decreases), O(log chunk) per place.
            pos = 0
            while acc[pos] != last:
                v = acc[pos]
                pos = bisect_right(acc, -v, lo=pos, key=neg)  # first i with acc[i] < v
                gone = v & ~acc[pos]
                count = start + pos - 1
                while gone:
                    low = gone & -gone
                    result[owner[low.bit_length() - 1]] = count
                    gone ^= low
        remaining = last
        start += len(part)
        chunk *= 4
    while remaining:
        low = remaining & -remaining
        result[owner[low.bit_length() - 1]] = n
        remaining ^= low
    return result


def _drop_bit(holders: dict[bytes, int], hashes: Iterable[bytes], bit: int) -> None:
    mask = ~bit
    for h in hashes:
        have = holders.get(h)
        if have is not None:
            have &= mask
            if have:
                holders[h] = have
            else:
                del holders[h]


class ExactPrefixIndex:
    """block hash -> bitset of endpoints holding it, plus the reverse map so a `cleared` or a resync is
    O(own blocks). Bounded by what the pods hold (the distinct blocks of their KV caches)."""

    def __init__(self, on_removal: Callable[[str], None] | None = None) -> None:
        self._holders: dict[bytes, int] = {}
        self._blocks: dict[str, set[bytes]] = {}
        self._slots = EndpointSlots()
        # Told which endpoint lost blocks (RecentRoutes.forget: after an eviction only events count).
        self._on_removal = on_removal

    def stored(self, endpoint_id: str, hashes: Iterable[bytes]) -> None:
        hashes = hashes if isinstance(hashes, list | tuple) else list(hashes)
        if not hashes:
            return
        bit = self._slots.bit(endpoint_id)
        self._blocks.setdefault(endpoint_id, set()).update(hashes)
        holders = self._holders
        holders.update(zip(hashes, map(or_, map(holders.get, hashes, repeat(0)), repeat(bit)), strict=False))

    def removed(self, endpoint_id: str, hashes: Iterable[bytes]) -> None:
        own = self._blocks.get(endpoint_id)
        if own is None:
            return
        hashes = list(hashes)
        if hashes and self._on_removal is not None:  # an eviction there, even of blocks not seen stored
            self._on_removal(endpoint_id)
        own.difference_update(hashes)
        _drop_bit(self._holders, hashes, self._slots.known_bit(endpoint_id))
        if not own:
            del self._blocks[endpoint_id]
            self._slots.release(endpoint_id)

    def clear(self, endpoint_id: str) -> None:
        """Forget everything about an endpoint (its cache was cleared, it left, or its stream is stale)."""
        own = self._blocks.pop(endpoint_id, None)
        if own is None:
            return
        if own and self._on_removal is not None:
            self._on_removal(endpoint_id)
        _drop_bit(self._holders, own, self._slots.known_bit(endpoint_id))
        self._slots.release(endpoint_id)

    def replace(self, endpoint_id: str, hashes: Iterable[bytes]) -> None:
        """Resync: the endpoint's full set of cached blocks, replacing what was known."""
        self.clear(endpoint_id)
        self.stored(endpoint_id, hashes)

    def num_blocks(self, endpoint_id: str) -> int:
        return len(self._blocks.get(endpoint_id, ()))

    def blocks(self, endpoint_id: str) -> frozenset[bytes]:
        """The block hashes the endpoint is known to hold (a copy)."""
        return frozenset(self._blocks.get(endpoint_id, ()))

    def __len__(self) -> int:
        """Distinct blocks held by any endpoint."""
        return len(self._holders)

    def match(self, hashes: Sequence[bytes], endpoint_ids: Iterable[str]) -> dict[str, int]:
        return leading_matches(hashes, endpoint_ids, self._holders, self._slots)


class ApproximatePrefixIndex:
    """The router's own memory of routed prefixes: hash -> endpoint bitset, least recently routed evicted
    first (at most `capacity_blocks` hashes).

    Keeps the reverse map too: `forget` runs on every eviction a pod reports, and must cost what that pod
    has here, not a scan of the whole index."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self._capacity = capacity_blocks
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._by_endpoint: dict[str, set[bytes]] = {}
        self._slots = EndpointSlots()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, endpoint_id: str, hashes: Sequence[bytes]) -> None:
        """`endpoint_id` was sent this prompt: after it runs, the pod will have cached these blocks.

        Runs for every routed request over all its blocks, so the per-block work is C-level: popping and
        re-inserting an entry moves it to the most recent end. (A prompt's chained hashes are distinct.)"""
        if not hashes:
            return
        bit = self._slots.bit(endpoint_id)
        entries = self._entries
        previous = list(map(entries.pop, hashes, repeat(0)))
        entries.update(zip(hashes, map(or_, previous, repeat(bit)), strict=False))
        self._by_endpoint.setdefault(endpoint_id, set()).update(hashes)
        while len(entries) > self._capacity:
            h, holders = entries.popitem(last=False)
            while holders:
                low = holders & -holders
                self._by_endpoint[self._slots.owner(low.bit_length() - 1)].discard(h)
                holders ^= low

    def forget(self, endpoint_id: str) -> None:
        own = self._by_endpoint.pop(endpoint_id, None)
        if own is None:
            return
        _drop_bit(self._entries, own, self._slots.known_bit(endpoint_id))
        self._slots.release(endpoint_id)

    def match(self, hashes: Sequence[bytes], endpoint_ids: Iterable[str]) -> dict[str, int]:
        return leading_matches(hashes, endpoint_ids, self._entries, self._slots)


# Retired endpoint bits a generation tolerates (or as many as its live endpoints, if more) before it
# clears them from its nodes (`_Generation._compact`).
_COMPACT_AT = 64


class _Node:
    """A point on the routes' shared paths: `depth` leading blocks, reached by the routes of the endpoints in
    `bits`; `children` (None while it has none) maps the hash at position `depth` to the edge leading on."""

    __slots__ = ("bits", "children", "depth")

    def __init__(self, depth: int, bits: int, children: dict[bytes, _Edge] | None = None) -> None:
        self.depth = depth
        self.bits = bits
        self.children = children


class _Edge:
    """The blocks from its parent's depth to `node.depth`: `blocks[i - start]` is the hash at position i (every
    route through the edge agrees there: chained hashes). `blocks` is a route's own hash sequence (held by
    reference, `start` 0) on an edge from the root, else a copy of the part of a route from where it
    branched off (so the part it shares is held once, by the edge above)."""

    __slots__ = ("blocks", "node", "start")

    def __init__(self, blocks: Sequence[bytes], start: int, node: _Node) -> None:
        self.blocks = blocks
        self.start = start
        self.node = node


def _shared_until(edge: _Edge, hashes: Sequence[bytes], lo: int, hi: int) -> int:
    """The first position in [lo, hi) where the edge's blocks and `hashes` differ, else hi; they agree at
    lo - 1. Chained hashes agree at i only if they agree before it, so one comparison settles a shared run
    and a difference is bisected."""
    blocks, start = edge.blocks, edge.start
    if blocks[hi - 1 - start] == hashes[hi - 1]:
        return hi
    return bisect_left(range(hi), True, lo=lo, key=lambda i: blocks[i - start] != hashes[i])


class _Generation:
    """One generation of recent routes as a trie of their shared paths, so a match walks the prompt's path
    once for every endpoint together, whatever the number of routes. A route costs a node and an edge, and
    the blocks it adds: a route under a new first block is held by reference, one that branches off a
    shared path copies its own part (pointers to its hashes), so what it shares is held once.

    Routes that diverge after a shared system prompt hang off one node there: a prompt that diverges too
    stops at that node in one dict lookup (a list of routes per endpoint had to be scanned route by route:
    16 endpoints x 16 routes under one first block cost ~58 us a match). A route that extends a path only
    its endpoint ends on (the next turn of a conversation) extends that edge in place."""

    __slots__ = ("blocks", "retired", "root", "slots")

    def __init__(self) -> None:
        self.root = _Node(0, 0)
        # `forget` retires the endpoint's slot (the nodes keep its bit, unowned) and its next route takes
        # another; a retired slot is reused only once `_compact` has cleared its bit everywhere.
        self.slots = EndpointSlots()
        self.retired = 0  # the retired bits still set in some node
        self.blocks = 0  # blocks the edges added (the capacity bound)

    def record(self, endpoint_id: str, hashes: Sequence[bytes]) -> None:
        bit = self.slots.bit(endpoint_id)
        n = len(hashes)
        node = self.root
        node.bits |= bit
        depth = 0
        while depth < n:
            children = node.children
            edge = children.get(hashes[depth]) if children is not None else None
            if edge is None:
                # A new branch from here.
                if children is None:
                    children = node.children = {}
                own = hashes if depth == 0 else hashes[depth:]
                children[hashes[depth]] = _Edge(own, depth, _Node(n, bit))
                self.blocks += n - depth
                return
            below = edge.node
            end = min(below.depth, n)
            shared = _shared_until(edge, hashes, depth + 1, end)
            if shared < below.depth:
                if shared == n and below.bits & bit:
                    return  # a prefix of a route this endpoint already has here
                # The route leaves (or ends) inside the edge: split it there (both halves keep its blocks).
                lower = _Edge(edge.blocks, edge.start, below)
                mid = _Node(shared, below.bits | bit, {edge.blocks[shared - edge.start]: lower})
                edge.node = mid
                node, depth = mid, shared
                continue
            if below.children is None and below.bits == bit and shared < n:
                # Only this endpoint's route ended here and this one goes on (the next turn of a
                # conversation): extend the edge in place.
                edge.blocks = hashes if depth == 0 else hashes[depth:]
                edge.start = depth
                below.depth = n
                self.blocks += n - shared
                return
            below.bits |= bit
            node, depth = below, shared

    def forget(self, endpoint_id: str) -> None:
        self.retired |= self.slots.retire(endpoint_id)
        if self.retired.bit_count() > max(_COMPACT_AT, len(self.slots.bits)):
            self._compact()

    def _compact(self) -> None:
        """Clear the retired bits from every node and drop the branches only they reached, so that their
        positions are reused: a pod reporting evictions at every poll must not grow every bitset by a bit
        per report. O(nodes), once per at least as many forgets as there are live endpoints."""
        keep = ~self.retired
        self.root.bits &= keep
        stack = [self.root]
        while stack:
            node = stack.pop()
            children = node.children
            if children is None:
                continue
            for key, edge in list(children.items()):
                below = edge.node
                below.bits &= keep  # (a node's bits include all of its descendants')
                if below.bits:
                    stack.append(below)
                else:
                    del children[key]
            if not children:
                node.children = None
        self.slots.reuse(self.retired)
        self.retired = 0

    def match_into(self, hashes: Sequence[bytes], result: dict[str, int]) -> None:
        """Raise `result[e]` (for the endpoints in it) to the longest prefix of `hashes` routed to e here."""
        owners = self.slots.owners
        n = len(hashes)
        node = self.root
        depth = 0
        while True:
            children = node.children
            edge = children.get(hashes[depth]) if children is not None and depth < n else None
            if edge is None:
                _raise(result, owners, node.bits, depth)
                return
            below = edge.node
            _raise(result, owners, node.bits & ~below.bits, depth)  # their routes end or turn off here
            end = min(below.depth, n)
            shared = _shared_until(edge, hashes, depth + 1, end)
            if shared < below.depth:
                _raise(result, owners, below.bits, shared)
                return
            node, depth = below, shared


def _raise(result: dict[str, int], owners: list[str | None], bits: int, count: int) -> None:
    """result[e] = max(result[e], count) for the endpoints of `bits` that `result` asks about."""
    if not count:
        return
    while bits:
        low = bits & -bits
        endpoint_id = owners[low.bit_length() - 1]
        if endpoint_id is not None:
            best = result.get(endpoint_id)
            if best is not None and best < count:
                result[endpoint_id] = count
        bits ^= low


class RecentRoutes:
    """Prefixes routed within the last `ttl_s` (up to 2 * `ttl_s`): two generations, the older dropped whole at
    each rotation, so expiry costs nothing per entry.

    Routes live on the edges of a trie of their shared paths (`_Generation`): a route under a new first
    block is kept by reference (the prompt's hash sequence; the caller must not change it afterwards), one
    that branches off a path already there keeps a copy of its own part's pointers, so no block costs an
    index entry and a shared prefix is held once. Block hashes are chained, so a route shares a prompt's
    first i blocks iff their hashes at position i - 1 agree: a match walks the prompt's path once for every
    endpoint together, one dict lookup per branch point and a bisection within the edge where the prompt
    leaves the trie, however many routes there are. `capacity_blocks` bounds the blocks a generation adds (a shared prefix counts once): a generation that
    reaches it rotates early."""

    def __init__(
        self, capacity_blocks: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self._capacity = capacity_blocks
        self._ttl_s = ttl_s
        self._clock = clock
        self._current = _Generation()
        self._previous = _Generation()
        self._rotated_at = clock()

    def _rotate(self) -> None:
        now = self._clock()
        elapsed = now - self._rotated_at
        if elapsed < self._ttl_s:
            return
        self._previous = self._current if elapsed < 2 * self._ttl_s else _Generation()
        self._current = _Generation()
        self._rotated_at = now

    def record(self, endpoint_id: str, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return
        self._rotate()
        current = self._current
        current.record(endpoint_id, hashes)
        if current.blocks > self._capacity:
            self._previous, self._current = current, _Generation()
            self._rotated_at = self._clock()

    def forget(self, endpoint_id: str) -> None:
        self._current.forget(endpoint_id)
        self._previous.forget(endpoint_id)

    def match(self, hashes: Sequence[bytes], endpoint_ids: Iterable[str]) -> dict[str, int]:
        result = dict.fromkeys(endpoint_ids, 0)
        self.raise_matches(hashes, result)
        return result

    def raise_matches(self, hashes: Sequence[bytes], matches: dict[str, int]) -> None:
        """Raise each `matches[e]` to at least this index's match for e: the max with another index's answer
        without building a second dict (the pick merges three indexes)."""
        self._rotate()
        if hashes:
            self._current.match_into(hashes, matches)
            self._previous.match_into(hashes, matches)
