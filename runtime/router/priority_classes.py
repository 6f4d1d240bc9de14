"""A request's priority number: what the client asks for, never more urgent than its API key's tier allows.

A client can ask three ways — the priority header naming a class, OpenAI's `service_tier` body field
naming a class (`auto` and `default` mean "my key's default"), or vLLM's integer `priority` in the body.
Asking can only LOWER urgency: with API keys on, the key's tier fixes its most urgent number (the class
that lists the tier, else 0), and a request asking for more is served at that number, not refused — a
client that cannot tell its tier still gets an answer. Without API keys nobody is identified, so what the
client asks for is obeyed.

The router then writes the one number into both the forwarded header and the body's `priority`, so the
router's queue and the pod's scheduler rank the request the same way (a body `priority` no longer
overrides the router on the pod).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenfleet.runtime.router.config import PriorityClass

# OpenAI's `service_tier` values that ask for nothing in particular.
DEFAULT_SERVICE_TIERS = frozenset({"auto", "default"})


class PriorityError(ValueError):
    """The request names a class that does not exist, or gives a `priority` that is not an integer."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Resolved:
    priority: int
    lowered: bool  # the request asked for more than its tier allows


class PriorityClasses:
    def __init__(self, classes: Sequence[PriorityClass]) -> None:
        self.by_name = {c.name: c.priority for c in classes}
        self.by_tier = {t: c.priority for c in classes for t in c.tiers}

    def default_for(self, tier: str) -> int:
        return self.by_tier.get(tier, 0)

    def resolve(self, tier: str, keyed: bool, header: str | None, payload: Mapping) -> Resolved:
        """The number for a request of an API key of `tier` (`keyed`: keys are on, so the tier binds)."""
        asked: list[int] = []
        if header is not None:
            asked.append(self._class(header, "priority"))
        service_tier = payload.get("service_tier")
        if service_tier is not None:
            if not isinstance(service_tier, str):
                raise PriorityError("`service_tier` must be a string", "service_tier")
            if service_tier not in DEFAULT_SERVICE_TIERS:
                asked.append(self._class(service_tier, "service_tier"))
        body = payload.get("priority")
        if body is not None:
            if isinstance(body, bool) or not isinstance(body, int):
                raise PriorityError("`priority` must be an integer", "priority")
            asked.append(body)
        default = self.default_for(tier)
        # Several ways of asking at once: the least urgent wins, as each may only lower it.
        number = max(asked) if asked else default
        if keyed and number < default:
            return Resolved(default, True)
        return Resolved(number, False)

    def _class(self, name: str, param: str) -> int:
        if name not in self.by_name:
            known = ", ".join(sorted(self.by_name)) or "none are configured"
            raise PriorityError(f"unknown priority class {name!r} (classes: {known})", param)
        return self.by_name[name]
