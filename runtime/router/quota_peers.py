"""One quota across active-active routers: each router reads the others' usage and charges what is new.

Every router counts what it admitted per API key (`RateLimiter.usage`: requests and tokens, cumulative,
keys only as digests) and serves it at `GET /v1/ratelimit/usage` to its peers — the addresses of the
routers' own Service (EndpointSlices) or a static list — and to nobody else. Every `interval` seconds a
router reads each peer's figures and charges the increase since the last read to its own buckets
(`charge_remote`), so every bucket follows the whole fleet's spending.

How far the fleet can overshoot a limit: a router learns of a peer's spending at most one interval (plus
the read's own time) late, so N routers can together admit up to (N - 1) x what one router admits in an
interval beyond the limit — with a limit of L per minute spread over the routers, about L x (N - 1) /
N x interval / 60 (0.4 % of L for two routers at 0.5 s). A burst that arrives at every router at once
before they exchanged anything can take each router's whole bucket: up to N x one minute's allowance.
A peer seen for the first time (a router starting, or restarted: a new id) is a baseline, not a charge:
what it counted before is history that the buckets refill from anyway, and charging it would put keys in
debt for spending already over.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import aiohttp
from tokenfleet.runtime.router.ratelimit import RateLimiter

log = logging.getLogger(__name__)

USAGE_PATH = "/v1/ratelimit/usage"
READ_TIMEOUT_SECONDS = 2.0


class QuotaPeers:
    def __init__(
        self,
        limiter: RateLimiter,
        session: aiohttp.ClientSession,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router_id = uuid.uuid4().hex
        self.limiter = limiter
        self.session = session
        self.interval = interval
        self.clock = clock
        self.urls: list[str] = []
        self.hosts: frozenset[str] = frozenset()
        # Per peer URL: (its router id, its cumulative usage by key digest when last read).
        self._seen: dict[str, tuple[str, dict[str, tuple[float, float]]]] = {}
        self.reads = self.failures = 0

    def set_urls(self, urls: Iterable[str]) -> None:
        self.urls = sorted({u.rstrip("/") for u in urls})
        self.hosts = frozenset(urlsplit(u).hostname or "" for u in self.urls)
        for gone in set(self._seen) - set(self.urls):
            del self._seen[gone]

    def state(self) -> dict:
        """For /v1/config: who the peers are and how reading them goes."""
        peers = {url: seen[0] for url, seen in self._seen.items()}
        return {
            "router": self.router_id,
            "urls": self.urls,
            "peers": peers,
            "reads": self.reads,
            "failures": self.failures,
        }

    def may_read(self, remote: str | None) -> bool:
        """Only the peers (and this host) read the usage: it says how much each key spends."""
        return remote is not None and (remote in self.hosts or remote in ("127.0.0.1", "::1"))

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)

    async def poll_once(self) -> None:
        urls = list(self.urls)
        replies = await asyncio.gather(*(self._read(u) for u in urls))
        now = self.clock()
        for url, data in zip(urls, replies, strict=True):
            if data is None or data.get("router") == self.router_id:
                continue
            try:
                peer = data["router"]
                usage = {
                    d: (str(u["tier"]), float(u["requests"]), float(u["tokens"]))
                    for d, u in data["usage"].items()
                }
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                self.failures += 1
                log.warning("malformed usage report from %s: %s", url, e)
                continue
            before_id, before = self._seen.get(url, (None, {}))
            if before_id == peer:
                for digest, (tier, requests, tokens) in usage.items():
                    r0, t0 = before.get(digest, (0.0, 0.0))
                    # Counters only go down when the peer dropped an idle key: the new figure is all new.
                    dr = requests - r0 if requests >= r0 else requests
                    dt = tokens - t0 if tokens >= t0 else tokens
                    if dr > 0 or dt > 0:
                        self.limiter.charge_remote(digest, tier, dr, dt, now)
            self._seen[url] = (peer, {d: (r, t) for d, (_, r, t) in usage.items()})

    async def _read(self, url: str) -> dict | None:
        self.reads += 1
        try:
            timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_SECONDS)
            async with self.session.get(url + USAGE_PATH, timeout=timeout) as r:
                if r.status != 200:
                    raise aiohttp.ClientError(f"HTTP {r.status}")
                data = await r.json()
            if not isinstance(data, dict) or not isinstance(data.get("router"), str):
                raise ValueError("not a usage report")
            return data
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            self.failures += 1
            log.debug("reading %s%s failed: %s", url, USAGE_PATH, e)
            return None
