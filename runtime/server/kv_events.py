"""The pod's KV-event stream for the router: `GET /v1/kv-events` (long poll) and `GET /load`.

The wire format and the event log live with the router (`runtime/router/kv_events_endpoint.py`); this is
the serving side's share. The block pool records stored/removed block hashes as the engine thread works;
`KVEventPump` drains them *on the engine thread* (through `AsyncEngine.call`, between steps, so the pool
is never touched from the event loop) every `interval_s` and publishes them to the log that the long-poll
endpoint reads. Draining also keeps the pool's event list bounded on pods no router follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web
from tokenfleet.runtime.router.kv_events_endpoint import KVEventLog, LoadReport, kv_event_routes
from tokenfleet.runtime.server.errors import unavailable
from tokenfleet.runtime.server.state import STATE_KEY, HttpError

logger = logging.getLogger(__name__)


class KVEventPump:
    def __init__(self, engine, interval_s: float = 0.05):
        kv = engine.core.kv_manager
        self.engine = engine
        self.interval_s = interval_s
        self.log = KVEventLog(kv.block_size, kv.hash_extra)
        self._task: asyncio.Task | None = None
        # The router module owns the wire format; reuse its handlers bound to this pod's log.
        self.handlers = {route.path: route.handler for route in kv_event_routes(self.log, self.load)}

    def load(self) -> LoadReport:
        s = self.engine.stats()
        return LoadReport(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage
        )

    async def drain_once(self) -> int:
        """Move the pool's pending events into the log; returns the log's sequence number."""
        log = self.log
        return await self.engine.call(lambda core: log.publish(core.kv_manager.take_events()))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="tokenfleet-kv-events")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            try:
                await self.drain_once()
            except Exception:  # a dead engine: /health reports it; keep the last published state
                logger.exception("KV event drain failed")
                return
            await asyncio.sleep(self.interval_s)


def _pump(request: web.Request) -> KVEventPump:
    pump = request.app[STATE_KEY].kv_events
    if pump is None:
        raise HttpError(unavailable("Not ready: the model is loading.", code="not_ready", retry_after=5))
    return pump


async def kv_events_endpoint(request: web.Request) -> web.StreamResponse:
    return await _pump(request).handlers["/v1/kv-events"](request)


async def load_endpoint(request: web.Request) -> web.StreamResponse:
    return await _pump(request).handlers["/load"](request)
