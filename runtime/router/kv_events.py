"""The router side of the KV-event stream: follow one pod's `/v1/kv-events` into the exact prefix index.

`apply_reply` is the pure part (tested on its own); `KVEventFollower` long-polls a pod. When the stream fails,
the pod's exact entries are dropped (they would go stale silently) and `live` turns False, so routing falls
back to the approximate index for that pod until a resync succeeds. A new follower (a router that just
started) gets the pod's whole cached set in its first reply, so its index is warm after one round trip.
`scheduled` events (a pod started a request; the hashes of its prompt's blocks) go to `on_scheduled`: the
fleet keeps them in a short-lived index of their own ("being computed there", not "held there") and
counts them as work the pod received.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from tokenfleet.runtime.router.prefix_index import ExactPrefixIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamPosition:
    epoch: str
    seq: int
    block_size: int
    hash_extra: tuple[str | int | None, ...]


OnScheduled = Callable[[str, list[bytes]], None]


def apply_reply(
    index: ExactPrefixIndex, endpoint_id: str, reply: dict, on_scheduled: OnScheduled | None = None
) -> StreamPosition:
    """Apply one `/v1/kv-events` reply; raises ValueError on a malformed one (the caller resyncs)."""
    try:
        events = reply["events"]
        position = StreamPosition(
            str(reply["epoch"]), int(reply["seq"]), int(reply["block_size"]), tuple(reply["hash_extra"])
        )
        decoded = [(e["type"], [bytes.fromhex(h) for h in e.get("block_hashes", ())]) for e in events]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed kv-events reply: {e}") from e
    if reply.get("reset"):
        index.clear(endpoint_id)
    for kind, hashes in decoded:
        if kind == "stored":
            index.stored(endpoint_id, hashes)
        elif kind == "removed":
            index.removed(endpoint_id, hashes)
        elif kind == "cleared":
            index.clear(endpoint_id)
        elif kind == "scheduled":
            if on_scheduled is not None:
                on_scheduled(endpoint_id, hashes)
        else:
            raise ValueError(f"unknown kv event type {kind!r}")
    return position


class KVEventFollower:
    """Long-polls one endpoint's KV events for as long as it runs; cancel the task to stop."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        endpoint_id: str,
        index: ExactPrefixIndex,
        on_scheduled: OnScheduled | None = None,
        wait_seconds: float = 2.0,
        retry_seconds: float = 1.0,
    ) -> None:
        self._session = session
        self._url = base_url.rstrip("/") + "/v1/kv-events"
        self.endpoint_id = endpoint_id
        self._index = index
        self._on_scheduled = on_scheduled
        self._wait = wait_seconds
        self._retry = retry_seconds
        self.position: StreamPosition | None = None
        self.live = False

    async def poll_once(self) -> None:
        params = {"wait": str(self._wait)}
        if self.position is not None:
            params |= {"since": str(self.position.seq), "epoch": self.position.epoch}
        timeout = aiohttp.ClientTimeout(total=self._wait + 10.0)
        async with self._session.get(self._url, params=params, timeout=timeout) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, resp.history, status=resp.status)
            reply = await resp.json()
        self.position = apply_reply(self._index, self.endpoint_id, reply, self._on_scheduled)
        self.live = True

    def _drop(self) -> None:
        self.live = False
        self.position = None
        self._index.clear(self.endpoint_id)

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.poll_once()
                except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                    if self.live:
                        log.warning(
                            "kv-events from %s unavailable (%s); approximate index stands in", self._url, e
                        )
                    self._drop()
                    await asyncio.sleep(self._retry)
        finally:
            self._drop()
