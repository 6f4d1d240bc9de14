"""The pod's KV-event stream for the router: `GET /v1/kv-events` (long poll) and `GET /load`.

The wire format is `runtime/kv_wire.py` and the event log `kv_event_log.py`; this is
the serving side's share. The engine thread hands the block pool's stored/removed block hashes to
`EngineCore.set_kv_event_sink` after every step; `KVEventPump` points that sink at the log the long-poll
endpoint reads (`KVEventLog.publish` is thread-safe), so events reach routers without polling the engine
and the pool never touches the event loop.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

from aiohttp import web
from tokenfleet.runtime.errors import EngineDeadError
from tokenfleet.runtime.kv_wire import LoadReport
from tokenfleet.runtime.server.access import access_table
from tokenfleet.runtime.server.errors import unavailable
from tokenfleet.runtime.server.kv_event_log import KVEventLog, kv_event_routes
from tokenfleet.runtime.server.state import STATE_KEY, HttpError
from tokenfleet.runtime.server.tokenizer_endpoint import served_tokenizer

logger = logging.getLogger(__name__)


class KVEventPump:
    def __init__(self, engine):
        kv = engine.core.kv_manager
        self.engine = engine
        self.log = KVEventLog(kv.block_size, kv.hash_extra)
        # The handlers of kv_event_log.py, bound to this pod's log.
        self.handlers = {route.path: route.handler for route in kv_event_routes(self.log, self.load)}

    def load(self) -> LoadReport:
        s = self.engine.stats()
        lora = self.engine.core.lora
        return LoadReport(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            lora_adapters=None if lora is None else {a.name: a.cache_key for a in lora.adapters()},
            lora_room=None if lora is None else lora.room(),
            lora_pinned=None if lora is None else tuple(lora.pinned()),
            lora_active=None if lora is None else tuple(lora.active()),
            lora_slots=None if lora is None else lora.slots.max_loras,
        )

    async def start(self) -> None:
        log = self.log
        await self.engine.call(lambda core: core.set_kv_event_sink(log.publish))

    async def stop(self) -> None:
        with contextlib.suppress(EngineDeadError):
            await self.engine.call(lambda core: core.set_kv_event_sink(None))


def _pump(request: web.Request) -> KVEventPump:
    pump = request.app[STATE_KEY].kv_events
    if pump is None:
        raise HttpError(unavailable("Not ready: the model is loading.", code="not_ready", retry_after=5))
    return pump


async def kv_events_endpoint(request: web.Request) -> web.StreamResponse:
    return await _pump(request).handlers["/v1/kv-events"](request)


async def load_endpoint(request: web.Request) -> web.StreamResponse:
    """The load figures, plus what a router needs to keep in step: the tokenizer's digest (a new one means
    a new model: fetch it again) and which endpoint needs which key (for whoever debugs a 401)."""
    state = request.app[STATE_KEY]
    report = _pump(request).load()
    tok = served_tokenizer(state)
    body = replace(report, tokenizer_digest=tok.digest if tok is not None else None).to_json()
    body["access"] = access_table(state.internal_key.enabled, state.api_keys.enabled)
    return web.json_response(body)
