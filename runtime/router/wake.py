"""Waking a sleeping pod on demand: the router's side of a warm tier.

A pod in sleep mode (runtime/server/sleep.py) keeps its process and, at level 1, its weights in host
memory; its `/ready` answers 503 "sleeping", so the router's probe keeps it out of rotation and marks it
`asleep` (health.py). When requests are held in the router's queue for targets that have no available
endpoint but an asleep one, the router sends `POST /wake_up` to one of them (through the router's session,
so with the backend's internal key, pod_auth.py), then probes it at once: the held requests go as soon as
it answers ready, not at the next probe tick.

How much is woken:
- one pod per burst of demand: while a wake of one of the target's endpoints is in flight, the held
  requests wait for it rather than waking the others too. A second pod is woken only if requests are still
  held, with no endpoint available, after the first wake ended (it failed, or the pod did not come ready);
- nothing is woken while the target has an available endpoint, even one at its in-flight limit: more
  capacity than the awake pods give is the operator's decision (it sees the pending requests);
- at most one wake in flight per endpoint; a failed wake (an answer other than 200, no answer within
  `timeout`, an unreachable pod) is logged with its reason and that endpoint is not tried again for
  `backoff` seconds. Waking takes seconds (level 2 reloads the weights), hence the long timeout.
Among a target's asleep endpoints, the lightest sleep goes first (level 1 keeps the weights in host
memory, level 2 does not).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager

import aiohttp
from tokenfleet.runtime.router.endpoints import Endpoint

log = logging.getLogger(__name__)

WAKE_PATH = "/wake_up"
WAKE_TIMEOUT_S = 60.0
WAKE_BACKOFF_S = 5.0


class Waker:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        candidates: Callable[[Sequence], list[Endpoint]],
        probe: Callable[[Endpoint], Awaitable[None]],
        on_outcome: Callable[[Endpoint, str], None],
        clock: Callable[[], float] = time.monotonic,
        timeout: float = WAKE_TIMEOUT_S,
        backoff: float = WAKE_BACKOFF_S,
    ) -> None:
        """`candidates(targets)`: the asleep endpoints a held request's targets could be served by once
        woken (none while one of its targets has an available endpoint); `probe(ep)` probes it now
        and applies the outcome; `on_outcome(ep, outcome)` counts each wake (ok, refused, timeout, error)."""
        self.session = session
        self._candidates = candidates
        self._probe = probe
        self._on_outcome = on_outcome
        self.clock = clock
        self.timeout = timeout
        self.backoff = backoff
        self._held: dict[int, Callable[[], Sequence]] = {}  # one per held request: its targets, now
        self._ids = itertools.count()
        self.waking: dict[str, float] = {}  # endpoint id -> when its wake was sent
        self.backoff_until: dict[str, float] = {}  # endpoint id -> not woken again before this
        self.last_error: dict[str, str] = {}  # endpoint id -> why its last wake failed
        self._tasks: set[asyncio.Task] = set()
        self._timer: asyncio.TimerHandle | None = None  # the next look once a back-off ends
        self._closed = False

    @property
    def has_demand(self) -> bool:
        return bool(self._held)

    @contextmanager
    def held(self, targets_of: Callable[[], Sequence]) -> Iterator[None]:
        """While a request waits in the queue: `targets_of()` gives its targets under the current policy."""
        token = next(self._ids)
        self._held[token] = targets_of
        try:
            self.check()
            yield
        finally:
            del self._held[token]

    def check(self) -> None:
        """Start the wakes the held requests call for now (see the module's rules)."""
        if self._closed or not self._held:
            return
        now = self.clock()
        seen: set[tuple[str, ...]] = set()
        for targets_of in list(self._held.values()):
            asleep = self._candidates(targets_of())
            group = tuple(sorted(ep.id for ep in asleep))
            if not asleep or group in seen:
                continue
            seen.add(group)
            if any(ep.id in self.waking for ep in asleep):
                continue  # this burst's wake is under way
            ready = [ep for ep in asleep if self.backoff_until.get(ep.id, 0.0) <= now]
            if ready:
                # The lightest sleep first; level 0: it is still finishing requests before it sleeps.
                self._start(min(ready, key=lambda e: (e.sleep_level or 3, e.url)))
            else:
                self._look_again(min(self.backoff_until[ep.id] for ep in asleep) - now)

    def _look_again(self, delay: float) -> None:
        """Run `check` again in `delay` seconds (the earliest of the asked-for times)."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(delay, 0.0) + 0.01  # a timer may fire a hair early: never before the end
        if self._timer is not None and not self._timer.cancelled() and self._timer.when() <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer = None
        self.check()

    def _start(self, ep: Endpoint) -> None:
        self.waking[ep.id] = self.clock()
        task = asyncio.get_running_loop().create_task(self._wake(ep))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wake(self, ep: Endpoint) -> None:
        started = self.clock()
        outcome, reason = "ok", ""
        try:
            try:
                timeout = aiohttp.ClientTimeout(total=self.timeout)
                async with self.session.post(ep.url + WAKE_PATH, timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        outcome, reason = "refused", f"answered {resp.status}: {text[:200].strip()}"
            except TimeoutError:
                outcome, reason = "timeout", f"no answer within {self.timeout:g} s"
            except (aiohttp.ClientError, OSError) as e:
                outcome, reason = "error", f"{type(e).__name__}: {e}"
            if outcome == "ok":
                await self._probe(ep)  # the held requests go now, not at the next probe tick
                log.info("woke %s (backend %s) in %.2f s", ep.url, ep.backend, self.clock() - started)
                self.last_error.pop(ep.id, None)
                if not ep.health.is_available(self.clock()):
                    # Awake by its own word but not ready yet: its probes take it in; not woken again meanwhile.
                    self._back_off(ep)
            else:
                log.warning(
                    "waking %s (backend %s) failed: %s; not tried again for %g s",
                    ep.url,
                    ep.backend,
                    reason,
                    self.backoff,
                )
                self.last_error[ep.id] = reason
                self._back_off(ep)
            self._on_outcome(ep, outcome)
        finally:
            self.waking.pop(ep.id, None)
        self.check()  # requests still held with nothing available: another pod, or this one after back-off

    def _back_off(self, ep: Endpoint) -> None:
        self.backoff_until[ep.id] = self.clock() + self.backoff

    def forget(self, endpoint_id: str) -> None:
        """The endpoint left discovery (a wake still in flight finishes on its own)."""
        self.backoff_until.pop(endpoint_id, None)
        self.last_error.pop(endpoint_id, None)

    def state(self, ep: Endpoint) -> dict:
        """What /v1/config shows of one endpoint's sleep."""
        out: dict = {"asleep": ep.health.asleep, "waking": ep.id in self.waking}
        if ep.health.asleep and ep.sleep_level:
            out["sleep_level"] = ep.sleep_level
        retry = self.backoff_until.get(ep.id, 0.0) - self.clock()
        if retry > 0:
            out["wake_retry_in_seconds"] = round(retry, 2)
        if ep.id in self.last_error:
            out["last_wake_error"] = self.last_error[ep.id]
        return out

    async def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
