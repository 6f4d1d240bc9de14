"""Which LoRA adapters a server has loaded, and which of them sit in the device slots a step computes with.

Three levels, as in vLLM:
- **Known**: every adapter a request may name — listed in `lora.modules`, or loaded through `POST
  /v1/load_lora_adapter` — with its path. Unloading forgets the name at once (404 for new requests);
  requests already holding the adapter finish with it.
- **Loaded** (host memory, at most `max_cpu_loras`): checked and parsed from its path (`register` from the
  API; `ensure_loaded` on first use, off the event loop), so a bad adapter is refused before anything
  changes. Loading one more than the limit evicts the least recently used adapter that no request is using
  (it stays known and is loaded again when asked for); when every one is in use the load is refused with a
  retry-after (nothing is ever pulled from under a running request). An adapter **pinned** (`pin`, for a
  lease) is not evicted either while its lease lasts: what keeps a deployment's minimum copies of an adapter
  on the pods the operator chose. A deployment may list more adapters
  than a pod holds at once: routers send an adapter's requests to the pods that hold it, and spill to
  another pod (which loads it) only when those are busy (router/fleet.py).
- **In a slot** (device, at most `max_loras`): assigned per step by `slots_for` on the engine thread, a copy
  from the host weights into the slot (no allocation). The scheduler never lets the running requests use
  more distinct adapters than there are slots, so a step always finds one; the slot evicted is the least
  recently used one the step does not need.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tokenfleet.runtime.config import LoRAConfig, LoRAModuleSpec
from tokenfleet.runtime.errors import AdaptersBusy, AdapterUnavailable, InvalidRequest, ModelNotFound
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.lora_adapter import LoRAAdapterWeights, load_adapter, shard_adapter
from tokenfleet.runtime.model.lora_slots import LoRASlots
from tokenfleet.runtime.model.lora_source import AdapterSources


@dataclass(eq=False)
class LoRAAdapter:
    """A loaded adapter as requests hold it (identity matters: a reload under the same name is another)."""

    name: str
    weights: LoRAAdapterWeights
    parent: str  # the base model's served name (listed as the adapter's `parent`)
    in_flight: int = 0  # requests added and not finished (engine thread writes, under the manager's lock)
    last_used: int = 0

    @property
    def cache_key(self) -> str:
        """What the KV block hashes carry: name and weights digest."""
        return f"{self.name}@{self.weights.digest}"

    @property
    def path(self) -> str:
        return self.weights.path


# Called when rank 0 loads a device slot under tensor parallelism: (slot, the whole adapter) -> the other
# ranks load their parts of it into the same slot before the next step.
Replicate = Callable[[int, LoRAAdapterWeights], None]


class LoRAManager:
    """`arch`: the whole model's shape (adapters are checked against it); `slots`: this rank's. Under tensor
    parallelism (`tp_size` > 1) rank 0 loads its part of an adapter and `replicate` has the others load theirs."""

    def __init__(
        self,
        config: LoRAConfig,
        slots: LoRASlots,
        arch: ModelArch,
        dtype: torch.dtype,
        parent: str,
        tp_size: int = 1,
        replicate: Replicate | None = None,
        sources: AdapterSources | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        # An adapter's path may be an hf:// repository: downloaded once per process, on the loading thread.
        self.sources = sources or AdapterSources(config.download_dir)
        self.slots = slots
        self._tp_size = tp_size
        self._replicate = replicate
        self._arch = arch
        self._dtype = dtype
        self._parent = parent
        self._lock = threading.Lock()
        self._adapters: dict[str, LoRAAdapter] = {}  # in host memory
        # Every adapter a request may name (listed in lora.modules or loaded through the API): name ->
        # (path, base model name). Evicting one from host memory keeps it here; unloading forgets it.
        self._known: dict[str, tuple[str, str | None]] = {}
        self._clock = 0  # a use counter: LRU order without reading time
        self._now = clock
        self._pinned: dict[str, float] = {}  # name -> when its pin ends (self._now's time)
        # Engine thread only: the adapter in each device slot, and when the slot was last used.
        self._slot_owner: list[LoRAAdapter | None] = [None] * slots.max_loras
        self._slot_used = [0] * slots.max_loras
        # Loads and evictions per level: their rate is the pod's adapter swap rate (thrash shows there).
        self.num_host_loads = 0
        self.num_host_evictions = 0
        self.num_slot_loads = 0
        self.num_slot_evictions = 0

    # ---- known and loaded adapters (any thread) -------------------------------------------------------------

    def register(self, name: str, path: str, base_model_name: str | None = None) -> LoRAAdapter:
        """Check, parse and load the adapter at `path` as `name`, and know it from now on (slow: file reads;
        not on the event loop). Raises InvalidRequest (a bad adapter, or a name taken by another adapter or
        already loaded) or AdaptersBusy; changes nothing then."""
        if not name or name == self._parent:
            raise InvalidRequest(f"`{name}` cannot name an adapter: it is the base model's name", "lora_name")
        with self._lock:
            known = self._known.get(name)
            if name in self._adapters or (known is not None and known[0] != path):
                raise InvalidRequest(f"The lora adapter `{name}` has already been loaded.", "lora_name")
        return self._load(name, path, base_model_name)

    def _load(self, name: str, path: str, base_model_name: str | None) -> LoRAAdapter:
        local = self.sources.local(path)
        weights = load_adapter(local, self._arch, self.config.max_lora_rank, self._dtype)
        adapter = LoRAAdapter(name, weights, base_model_name or self._parent)
        with self._lock:
            if name in self._adapters:  # a concurrent load of the same name won
                return self._adapters[name]
            if len(self._adapters) >= self.config.host_limit:
                now = self._now()
                idle = [
                    a for a in self._adapters.values() if a.in_flight == 0 and not self._held(a.name, now)
                ]
                if not idle:
                    raise AdaptersBusy(
                        f"all {self.config.host_limit} loaded adapters (max_cpu_loras) have requests in "
                        f"flight or are pinned; `{name}` can be loaded when one of them is idle",
                        retry_after=1.0,
                    )
                # Evicted from host memory only: still known, loaded again from its path when asked for.
                del self._adapters[min(idle, key=lambda a: a.last_used).name]
                self.num_host_evictions += 1
            self.num_host_loads += 1
            self._clock += 1
            adapter.last_used = self._clock
            self._adapters[name] = adapter
            self._known[name] = (path, base_model_name)
        return adapter

    def ensure_loaded(self, name: str) -> LoRAAdapter:
        """The adapter `name`, loaded from its path first if it is known but not in host memory (an adapter
        listed beyond max_cpu_loras, or evicted since). ModelNotFound when unknown; InvalidRequest when its
        files no longer load; AdaptersBusy when every loaded adapter has requests in flight."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is not None:
                self._clock += 1
                adapter.last_used = self._clock  # the most recent: the last one a concurrent load evicts
                return adapter
            known = self._known.get(name)
        if known is None:
            raise ModelNotFound(name)
        return self._load(name, *known)

    def unregister(self, name: str) -> None:
        """Forget `name` for new requests (ModelNotFound if unknown); in-flight requests finish with it."""
        with self._lock:
            known = self._known.pop(name, None)
            adapter = self._adapters.pop(name, None)
            self._pinned.pop(name, None)
        if known is None and adapter is None:
            raise ModelNotFound(name)

    def set_listed(self, old: Sequence[LoRAModuleSpec], new: Sequence[LoRAModuleSpec]) -> None:
        """Follow an edited `lora.modules`: a name the old list had and the new one drops (or points
        elsewhere) is forgotten; new entries become known, loaded on first use (`ensure_loaded`)."""
        wanted = {m.name: m for m in new}
        for spec in old:
            keep = wanted.get(spec.name)
            if keep is None or keep.path != spec.path:
                with contextlib.suppress(ModelNotFound):
                    self.unregister(spec.name)
        with self._lock:
            for spec in new:
                self._known.setdefault(spec.name, (spec.path, spec.base_model_name))

    def preload(self) -> list[tuple[str, Exception]]:
        """Load known adapters that are not in host memory while there is room (never evicting one), so
        their first requests do not wait for the files; (name, error) of each that failed to load."""
        failed = []
        for name, _, _ in self.known():
            with self._lock:
                if name in self._adapters:
                    continue
                if len(self._adapters) >= self.config.host_limit:
                    break
            try:
                self.ensure_loaded(name)
            except (InvalidRequest, AdaptersBusy, AdapterUnavailable, ModelNotFound) as exc:
                failed.append((name, exc))
        return failed

    def is_known(self, name: str) -> bool:
        with self._lock:
            return name in self._known

    def get(self, name: str) -> LoRAAdapter | None:
        """The adapter if it is in host memory now."""
        with self._lock:
            return self._adapters.get(name)

    def adapters(self) -> list[LoRAAdapter]:
        """The adapters in host memory, by name."""
        with self._lock:
            return sorted(self._adapters.values(), key=lambda a: a.name)

    def room(self) -> int:
        """Adapters this pod could load now without refusing (AdaptersBusy): its host places that are free or
        hold an adapter no request is using and no pin holds. Routers send an adapter no pod holds where
        there is room."""
        with self._lock:
            now = self._now()
            busy = sum(1 for a in self._adapters.values() if a.in_flight > 0 or self._held(a.name, now))
        return max(0, self.config.host_limit - busy)

    def pin(self, name: str, seconds: float) -> LoRAAdapter:
        """Keep `name` in host memory for `seconds` from now, loading it first if it is not (slow: file
        reads, maybe a download; not on the event loop): it is not evicted for another adapter until the pin
        ends, renewed by pinning again. ModelNotFound, InvalidRequest, AdaptersBusy, AdapterUnavailable as
        `ensure_loaded`; nothing is pinned then."""
        adapter = self.ensure_loaded(name)
        with self._lock:
            if self._adapters.get(name) is adapter:  # not unloaded or evicted meanwhile
                self._pinned[name] = self._now() + seconds
        return adapter

    def active(self) -> list[str]:
        """The adapters with requests in flight (waiting or running), by name: each needs a device slot to
        step, and only `max_loras` step at once, so routers send a request for another adapter here only
        while fewer are active (what `/load` reports with `lora_slots`)."""
        with self._lock:
            return sorted(a.name for a in self._adapters.values() if a.in_flight > 0)

    def pinned(self) -> list[str]:
        """The adapters pinned now, by name."""
        with self._lock:
            now = self._now()
            return sorted(n for n in self._pinned if self._held(n, now))

    def _held(self, name: str, now: float) -> bool:
        """Whether a pin holds `name` at `now` (under the lock; an ended pin is forgotten)."""
        until = self._pinned.get(name)
        if until is None:
            return False
        if now < until:
            return True
        del self._pinned[name]
        return False

    def known(self) -> list[tuple[str, str, str]]:
        """(name, path, parent) of every adapter requests may name, loaded or not, by name."""
        with self._lock:
            return [(n, p, b or self._parent) for n, (p, b) in sorted(self._known.items())]

    # ---- requests (engine thread) ---------------------------------------------------------------------------

    def acquire(self, name: str) -> LoRAAdapter:
        """The adapter a new request runs under, counted in flight until `release`. The server loaded it
        beforehand (`ensure_loaded`, off this thread); one evicted in between is loaded here. ModelNotFound
        when unknown."""
        adapter = self.ensure_loaded(name)
        with self._lock:
            adapter.in_flight += 1
            return adapter

    def release(self, adapter: LoRAAdapter) -> None:
        with self._lock:
            adapter.in_flight -= 1

    def slots_for(self, adapters: Sequence[LoRAAdapter | None]) -> tuple[int, ...]:
        """The device slot of each scheduled entry's adapter (-1: none), loading the ones not in a slot."""
        needed = {a for a in adapters if a is not None}
        if len(needed) > len(self._slot_owner):
            raise RuntimeError(
                f"a step uses {len(needed)} adapters but there are {len(self._slot_owner)} slots"
            )
        owner = self._slot_owner
        slot_of: dict[LoRAAdapter, int] = {}
        missing = []
        for adapter in needed:
            try:
                slot_of[adapter] = owner.index(adapter)
            except ValueError:
                missing.append(adapter)
        if missing:
            # Free slots first (never used: time 0), then the least recently used ones this step leaves alone.
            spare = sorted(
                (s for s in range(len(owner)) if owner[s] not in needed), key=lambda s: self._slot_used[s]
            )
            for adapter, slot in zip(missing, spare, strict=False):
                self.slots.load(slot, shard_adapter(adapter.weights, self._arch, 0, self._tp_size))
                if self._replicate is not None:
                    self._replicate(slot, adapter.weights)
                self.num_slot_evictions += owner[slot] is not None
                owner[slot] = adapter
                slot_of[adapter] = slot
                self.num_slot_loads += 1
        self._clock += 1
        for slot in slot_of.values():
            self._slot_used[slot] = self._clock
        return tuple(-1 if a is None else slot_of[a] for a in adapters)

    def swap_counts(self) -> dict[str, tuple[int, int]]:
        """Level ("host", "device") -> (adapters loaded, adapters evicted to make room), since start."""
        return {
            "host": (self.num_host_loads, self.num_host_evictions),
            "device": (self.num_slot_loads, self.num_slot_evictions),
        }

    def loaded_slots(self) -> dict[str, int]:
        """Adapter name -> its device slot, for the adapters in one (engine thread)."""
        return {a.name: s for s, a in enumerate(self._slot_owner) if a is not None}
