"""Where a LoRA adapter's request may go: the pods that hold the adapter, unless they are busy — then any.

A pod holds the adapters its `/load` lists (`Endpoint.lora_adapters`); a pod that does not hold one loads it
from its path when a request names it (a few to tens of milliseconds for the files, evicting the least
recently used idle adapter when its host memory is full). So placement is a routing decision: keep an
adapter's requests on its holders (no load, no eviction elsewhere, and their prefix cache), and spill to
the others only when the holders are clearly busier — by the same queue rule the balance guard uses
(`routing.balance`: the least-loaded holder carries more than `absolute` requests and `relative` times
the least-loaded other pod). Once a spill has loaded the adapter there, that pod is a holder too, so the
set of pods serving an adapter grows with its load and shrinks as idle copies are evicted. The margin is
the hysteresis: a holder set that is merely a little busier never spills, so copies do not flap.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.runtime.router.config import Balance
from tokenfleet.runtime.router.endpoints import Endpoint


def adapter_candidates(adapter: str, eps: Sequence[Endpoint], balance: Balance) -> list[Endpoint]:
    """The endpoints among `eps` a request for `adapter` may go to (never empty when `eps` is not)."""
    holders = [ep for ep in eps if adapter in ep.lora_adapters]
    if not holders or len(holders) == len(eps):
        return list(eps)
    # Endpoint.load: the pod's last report brought up to date, or this router's requests there if more.
    least_holder = min(ep.load for ep in holders)
    least_other = min(ep.load for ep in eps if adapter not in ep.lora_adapters)
    if least_holder - least_other > balance.absolute and least_holder > balance.relative * least_other:
        return list(eps)  # spill: the holders are clearly busier; the pod picked loads the adapter
    return holders
