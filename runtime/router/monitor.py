"""Active checks of one endpoint: its load figures (`GET /load`) often, its health (`GET /health`) less often.

A failed probe counts like a failed request (see health.py); a pod that answers /health with a non-200
(engine dead or stuck) is ejected even though its HTTP server is up. A pod without `/load` (404) is not
unhealthy: it just contributes no load figures, and the router's own in-flight count stands in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
from tokenfleet.runtime.router.endpoints import Endpoint

log = logging.getLogger(__name__)

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


async def probe_load(session: aiohttp.ClientSession, ep: Endpoint) -> bool:
    """Refresh `ep`'s load figures; False when the pod could not be reached or answered 5xx."""
    async with session.get(ep.url + "/load", timeout=PROBE_TIMEOUT) as resp:
        if resp.status == 404:
            return True
        if resp.status != 200:
            return False
        data = await resp.json()
    ep.num_running = int(data.get("num_running", 0))
    ep.num_waiting = int(data.get("num_waiting", 0))
    ep.kv_cache_usage = float(data.get("kv_cache_usage", 0.0))
    return True


async def probe_health(session: aiohttp.ClientSession, ep: Endpoint) -> bool:
    async with session.get(ep.url + "/health", timeout=PROBE_TIMEOUT) as resp:
        return resp.status == 200


async def monitor_endpoint(
    session: aiohttp.ClientSession,
    ep: Endpoint,
    interval: float,
    health_every: int,
    on_result: Callable[[Endpoint, bool], None],
) -> None:
    """Probe until cancelled; `on_result(ep, ok)` applies each outcome (health state, metrics, waiters)."""
    tick = 0
    while True:
        ok = True
        try:
            ok = await probe_load(session, ep)
            if ok and (tick % health_every == 0 or not ep.health.is_available(0.0)):
                ok = await probe_health(session, ep)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.debug("probe of %s failed: %s", ep.url, e)
            ok = False
        on_result(ep, ok)
        tick += 1
        await asyncio.sleep(interval)
