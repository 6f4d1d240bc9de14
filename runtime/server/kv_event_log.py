"""The pod's KV-event log and its two HTTP handlers (`GET /v1/kv-events`, `GET /load`).

Wire format: `runtime/kv_wire.py`. Build one `KVEventLog(block_size, hash_extra)`, call
`log.publish(pool.take_events())` from the engine thread after each step (thread-safe), and add the routes
with `app.add_routes(kv_event_routes(log, load_fn))`, where `load_fn()` returns a `LoadReport` (cheap, called
on every router poll). `make_kv_events_app` gives the same routes as a sub-application for `add_subapp`.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable

from aiohttp import web
from tokenfleet.runtime.engine.kv_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PrefillScheduled,
)
from tokenfleet.runtime.kv_wire import EVENT_TYPES, MAX_WAIT_SECONDS, KVEventsReply, KVWireEvent, LoadReport


def normalize_event(
    event: KVWireEvent | BlockStored | BlockRemoved | AllBlocksCleared | PrefillScheduled,
) -> KVWireEvent:
    """The engine's events (the block pool's, and prefills being scheduled) as wire events."""
    if isinstance(event, KVWireEvent):
        if event.type not in EVENT_TYPES:
            raise ValueError(f"unknown KV event type {event.type!r}")
        return event
    if isinstance(event, BlockStored):
        return KVWireEvent("stored", tuple(event.block_hashes))
    if isinstance(event, BlockRemoved):
        return KVWireEvent("removed", tuple(event.block_hashes))
    if isinstance(event, AllBlocksCleared):
        return KVWireEvent("cleared")
    if isinstance(event, PrefillScheduled):
        return KVWireEvent("scheduled", tuple(event.block_hashes))
    raise TypeError(f"not a KV event: {event!r}")


class KVEventLog:
    """Bounded log of event batches with the resulting set of cached hashes; publish from any thread."""

    def __init__(
        self, block_size: int, hash_extra: tuple[str | int | None, ...], retain_batches: int = 4096
    ) -> None:
        self.block_size = block_size
        self.hash_extra = tuple(hash_extra)
        self.epoch = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._batches: deque[tuple[int, tuple[KVWireEvent, ...]]] = deque(maxlen=retain_batches)
        self._seq = 0
        self._cached: set[bytes] = set()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def seq(self) -> int:
        return self._seq

    def publish(self, events: Iterable) -> int:
        batch = tuple(normalize_event(e) for e in events)
        if not batch:
            return self._seq
        with self._lock:
            for e in batch:
                if e.type == "stored":
                    self._cached.update(e.block_hashes)
                elif e.type == "removed":
                    self._cached.difference_update(e.block_hashes)
                elif e.type == "cleared":
                    self._cached.clear()
                # "scheduled" changes nothing cached: it only tells followers what is being computed
            self._seq += 1
            self._batches.append((self._seq, batch))
            waiters, self._waiters = self._waiters, []
        for loop, ev in waiters:
            loop.call_soon_threadsafe(ev.set)
        return self._seq

    def read(self, since: int | None, epoch: str | None) -> dict:
        """The reply body for a poll from `since` (None: a new subscriber)."""
        with self._lock:
            oldest = self._batches[0][0] if self._batches else self._seq + 1
            in_window = since is not None and epoch == self.epoch and oldest - 1 <= since <= self._seq
            if in_window:
                events = tuple(e for seq, batch in self._batches if seq > since for e in batch)
                reset = False
            else:
                events = (KVWireEvent("cleared", ()), KVWireEvent("stored", tuple(self._cached)))
                reset = True
            reply = KVEventsReply(
                self.epoch, self._seq, self.block_size, tuple(self.hash_extra), events, reset
            )
            return reply.to_json()

    async def wait_after(self, since: int, timeout: float) -> None:
        ev = asyncio.Event()
        with self._lock:
            if self._seq != since:
                return
            self._waiters.append((asyncio.get_running_loop(), ev))
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except TimeoutError:
            with self._lock:
                self._waiters = [w for w in self._waiters if w[1] is not ev]


def _query_float(request: web.Request, name: str, default: float) -> float:
    try:
        return float(request.query.get(name, default))
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"{name} must be a number") from e


def kv_event_routes(log: KVEventLog, load_fn: Callable[[], LoadReport]) -> list[web.RouteDef]:
    async def kv_events(request: web.Request) -> web.Response:
        raw_since = request.query.get("since")
        epoch = request.query.get("epoch")
        since: int | None = None
        if raw_since is not None:
            try:
                since = int(raw_since)
            except ValueError as e:
                raise web.HTTPBadRequest(text="since must be an integer") from e
        wait = min(max(_query_float(request, "wait", 0.0), 0.0), MAX_WAIT_SECONDS)
        if since is not None and epoch == log.epoch and since == log.seq and wait > 0:
            await log.wait_after(since, wait)
        return web.json_response(log.read(since, epoch))

    async def load(request: web.Request) -> web.Response:
        return web.json_response(load_fn().to_json())

    return [web.get("/v1/kv-events", kv_events), web.get("/load", load)]


def make_kv_events_app(log: KVEventLog, load_fn: Callable[[], LoadReport]) -> web.Application:
    app = web.Application()
    app.add_routes(kv_event_routes(log, load_fn))
    return app
