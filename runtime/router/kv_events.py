"""The router side of the KV-event stream: follow one pod's `/v1/kv-events` into the exact prefix index.

`apply_reply` is the pure part (tested on its own); `KVEventFollower` long-polls a pod. When the stream fails,
the pod's exact entries are dropped (they would go stale silently) and `live` turns False, so routing falls
back to the approximate index for that pod until a resync succeeds. A new follower (a router that just
started) gets the pod's whole cached set in its first reply, so its index is warm after one round trip.
A reply that is malformed or does not follow on from the last one (another epoch without a resync, a seq
going back) is rejected whole (`StreamError`), logged, counted per reason, and answered like a failed
stream: the pod's entries are dropped and the next poll resyncs, so a bad reply never half-applies.
`scheduled` events (a pod started a request; the hashes of its prompt's blocks) go to `on_scheduled`: the
fleet keeps them in a short-lived index of their own ("being computed there", not "held there") and
counts them as work the pod received.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
from tokenfleet.runtime.kv_wire import KVEventsReply, WireFormatError
from tokenfleet.runtime.router.prefix_index import ExactPrefixIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamPosition:
    epoch: str
    seq: int
    block_size: int
    hash_extra: tuple[str | int | None, ...]


OnScheduled = Callable[[str, Sequence[bytes]], None]


class StreamError(ValueError):
    """A reply the index must not take: `reason` is malformed (not the wire format; `kv_wire.WireFormatError`
    says what), epoch (the pod restarted but the reply is not a resync) or order (its seq goes back, or
    repeats with new events). Nothing of such a reply is applied; the follower drops the endpoint's entries
    and resyncs."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def apply_reply(
    index: ExactPrefixIndex,
    endpoint_id: str,
    reply: object,
    on_scheduled: OnScheduled | None = None,
    previous: StreamPosition | None = None,
) -> StreamPosition:
    """Apply one `/v1/kv-events` reply (the decoded JSON body) following `previous` (the position of the last
    one applied); raises StreamError, having changed nothing, on a reply that is malformed or does not follow
    on. The whole reply is parsed (`KVEventsReply.from_json`) before anything is applied."""
    try:
        parsed = KVEventsReply.from_json(reply)
    except WireFormatError as e:
        raise StreamError("malformed", str(e)) from e
    position = StreamPosition(parsed.epoch, parsed.seq, parsed.block_size, parsed.hash_extra)
    if previous is not None and not parsed.reset:
        if position.epoch != previous.epoch:
            raise StreamError("epoch", f"epoch {position.epoch!r} after {previous.epoch!r} without a resync")
        if position.seq < previous.seq or (position.seq == previous.seq and parsed.events):
            raise StreamError("order", f"seq {position.seq} after {previous.seq}")
    if parsed.reset:
        index.clear(endpoint_id)
    for event in parsed.events:
        kind = event.type
        if kind == "stored":
            index.stored(endpoint_id, event.block_hashes)
        elif kind == "removed":
            index.removed(endpoint_id, event.block_hashes)
        elif kind == "cleared":
            index.clear(endpoint_id)
        elif on_scheduled is not None:
            on_scheduled(endpoint_id, event.block_hashes)
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
        on_error: Callable[[str], None] | None = None,
        wait_seconds: float = 2.0,
        retry_seconds: float = 1.0,
    ) -> None:
        self._session = session
        self._url = base_url.rstrip("/") + "/v1/kv-events"
        self.endpoint_id = endpoint_id
        self._index = index
        self._on_scheduled = on_scheduled
        self._on_error = on_error  # told each rejected reply's reason (the router's metric)
        self.errors: dict[str, int] = {}  # rejected replies by StreamError reason
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
        try:
            self.position = apply_reply(
                self._index, self.endpoint_id, reply, self._on_scheduled, self.position
            )
        except StreamError as e:
            self.errors[e.reason] = self.errors.get(e.reason, 0) + 1
            if self._on_error is not None:
                self._on_error(e.reason)
            log.warning("kv-events from %s rejected (%s); resyncing", self._url, e)
            raise
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
                    # Dropping the entries and the position makes the next poll a resync (the pod answers
                    # a request without a position with its whole cached set).
                    if self.live and not isinstance(e, StreamError):
                        log.warning(
                            "kv-events from %s unavailable (%s); approximate index stands in", self._url, e
                        )
                    self._drop()
                    await asyncio.sleep(self._retry)
        finally:
            self._drop()
