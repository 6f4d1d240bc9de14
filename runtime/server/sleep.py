"""Sleep mode, as vLLM exposes it with `--enable-sleep-mode`: `POST /sleep?level=1|2`, `POST /wake_up`
(optional `tags=weights` / `tags=kv_cache`, repeatable), `GET /is_sleeping` -> {"is_sleeping": bool}.

The pod side of a warm tier: a sleeping pod keeps its process, its device and (level 1) its weights in
host memory, so waking it costs a copy instead of a cold start. Routers and the operator call these with
the deployment's internal key (access.py).

No request is lost: from the moment a sleep is asked for, new requests get 503 `sleeping` with
Retry-After (a router retries another pod) and /ready turns 503; the sleep then waits for the requests
in flight to finish, at most `timeout` seconds (query parameter; default `server.drain_seconds`), and
answers 409 naming how many are still running if they do not — the pod stays awake and serving.
Disaggregation holds are released first: their blocks' contents are about to go.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from tokenfleet.runtime.server.errors import ApiError, invalid, unavailable
from tokenfleet.runtime.server.kv_transfer import KV_TRANSFER_KEY
from tokenfleet.runtime.server.state import STATE_KEY, HttpError, ServerState

logger = logging.getLogger(__name__)

SLEEP_PATH = "/sleep"
WAKE_UP_PATH = "/wake_up"
IS_SLEEPING_PATH = "/is_sleeping"
PATHS = frozenset({SLEEP_PATH, WAKE_UP_PATH, IS_SLEEPING_PATH})

_POLL_S = 0.01
_LOCK_KEY = web.AppKey("tokenfleet.sleep_lock", asyncio.Lock)


def _enabled(state: ServerState) -> None:
    if not state.config.server.enable_sleep_mode:
        raise HttpError(
            ApiError(
                404,
                "Sleep mode is off on this server: start it with --enable-sleep-mode "
                "(server.enable_sleep_mode: true) to expose /sleep, /wake_up and /is_sleeping.",
                type="not_found_error",
                code="sleep_mode_disabled",
            )
        )


def _engine(state: ServerState):
    if state.draining:
        raise HttpError(unavailable("The server is shutting down.", code="draining", retry_after=1))
    if state.engine is None:
        raise HttpError(unavailable("Not ready: the model is loading.", code="not_ready", retry_after=5))
    return state.engine


def _query_float(request: web.Request, name: str, default: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise HttpError(invalid(f"`{name}` must be a number of seconds >= 0, got {raw!r}", param=name))
    return value


def _level(request: web.Request) -> int:
    raw = request.query.get("level", "1")  # vLLM's default
    if raw not in ("1", "2"):
        raise HttpError(
            invalid(
                f"`level` must be 1 (free the KV cache, keep the weights in host memory) or 2 (also "
                f"discard the weights), got {raw!r}",
                param="level",
            )
        )
    return int(raw)


async def _drained(state: ServerState, engine, deadline: float) -> bool:
    """Wait for the HTTP requests in flight, then for the engine's own (aborts in transit, pin prefills)."""
    while state.in_flight > 0:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_POLL_S)
    while await engine.call(lambda core: core.has_unfinished()):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return True


def _release_holds(kv_state):
    def release(core) -> int:
        holds = kv_state.holds
        if holds is None:
            return 0
        ids = holds.ids()
        for hold_id in ids:
            holds.release(hold_id)
        return len(ids)

    return release


async def sleep_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    _enabled(state)
    level = _level(request)
    timeout = _query_float(request, "timeout", state.config.server.drain_seconds)
    engine = _engine(state)
    async with request.app[_LOCK_KEY]:
        if state.sleep_level:
            return web.json_response({"is_sleeping": True, "level": state.sleep_level})
        state.sleep_pending = True  # new requests get 503 `sleeping` from here on; /ready turns 503
        try:
            if not await _drained(state, engine, time.monotonic() + timeout):
                n = state.in_flight or engine.stats().num_running + engine.stats().num_waiting
                raise HttpError(
                    ApiError(
                        409,
                        f"Not asleep: {n} requests still in flight after {timeout:g}s; the server stays "
                        "awake and serving (retry, or pass a longer `timeout`).",
                        type="conflict_error",
                        code="requests_in_flight",
                    )
                )
            released = await engine.call(_release_holds(request.app[KV_TRANSFER_KEY]))
            if released:
                logger.info("sleep: released %d unfetched KV holds", released)
            freed = await engine.sleep(level)
            state.sleep_level = level
        finally:
            state.sleep_pending = False
            state.metrics.set_sleep_state(state.sleep_level)
    return web.json_response({"is_sleeping": True, "level": level, "freed_bytes": freed})


async def wake_up_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    _enabled(state)
    tags = request.query.getall("tags", None)
    engine = _engine(state)
    async with request.app[_LOCK_KEY]:
        start = time.monotonic()
        try:
            await engine.wake_up(tags)
        finally:
            state.sleep_level = engine.sleep_level
            state.metrics.set_sleep_state(state.sleep_level)
        seconds = time.monotonic() - start
    if tags is None or not state.sleep_level:
        logger.info("awake after %.2f s", seconds)
    return web.json_response({"is_sleeping": bool(state.sleep_level), "wake_seconds": round(seconds, 3)})


async def is_sleeping_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    _enabled(state)
    return web.json_response({"is_sleeping": bool(state.sleep_level)})


def install(app: web.Application) -> None:
    app[_LOCK_KEY] = asyncio.Lock()
    app.router.add_post(SLEEP_PATH, sleep_endpoint)
    app.router.add_post(WAKE_UP_PATH, wake_up_endpoint)
    app.router.add_get(IS_SLEEPING_PATH, is_sleeping_endpoint)
