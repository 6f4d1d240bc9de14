"""Fair share between tenants: a virtual token counter per tenant (the VTC idea), for any queue that
serves several tenants — the router's, where it holds requests back, and the engine's waiting queue.

A tenant is a client API key (or the value of a configured header, when a trusted gateway in front names
tenants). Each tenant's counter is the service it has received: prompt tokens x `input_weight` when its
request is sent to a pod (or its chunk is scheduled, in the engine), output tokens x `output_weight` as they
are generated (the router counts a stream's events as they pass), divided by the tenant's weight
(its key tier's `tierWeights`, default 1). Among waiters of the same priority, the tenant with the smallest
counter goes next, first come first served within a tenant: a flood from one tenant cannot push another's
requests behind it, and the flood still gets whatever capacity the others leave.

A tenant that had nothing waiting and nothing in flight starts again at most RETURN_CREDIT below the
smallest counter among the active tenants (if its own is lower): idling earns no more credit than that to
burst with later, and a newcomer does not owe the history of the others. That small credit is what lets a
light tenant's request go ahead of a flood the moment it arrives — with counters equal it would queue
behind the flood's earlier requests — and the engine preempts for a tenant RETURN_CREDIT behind (the same
amount, so a returning light tenant is served at once). Priority bands stay strict — fairness orders
requests within a band.

Pure and on no clock: the live router, the engine's scheduler and the simulator call the same object.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

# Tenants remembered while inactive; beyond it, those that would be lifted anyway on return are forgotten.
MAX_IDLE_TENANTS = 4096
# Service (weighted tokens: a prompt token 1, a generated one 2 by default) a tenant back from idle may be
# behind the least-served active one. A few steps of a busy batch: it puts the returning tenant first and
# lets the engine preempt for it, yet two tenants of equal demand cannot swap a slot every step.
RETURN_CREDIT = 64.0


class FairShare:
    def __init__(
        self,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        tier_weights: Mapping[str, float] | None = None,
    ) -> None:
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.tier_weights = dict(tier_weights or {})
        self.counters: dict[str, float] = {}
        self.active: Counter[str] = Counter()  # requests waiting or in flight, per tenant

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def join(self, tenant: str) -> None:
        """A request of `tenant` arrives (it waits or runs until `leave`)."""
        if not self.active[tenant]:
            floor = min((self.counters.get(t, 0.0) for t, n in self.active.items() if n), default=None)
            if floor is not None and self.counter(tenant) < floor - RETURN_CREDIT:
                self.counters[tenant] = floor - RETURN_CREDIT
            self.counters.setdefault(tenant, 0.0)
            if len(self.counters) > MAX_IDLE_TENANTS:
                self._forget_idle(floor - RETURN_CREDIT if floor is not None else None)
        self.active[tenant] += 1

    def leave(self, tenant: str) -> None:
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]

    def charge_prompt(self, tenant: str, tokens: int, tier: str = "default") -> None:
        self._charge(tenant, tokens * self.input_weight, tier)

    def charge_output(self, tenant: str, tokens: int, tier: str = "default") -> None:
        self._charge(tenant, tokens * self.output_weight, tier)

    def _charge(self, tenant: str, cost: float, tier: str) -> None:
        self.counters[tenant] = self.counter(tenant) + cost / self.tier_weights.get(tier, 1.0)

    def _forget_idle(self, floor: float | None) -> None:
        for t in [
            t for t, c in self.counters.items() if not self.active[t] and (floor is None or c <= floor)
        ]:
            del self.counters[t]
