"""The adapter placement rule (adapter_placement.adapter_candidates) as a pure function of what pods report:
which adapters each holds, how many it could load now (`lora_room`), and its load."""

from __future__ import annotations

from tokenfleet.runtime.router.adapter_placement import adapter_candidates
from tokenfleet.runtime.router.config import Balance, Discovery
from tokenfleet.runtime.router.endpoints import Endpoint
from tokenfleet.runtime.router.health import HealthState

BALANCE = Balance(absolute=2, relative=1.5)


def pod(name: str, load: int, adapters: tuple[str, ...] = (), room: int | None = None) -> Endpoint:
    ep = Endpoint(f"http://{name}", "b", "m", HealthState(Discovery()))
    ep.in_flight = load
    ep.lora_adapters = {a: f"{a}@digest" for a in adapters}
    ep.lora_room = room
    return ep


def names(eps) -> list[str]:
    return [ep.url.removeprefix("http://") for ep in eps]


def test_holders_keep_their_adapter_until_clearly_busier_than_a_pod_with_room():
    a, b, c = pod("a", 3, ("sql",)), pod("b", 1, room=2), pod("c", 0, room=0)
    assert names(adapter_candidates("sql", [a, b, c], BALANCE)) == ["a"]  # 3 - 1 is within the margin
    a.in_flight = 6
    # Clearly busier than b (the pod with room); c is idle but has no room: a load there would be refused.
    assert names(adapter_candidates("sql", [a, b, c], BALANCE)) == ["a", "b"]
    b.lora_room = 0
    assert names(adapter_candidates("sql", [a, b, c], BALANCE)) == ["a"]  # nowhere to spill: stay


def test_an_adapter_no_pod_holds_goes_where_it_can_be_loaded_now():
    full = pod("full", 0, ("x", "y"), room=0)
    roomy = pod("roomy", 5, ("z",), room=1)
    silent = pod("silent", 9)  # reports no room figure: taken as having room
    assert names(adapter_candidates("sql", [full, roomy, silent], BALANCE)) == ["roomy", "silent"]
    roomy.lora_room = 0
    silent.lora_room = 0
    # No room anywhere: any pod (the first to finish a request has room first).
    assert names(adapter_candidates("sql", [full, roomy, silent], BALANCE)) == ["full", "roomy", "silent"]


def test_every_pod_holding_it_means_every_pod():
    eps = [pod("a", 4, ("sql",), room=0), pod("b", 0, ("sql",), room=0)]
    assert adapter_candidates("sql", eps, BALANCE) == eps
