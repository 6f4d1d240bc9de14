"""An adapter's minimum copies: which Ready pods the operator pins it on, so that many always hold it.

A pod holds the adapters requests brought it, evicting the least recently used idle one when a new one
needs the place; the routers keep an adapter's requests on the pods that hold it. A rarely used adapter is
therefore evicted everywhere sooner or later, and its next request waits for a load (and, from the Hub, a
download). `spec.adapters[].minCopies` says how many pods must keep it anyway: each tick of the adapter
report (every few seconds) pins it, for a lease of a few ticks, on that many Ready pods — the pods that hold
it already first (pinning them loads nothing, and the choice stays put from tick to tick), then the least
loaded pods with room, which load it. A pinned adapter is not evicted for another one while its lease
lasts, and it counts as a place in use in the pod's `lora_room`, so the routers send other adapters
elsewhere. The lease ends by itself when the operator stops renewing it (the adapter is unlisted, its
minCopies lowered, the pod not chosen any more, or the operator gone): nothing is pinned forever.

Pure: the choice from the pods' /load answers. The asking and the pinning are in adapter_report.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenfleet.operator.adapter_status import loaded_adapters

# A pin outlives a few missed ticks (a slow API, an operator restart), never a deployment's lifetime.
PIN_TICKS = 6


@dataclass(frozen=True, slots=True)
class PodLoad:
    """One Ready pod as its /load answered: the adapters it holds, its room for more, its queue."""

    name: str
    adapters: frozenset[str]
    room: int | None  # None: the pod did not say
    load: int

    @staticmethod
    def of(name: str, answer: Mapping[str, Any] | None) -> PodLoad | None:
        """None for a pod that did not answer (it gets no pin this tick)."""
        if not isinstance(answer, Mapping):
            return None
        room = answer.get("lora_room")
        load = sum(v for k in ("num_running", "num_waiting") if isinstance(v := answer.get(k), int))
        return PodLoad(name, loaded_adapters(answer), room if isinstance(room, int) else None, load)


def pins(
    min_copies: Mapping[str, int], pods: Sequence[PodLoad], host_limit: int, listed: int
) -> list[tuple[str, str]]:
    """(pod, adapter) pairs to pin now: each adapter with a minimum on that many pods (at most one per pod,
    never more than the pods there are), holders first by name, then the least loaded pods with room.
    When the `listed` adapters outnumber a pod's `host_limit` places, no pod gets more pins than its places
    less one: one place always stays for the adapters requests bring, so no pod refuses every other one
    (with fewer listed than places every pod holds them all, and pins only keep it so)."""
    per_pod = host_limit - 1 if listed > host_limit else host_limit
    given: dict[str, int] = {}
    out: list[tuple[str, str]] = []
    # The scarcest first: an adapter with a high minimum is placed before the pods fill with pins.
    for adapter, wanted in sorted(min_copies.items(), key=lambda item: (-item[1], item[0])):
        want = min(wanted, len(pods))
        holders = sorted((p for p in pods if adapter in p.adapters), key=lambda p: p.name)
        others = sorted(
            (p for p in pods if adapter not in p.adapters and (p.room is None or p.room > 0)),
            key=lambda p: (p.load, p.name),
        )
        for pod in [*holders, *others]:
            if want == 0:
                break
            if given.get(pod.name, 0) >= per_pod:
                continue
            given[pod.name] = given.get(pod.name, 0) + 1
            out.append((pod.name, adapter))
            want -= 1
    return out
