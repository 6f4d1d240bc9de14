"""A simulated pod's LoRA adapters: which it holds, loading one it lacks, and refusing one it has no room for.

It models the engine's *loaded* level (`runtime/engine/lora_manager.py`: host memory, at most
`max_cpu_loras` — here `lora.max_adapters`): a request naming an adapter the pod does not hold makes the
pod load it, evicting the least recently used adapter that no request on the pod uses (running, waiting,
or waiting for a load); when every held adapter is in use the pod refuses the request as the server does
(503 `lora_slots_busy`), and the router tries another pod. The server loads an adapter before it submits
the request, off the engine loop, so a load delays only the requests that need it: they reach the scheduler
`load_s` after the load begins, while the running batch steps on. A request for an adapter that is loading
joins that load. The *slot* level (`max_loras` distinct adapters per step) is the real scheduler's own
rule: the replica passes `max_loras` to it.

Pins (`pin`) are the operator's minimum copies (operator/adapter_copies.py), as `LoRAManager.pin` keeps
them: a pinned adapter is loaded first if the pod lacks it, is never evicted for another until its lease
ends, and counts as a place in use in `room`.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimAdapter:
    """What a simulated `Request.lora` is. The scheduler only uses it as a set member (equal by name: one per
    adapter) and the KV manager hashes blocks with its `cache_key`, as it does with the engine's
    `LoRAAdapter`; the simulator has no weights to hold."""

    name: str
    cache_key: str


@functools.cache
def sim_adapter(name: str) -> SimAdapter:
    """The adapter named `name`, keyed `name@digest` as a pod reports it (the digest stands for the weights'
    sha256: stable, and different for every name)."""
    digest = hashlib.sha256(f"sim-adapter:{name}".encode()).hexdigest()[:16]
    return SimAdapter(name, f"{name}@{digest}")


# What `PodAdapters.request` says of a request: submit it now, it waits for its adapter's load, or refused.
READY, PARKED, BUSY = "ready", "parked", "busy"


class PodAdapters:
    """The adapters one pod holds (loaded or loading, least recently used first) and the requests parked
    until theirs is loaded. `on_load(name, ready_at)` is called for every load begun; the simulator then
    calls `load_done(name)` at `ready_at` and submits the requests it returns."""

    def __init__(self, max_adapters: int, load_s: float, on_load: Callable[[str, float], None]) -> None:
        self.max_adapters = max_adapters
        self.load_s = load_s
        self._on_load = on_load
        self._held: OrderedDict[str, None] = OrderedDict()  # LRU order: first = least recently used
        self._loading: dict[str, list] = {}  # name -> the requests parked until its load completes
        self._in_use: dict[str, int] = {}  # name -> requests on this pod (parked, waiting, running)
        self._pinned: dict[str, float] = {}  # name -> when its pin's lease ends
        self.num_parked = 0
        self.loads = 0
        self.swaps = 0  # loads that evicted another adapter
        self.refusals = 0  # requests refused for want of room (the server's 503 lora_slots_busy)
        self.max_held = 0  # the most held at once (never above max_adapters)

    def loaded(self) -> dict[str, str]:
        """What the pod's `/load` lists (`lora_adapters`): its loaded adapters, name -> key."""
        loading = self._loading
        return {name: sim_adapter(name).cache_key for name in self._held if name not in loading}

    def active(self) -> frozenset[str]:
        """What the pod's `/load` reports as `lora_active`: adapters with requests on the pod (as the engine
        counts them in flight: waiting or running; parked ones reach the scheduler when their load ends)."""
        return frozenset(self._in_use)

    def room(self, now: float) -> int:
        """What the pod's `/load` reports as `lora_room`: adapters it could load now (places free or held by
        an adapter no request uses and no pin holds)."""
        in_use = self._in_use
        return self.max_adapters - sum(
            1 for name in self._held if name in in_use or self._is_pinned(name, now)
        )

    def pinned(self, now: float) -> list[str]:
        """What the pod's `/load` reports as `lora_pinned`."""
        return [name for name in list(self._pinned) if self._is_pinned(name, now)]

    def pin(self, name: str, until: float, now: float) -> bool:
        """Keep `name` held until `until`, loading it first if the pod lacks it (evicting an idle, unpinned
        adapter if the pod is full); False, and nothing pinned, when there is no room (the pod's 503)."""
        held = self._held
        if name not in held:
            if not self._make_room(now):
                return False
            self._start_load(name, [], now)
        self._pinned[name] = until
        return True

    @property
    def held(self) -> list[str]:
        return list(self._held)

    def request(self, name: str, item: object, now: float) -> str:
        """A request for `name` reached the pod: READY when it can be submitted now (the adapter is loaded);
        PARKED when `item` waits for the adapter's load (it comes back from `load_done`); BUSY when the pod
        has no room to load it (refused: nothing of it stays here)."""
        held = self._held
        if name in held:
            held.move_to_end(name)
            parked = self._loading.get(name)
            if parked is None:
                self._in_use[name] = self._in_use.get(name, 0) + 1
                return READY
            parked.append(item)
        elif self._make_room(now):
            self._start_load(name, [item], now)
        else:
            self.refusals += 1
            return BUSY
        self._in_use[name] = self._in_use.get(name, 0) + 1
        self.num_parked += 1
        return PARKED

    def load_done(self, name: str) -> list:
        """`name`'s load completed: the requests parked for it, in arrival order."""
        parked = self._loading.pop(name)
        self.num_parked -= len(parked)
        return parked

    def release(self, name: str) -> None:
        """A request for `name` left the pod (finished, or refused by the scheduler)."""
        left = self._in_use[name] - 1
        if left:
            self._in_use[name] = left
        else:
            del self._in_use[name]  # idle now: the next adapter the pod lacks may evict it

    def _is_pinned(self, name: str, now: float) -> bool:
        until = self._pinned.get(name)
        if until is None:
            return False
        if now < until:
            return True
        del self._pinned[name]  # the lease ended: forgotten, as the engine forgets it
        return False

    def _make_room(self, now: float) -> bool:
        """Whether one more adapter fits, evicting the least recently used idle, unpinned one if the pod is
        full."""
        held = self._held
        if len(held) < self.max_adapters:
            return True
        in_use = self._in_use
        for name in held:
            if name not in in_use and not self._is_pinned(name, now):
                del held[name]
                self.swaps += 1
                return True
        return False

    def _start_load(self, name: str, parked: list, now: float) -> None:
        self._held[name] = None
        self._loading[name] = parked
        self.loads += 1
        self.max_held = max(self.max_held, len(self._held))
        self._on_load(name, now + self.load_s)
