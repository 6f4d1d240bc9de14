"""Where a LoRA adapter's request may go: the pods that hold the adapter, unless they are busy — then the
pods with room to load it.

A pod holds the adapters its `/load` lists (`Endpoint.lora_adapters`); a pod that does not hold one loads it
from its path when a request names it (a few to tens of milliseconds for the files), evicting its least
recently used idle adapter when its host memory is full — and refusing (503) when every adapter it holds
has requests in flight. Its `/load` says how many it could load now (`lora_room`: free or idle places).
So placement is a routing decision: keep an adapter's requests on its holders (no load, no eviction
elsewhere, and their prefix cache), and send them elsewhere only to pods with room, and only when the
holders are clearly busier — by the same queue rule the balance guard uses (`routing.balance`: the
least-loaded holder carries more than `absolute` requests and `relative` times the least-loaded pod with
room). Once a spill has loaded the adapter there, that pod is a holder too, so the set of pods serving an
adapter grows with its load and shrinks as idle copies are evicted. The margin is the hysteresis: a holder
set that is merely a little busier never spills, so copies do not flap. An adapter no pod holds goes to the
pods with room; without room anywhere, to any pod (one of them will have room first).

Slots bound it too: a pod steps at most `lora_slots` distinct adapters at once (`max_loras`, device
slots), however many it holds in host memory, so a request for an adapter that is not active there (no
request of it in flight: `lora_active`) would wait for a whole request's lifetime until one is free. A pod
counts as a holder or as having room only while the adapter is active there or a slot is free; a holder
whose slots are all taken by other adapters is used only when no pod can run the request at once.

An adapter's `maxCopies` bounds the set: while that many pods hold it, its requests go only to them
(`within_max_copies`), however busy. Its `minCopies` are pinned on pods by the operator, which the pods do
not evict; a place is never made by draining one of those copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenfleet.runtime.router.config import Balance
from tokenfleet.runtime.router.endpoints import Endpoint


def _has_room(ep: Endpoint) -> bool:
    return ep.lora_room is None or ep.lora_room > 0  # a pod that does not say is taken at its word


def _slot_free(ep: Endpoint, adapter: str) -> bool:
    """Whether a request for `adapter` would step at once on `ep` as far as device slots go: the adapter is
    active there already, or fewer adapters than slots are (a pod that does not report slots: yes)."""
    slots = ep.lora_slots
    return slots is None or adapter in ep.lora_active or len(ep.lora_active) < slots


# The longest a copy is kept idle to make a place: about a few requests' lifetimes. A drain that frees no
# place by then (its adapter's requests there outlived it) ends, and the copy takes requests again.
DRAIN_TIMEOUT_S = 20.0
# At most one drain at a time per this many pods (at least one). A drained copy's requests go to the
# adapter's other holders, so every drain makes them busier: in the simulator's placement experiment (16
# pods, 100 adapters, 8 places each) a drain per pod at once met the SLO for 98.2 / 93.4 / 61.7 % of requests
# at 50 / 80 / 100 % load — at saturation the hot adapters' copies were drained over and over — one per 4
# pods 96.5 / 93.2 / 82.6 %, one per 8 pods 96.0 / 93.1 / 89.4 %, and no drains 93.9 / 92.5 / 89.0 %.
PODS_PER_DRAIN = 8


@dataclass(slots=True)
class Drain:
    """A place being made on one pod: `victim`'s copy there gets no new requests until it is idle, evicted
    or `until` passes; `for_adapter` is the adapter the place is made for."""

    victim: str
    for_adapter: str
    until: float


class AdapterDrains:
    """The places being made, at most one per pod: pod id -> `Drain`.

    When every adapter place of the fleet is in use, waiting for one to free by chance is waiting for an
    adapter to have no request on some pod — which a popular adapter never does. So when a request was
    refused everywhere for want of room, a place is made for the adapter's next requests: a copy
    of an adapter other pods also hold (its requests have somewhere else to go) gets no new requests on one
    pod, goes idle as they finish, and the pod's next load report shows the room; the adapter that needed
    it is loaded there and evicts the idle copy (least recently used). The most copied adapter gives up a
    copy first (its load spreads over the most other pods), on its least loaded pod (idle soonest). Drains
    are few at once (`pods_per_drain`): each one pushes its copy's requests onto the adapter's other holders.
    """

    def __init__(self, timeout_s: float = DRAIN_TIMEOUT_S, pods_per_drain: int = PODS_PER_DRAIN) -> None:
        self.timeout_s = timeout_s
        self.pods_per_drain = pods_per_drain
        self.by_pod: dict[str, Drain] = {}

    def __len__(self) -> int:
        return len(self.by_pod)

    def draining(self, ep: Endpoint, adapter: str) -> bool:
        drain = self.by_pod.get(ep.id)
        return drain is not None and drain.victim == adapter

    def settle(self, eps: Sequence[Endpoint], now: float) -> None:
        """End the drains whose copy is gone from its pod's report (among `eps`) or whose time is up (a pod
        not among `eps` — excluded from one pick, or gone — keeps its drain until then)."""
        if not self.by_pod:
            return
        listed = {ep.id: ep.lora_adapters for ep in eps}
        for pod, drain in list(self.by_pod.items()):
            held = listed.get(pod)
            if (held is not None and drain.victim not in held) or now >= drain.until:
                del self.by_pod[pod]

    def make_place(
        self, adapter: str, eps: Sequence[Endpoint], now: float, min_copies: Mapping[str, int] | None = None
    ) -> Endpoint | None:
        """Begin a drain for `adapter`, which no endpoint of `eps` holds or has room for; the pod chosen, or
        None when a place is being made for it already or no copy can be spared (an adapter's last copy, or
        one of its `min_copies`, never is)."""
        self.settle(eps, now)
        if len(self.by_pod) >= max(1, len(eps) // self.pods_per_drain):
            return None
        if any(d.for_adapter == adapter for d in self.by_pod.values()):
            return None
        copies: dict[str, int] = {}
        for ep in eps:
            for name in ep.lora_adapters:
                if not self.draining(ep, name):
                    copies[name] = copies.get(name, 0) + 1
        best: tuple[tuple[int, int], Endpoint, str] | None = None
        for ep in eps:
            if ep.id in self.by_pod:
                continue
            for name in ep.lora_adapters:
                n = copies.get(name, 0)
                spare = max(1, min_copies.get(name, 0)) if min_copies else 1
                if n <= spare or name == adapter:
                    continue
                key = (-n, ep.load)
                if best is None or key < best[0]:
                    best = (key, ep, name)
        if best is None:
            return None
        _, ep, victim = best
        self.by_pod[ep.id] = Drain(victim, adapter, now + self.timeout_s)
        return ep


def within_max_copies(adapter: str, eps: Sequence[Endpoint], max_copies: int | None) -> list[Endpoint]:
    """`eps`, or only those holding `adapter` when `max_copies` of them hold it already: no request for it
    goes where it would load one more copy than its maximum."""
    if max_copies is None:
        return list(eps)
    # A pod the router sent the adapter to since its last report holds it too (it is loading it): counted,
    # or the requests of one report period would load a copy on every pod they reach.
    holders = [ep for ep in eps if adapter in ep.lora_adapters or adapter in ep.lora_active]
    return holders if len(holders) >= max_copies else list(eps)


def adapter_candidates(
    adapter: str, eps: Sequence[Endpoint], balance: Balance, drains: AdapterDrains | None = None
) -> list[Endpoint]:
    """The endpoints among `eps` a request for `adapter` may go to (never empty when `eps` is not). A copy
    being drained (`drains`) takes none while another holder can."""
    held = [ep for ep in eps if adapter in ep.lora_adapters]
    if drains and len(held) > 1:
        kept = [ep for ep in held if not drains.draining(ep, adapter)]
        held = kept or held
    holders = [ep for ep in held if _slot_free(ep, adapter)]
    roomy = [
        ep for ep in eps if adapter not in ep.lora_adapters and _has_room(ep) and _slot_free(ep, adapter)
    ]
    if not holders:
        # A load elsewhere (tens of milliseconds) beats waiting for a slot (a request's lifetime); with no
        # pod able to run it at once, a holder (no load) or else any pod.
        return roomy or held or list(eps)
    if not roomy:
        return holders
    # Endpoint.load: the pod's last report brought up to date, or this router's requests there if more.
    least_holder = min(ep.load for ep in holders)
    least_other = min(ep.load for ep in roomy)
    if least_holder - least_other > balance.absolute and least_holder > balance.relative * least_other:
        return holders + roomy  # spill: the holders are clearly busier; the pod picked loads the adapter
    return holders
