"""Active checks of one endpoint: its load figures (`GET /load`) often, its readiness less often.

Each tick reads `/load`; every `health_every` ticks, and on every tick while the endpoint is out of
rotation, it also asks `/ready` (a pod without `/ready` is asked `/health`). Outcomes (health.py):
- OK: `/load` answered (404 too: a pod without it contributes no figures, the router's in-flight count
  stands in) and readiness, when asked, said 200;
- NOT_READY: the pod says it is loading or draining (503 on `/load`, or `/ready` 503 with any status but
  "unhealthy" or "sleeping"), or nothing listens yet on an endpoint that never served (its process is
  starting);
- SLEEPING: `/ready` 503 with status "sleeping" (sleep mode): out of rotation like NOT_READY, and the
  router knows a `POST /wake_up` brings it back (wake.py);
- FAILED: anything else — 5xx, timeouts, a dead engine ("unhealthy"), a refused connection from a pod
  that was serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
from tokenfleet.runtime.router.endpoints import Endpoint
from tokenfleet.runtime.router.health import Probe

log = logging.getLogger(__name__)

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


async def probe_load(session: aiohttp.ClientSession, ep: Endpoint) -> Probe:
    """Refresh `ep`'s load figures."""
    async with session.get(ep.url + "/load", timeout=PROBE_TIMEOUT) as resp:
        if resp.status == 404:
            return Probe.OK
        if resp.status == 503:
            return Probe.NOT_READY
        if resp.status != 200:
            return Probe.FAILED
        data = await resp.json()
    ep.load_report(
        int(data.get("num_running", 0)),
        int(data.get("num_waiting", 0)),
        float(data.get("kv_cache_usage", 0.0)),
    )
    digest = data.get("tokenizer_digest")
    ep.tokenizer_digest = digest if isinstance(digest, str) else None
    adapters = data.get("lora_adapters")
    ep.lora_adapters = (
        {k: v for k, v in adapters.items() if isinstance(k, str) and isinstance(v, str)}
        if isinstance(adapters, dict)
        else {}
    )
    room = data.get("lora_room")
    ep.lora_room = room if isinstance(room, int) and not isinstance(room, bool) else None
    active = data.get("lora_active")
    ep.lora_active = (
        frozenset(a for a in active if isinstance(a, str)) if isinstance(active, list) else frozenset()
    )
    slots = data.get("lora_slots")
    ep.lora_slots = slots if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0 else None
    return Probe.OK


async def probe_ready(session: aiohttp.ClientSession, ep: Endpoint) -> Probe:
    async with session.get(ep.url + "/ready", timeout=PROBE_TIMEOUT) as resp:
        if resp.status == 200:
            return Probe.OK
        if resp.status == 503:
            try:
                body = await resp.json()
                status = body.get("status")
            except (aiohttp.ContentTypeError, ValueError, AttributeError):
                body, status = {}, None
            if status == "unhealthy":
                return Probe.FAILED
            if status == "sleeping":
                level = body.get("level")
                ep.sleep_level = level if isinstance(level, int) else None
                return Probe.SLEEPING
            return Probe.NOT_READY
        if resp.status != 404:
            return Probe.FAILED
    async with session.get(ep.url + "/health", timeout=PROBE_TIMEOUT) as resp:
        return Probe.OK if resp.status == 200 else Probe.FAILED


async def probe_once(session: aiohttp.ClientSession, ep: Endpoint, check_ready: bool) -> Probe:
    try:
        outcome = await probe_load(session, ep)
        if outcome is Probe.OK and check_ready:
            outcome = await probe_ready(session, ep)
        return outcome
    except aiohttp.ClientConnectorError as e:
        log.debug("probe of %s: cannot connect: %s", ep.url, e)
        return Probe.FAILED if ep.health.ever_ready else Probe.NOT_READY
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        log.debug("probe of %s failed: %s", ep.url, e)
        return Probe.FAILED


async def monitor_endpoint(
    session: aiohttp.ClientSession,
    ep: Endpoint,
    interval: float,
    health_every: int,
    on_result: Callable[[Endpoint, Probe], None],
) -> None:
    """Probe until cancelled; `on_result(ep, outcome)` applies each outcome (health, metrics, waiters)."""
    tick = 0
    while True:
        check_ready = tick % health_every == 0 or not ep.health.is_available(0.0)
        on_result(ep, await probe_once(session, ep, check_ready))
        tick += 1
        await asyncio.sleep(interval)
