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
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.runtime.router.config import Balance
from tokenfleet.runtime.router.endpoints import Endpoint


def _has_room(ep: Endpoint) -> bool:
    return ep.lora_room is None or ep.lora_room > 0  # a pod that does not say is taken at its word


def adapter_candidates(adapter: str, eps: Sequence[Endpoint], balance: Balance) -> list[Endpoint]:
    """The endpoints among `eps` a request for `adapter` may go to (never empty when `eps` is not)."""
    holders = [ep for ep in eps if adapter in ep.lora_adapters]
    roomy = [ep for ep in eps if adapter not in ep.lora_adapters and _has_room(ep)]
    if not holders:
        return roomy or list(eps)
    if not roomy:
        return holders
    # Endpoint.load: the pod's last report brought up to date, or this router's requests there if more.
    least_holder = min(ep.load for ep in holders)
    least_other = min(ep.load for ep in roomy)
    if least_holder - least_other > balance.absolute and least_holder > balance.relative * least_other:
        return holders + roomy  # spill: the holders are clearly busier; the pod picked loads the adapter
    return holders
