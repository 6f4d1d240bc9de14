"""Held prefixes: a prefill pod keeps the KV blocks of a finished prefill until a decode pod fetches them.

A hold is announced before its request runs (`expect`) and taken when the request finishes, in the same
engine step that gave its blocks back (`requests_finished`, an EngineCore finish listener): the prompt's
full blocks are then free cached blocks and nothing has allocated since, so every one of them is still
there and gets one reference, which keeps it from eviction. Taken any later (after the answer went out),
other requests' allocations could evict the tail of the prompt first. `hold` references whatever leading
blocks are cached now (a prompt without a pending hold, or a fallback). The hold ends exactly once: `take`
(a fetch: the caller copies the KV, then calls `free`), `release`/`cancel`, or `expire` past its deadline —
the pod sweeps holds on a timer, so an abandoned transfer frees its blocks after its ttl and nothing leaks.
`cancel` also ends a hold that is still only announced (the id went out in a stream header, and the decode
side gave it up before the prefill finished): it is then never taken, neither at the finish nor by
`hold_pending`, so its blocks are not pinned for a ttl nobody will fetch in.
A taken hold is the fetch's alone: a concurrent release or expiry cannot free blocks still being copied.
Engine thread only, except `PendingHold.held`, which the event loop reads once the request's answer is
complete (the engine set it before delivering that answer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenfleet.runtime.engine.kv_cache.block_hash import BlockHash
from tokenfleet.runtime.engine.kv_cache.block_pool import KVBlock
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class Hold:
    blocks: tuple[KVBlock, ...]
    block_hashes: tuple[BlockHash, ...]  # of the held blocks, in prompt order
    token_ids: tuple[int, ...]  # the held blocks' tokens (len = blocks * block_size)
    cache_salt: str | None
    deadline: float

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


@dataclass(slots=True)
class PendingHold:
    """A hold announced for a request that has not finished yet; `held` is set when it is taken."""

    hold_id: str
    block_hashes: tuple[BlockHash, ...]
    token_ids: tuple[int, ...]
    cache_salt: str | None
    ttl: float
    held: Hold | None = None
    # Set by `cancel` before the hold was taken: it never will be. Kept on the announcement itself, which
    # only its request's handler still references, so remembering it costs nothing once that is done.
    cancelled: bool = False


class _Finished(Protocol):
    """What a finish listener sees of a request (engine/request.py's Request)."""

    prompt_token_ids: list[int]
    cache_salt: str | None


class KVHolds:
    def __init__(self, manager: KVCacheManager, clock: Callable[[], float] = time.monotonic):
        self._manager = manager
        self._clock = clock
        self._holds: dict[str, Hold] = {}
        # Announced holds by (prompt, salt), oldest first: requests with the same prompt finish with the
        # same blocks, so whichever of them finishes first can take the oldest hold of that prompt.
        self._pending: dict[tuple[tuple[int, ...], str | None], list[PendingHold]] = {}
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._holds)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values())

    def hold(
        self,
        hold_id: str,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None,
        deadline: float,
    ) -> Hold:
        """Reference the leading cached blocks of `block_hashes` (the prompt's); the hold (maybe empty)."""
        if hold_id in self._holds:
            raise ValueError(f"hold {hold_id!r} exists")
        pool = self._manager.pool
        blocks: list[KVBlock] = []
        for block_hash in block_hashes:
            block = pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        pool.touch(blocks, count_hit=False)
        bs = self._manager.block_size
        hold = Hold(
            tuple(blocks),
            tuple(block_hashes[: len(blocks)]),
            tuple(token_ids[: len(blocks) * bs]),
            cache_salt,
            deadline,
        )
        self._holds[hold_id] = hold
        return hold

    # ---- taken at the finish of a request -------------------------------------------------------------------

    def expect(
        self,
        hold_id: str,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None,
        ttl: float,
    ) -> PendingHold:
        """Announce a hold on the prompt `token_ids` (its chain `block_hashes`), taken with a deadline `ttl`
        seconds on when a request with that prompt and salt finishes. A prompt without a full block is held
        (empty) at once."""
        if hold_id in self._holds or any(p.hold_id == hold_id for ps in self._pending.values() for p in ps):
            raise ValueError(f"hold {hold_id!r} exists")
        pending = PendingHold(hold_id, tuple(block_hashes), tuple(token_ids), cache_salt, ttl)
        if not block_hashes:
            pending.held = self.hold(hold_id, (), (), cache_salt, self._clock() + ttl)
        else:
            self._pending.setdefault((pending.token_ids, cache_salt), []).append(pending)
        return pending

    def requests_finished(self, requests: Sequence[_Finished]) -> None:
        """The engine's finish listener: the requests that finished in this step, whose blocks just went back
        to the pool (nothing has allocated since). Takes the pending holds of their prompts."""
        if not self._pending:
            return
        for request in requests:
            key = (tuple(request.prompt_token_ids), request.cache_salt)
            waiting = self._pending.get(key)
            if not waiting:
                continue
            pending = waiting.pop(0)
            if not waiting:
                del self._pending[key]
            deadline = self._clock() + pending.ttl
            pending.held = self.hold(
                pending.hold_id, pending.block_hashes, pending.token_ids, pending.cache_salt, deadline
            )

    def cancel(self, hold_id: str) -> bool:
        """Drop an announced hold so that it is never taken, or release it if it was taken (its request
        failed or went away, or the decode side gave it up). False when it is neither (unknown, fetched,
        expired or already cancelled)."""
        pending = self._unannounce(hold_id)
        if pending is not None:
            pending.cancelled = True
            return True
        return self.release(hold_id)

    def hold_pending(self, pending: PendingHold, deadline: float) -> Hold | None:
        """Take an announced hold now, for a request that finished without the finish listener taking it
        (the pod's fallback); the hold it already has when it was taken, None when it was cancelled."""
        if pending.held is not None or pending.cancelled:
            return pending.held
        self._unannounce(pending.hold_id)
        pending.held = self.hold(
            pending.hold_id, pending.block_hashes, pending.token_ids, pending.cache_salt, deadline
        )
        return pending.held

    def _unannounce(self, hold_id: str) -> PendingHold | None:
        for key, waiting in self._pending.items():
            for i, p in enumerate(waiting):
                if p.hold_id == hold_id:
                    del waiting[i]
                    if not waiting:
                        del self._pending[key]
                    return p
        return None

    @property
    def num_pending(self) -> int:
        return sum(len(ps) for ps in self._pending.values())

    # ---- the holds ------------------------------------------------------------------------------------------

    def ids(self) -> set[str]:
        return set(self._holds)

    def num_blocks(self, hold_id: str) -> int | None:
        hold = self._holds.get(hold_id)
        return None if hold is None else len(hold.blocks)

    def take(self, hold_id: str) -> Hold | None:
        """Hand the hold over to a fetch: it leaves the registry (no release or expiry can free its blocks
        while they are copied) and the fetch frees it with `free` when done. None when unknown or expired."""
        return self._holds.pop(hold_id, None)

    def free(self, hold: Hold) -> None:
        self._manager.pool.free_blocks(reversed(hold.blocks))  # the tail of a prefix is evicted first

    def release(self, hold_id: str) -> bool:
        hold = self._holds.pop(hold_id, None)
        if hold is None:
            return False
        self.free(hold)
        return True

    def expire(self, now: float) -> int:
        """Release every hold past its deadline; how many."""
        expired = [hid for hid, h in self._holds.items() if h.deadline <= now]
        for hid in expired:
            self.release(hid)
        self.num_expired += len(expired)
        return len(expired)
