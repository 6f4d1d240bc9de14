"""The adapter placement rule (adapter_placement.adapter_candidates) as a pure function of what pods report:
which adapters each holds, how many it could load now (`lora_room`), and its load."""

from __future__ import annotations

from tokenfleet.runtime.router.adapter_placement import AdapterDrains, adapter_candidates, within_max_copies
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


def test_a_place_is_made_from_the_most_copied_adapter_on_its_least_loaded_pod():
    """No pod holds "new" or has room: the adapter with the most copies gives one up (on the least loaded
    of its pods); its requests then avoid that copy while other holders can take them; the drain ends when
    the copy is gone from the pod's report, or at its timeout — and never twice for one adapter."""
    a = pod("a", 5, ("hot", "x"), room=0)
    b = pod("b", 1, ("hot", "y"), room=0)
    c = pod("c", 3, ("hot", "z"), room=0)
    d = pod("d", 0, ("solo", "y"), room=0)
    eps = [a, b, c, d]
    drains = AdapterDrains(timeout_s=10.0, pods_per_drain=1)  # a drain per pod at once may go
    assert drains.make_place("new", eps, now=0.0) is b  # "hot" has three copies; b is the least loaded
    assert drains.make_place("new", eps, now=1.0) is None  # one place at a time per adapter
    assert names(adapter_candidates("hot", eps, BALANCE, drains)) == ["a", "c"]
    assert names(adapter_candidates("y", eps, BALANCE, drains)) == ["b", "d"]  # only "hot" is drained on b
    # Another held adapter gets another pod: "hot" (a, c) and "y" (b, d) have two copies left each; d is the
    # least loaded of their pods not draining already.
    assert drains.make_place("other", eps, now=1.0) is d
    assert names(adapter_candidates("y", eps, BALANCE, drains)) == ["b"]
    # A third: only "hot" has two copies left -> c, the less loaded of a and c.
    assert drains.make_place("third", eps, now=1.0) is c
    assert names(adapter_candidates("hot", eps, BALANCE, drains)) == ["a"]
    b.lora_adapters = {"new": "new@1", "y": "y@1"}  # b loaded "new", evicting its idle copy of "hot"
    drains.settle(eps, now=2.0)
    assert set(drains.by_pod) == {c.id, d.id}
    drains.settle(eps, now=11.0)  # time is up: the copies take requests again
    assert not drains and names(adapter_candidates("hot", eps, BALANCE, drains)) == ["a", "c"]


def test_no_place_is_made_from_an_only_copy():
    eps = [pod("a", 0, ("x",), room=0), pod("b", 0, ("y",), room=0)]
    assert AdapterDrains().make_place("new", eps, now=0.0) is None


def test_no_place_is_made_from_a_copy_its_adapter_keeps_as_a_minimum():
    """An adapter with minCopies 3 and three copies gives none up (the operator pins them): the place comes
    from the next most copied adapter."""
    eps = [pod("a", 0, ("pinned", "x"), room=0), pod("b", 1, ("pinned", "x"), room=0)]
    eps.append(pod("c", 2, ("pinned", "y"), room=0))
    assert AdapterDrains().make_place("new", eps, now=0.0, min_copies={"pinned": 3}) is eps[0]  # "x" on a
    assert AdapterDrains().make_place("new", eps, now=0.0) is eps[0]  # unbounded: "pinned" (3 copies) on a
    assert AdapterDrains().make_place("new", eps, now=0.0, min_copies={"pinned": 3, "x": 2}) is None


def test_at_its_maximum_an_adapters_requests_go_only_to_its_holders():
    busy = pod("busy", 9, ("sql",), room=0)
    idle = pod("idle", 0, room=3)
    assert names(within_max_copies("sql", [busy, idle], None)) == ["busy", "idle"]
    assert names(within_max_copies("sql", [busy, idle], 2)) == ["busy", "idle"]  # one more copy may come
    assert names(within_max_copies("sql", [busy, idle], 1)) == ["busy"]
    # Without the bound the busy holder would spill to the idle pod.
    assert names(adapter_candidates("sql", [busy, idle], BALANCE)) == ["busy", "idle"]
    # A pod the router sent the adapter to since its last report is loading it: a copy, counted.
    loading, other = pod("loading", 0, room=3), pod("other", 0, room=3)
    loading.lora_active = frozenset({"sql"})
    assert names(within_max_copies("sql", [busy, loading, other], 2)) == ["busy", "loading"]


def slotted(
    name: str, load: int, adapters: tuple[str, ...], active: tuple[str, ...], room: int = 4
) -> Endpoint:
    ep = pod(name, load, adapters, room)
    ep.lora_active, ep.lora_slots = frozenset(active), 2
    return ep


def test_a_pod_whose_slots_other_adapters_take_is_no_holder_and_has_no_room():
    """Two slots per step: a pod running two other adapters would make the request wait for one of them to
    finish all its requests (a request's lifetime), host room or not. A pod that can run it at once is
    preferred — a holder, else one that loads it — and a slot-blocked holder is the last resort."""
    blocked = slotted("blocked", 0, ("sql", "a", "b"), active=("a", "b"))  # holds sql, both slots taken
    joins = slotted("joins", 5, ("sql", "a"), active=("sql", "a"))  # sql steps there already
    free = slotted("free", 1, ("c",), active=("c",))  # one slot free, host room: loads it
    full = slotted("full", 0, ("d",), active=("d", "e"))  # no slot free
    assert names(adapter_candidates("sql", [blocked, joins, free, full], BALANCE)) == ["joins", "free"]
    assert names(adapter_candidates("sql", [blocked, free, full], BALANCE)) == ["free"]
    assert names(adapter_candidates("sql", [blocked, full], BALANCE)) == ["blocked"]  # no load, waits a slot
    assert names(adapter_candidates("new", [blocked, full], BALANCE)) == ["blocked", "full"]  # anywhere
    # A pod that does not report slots is taken at its word, as for room.
    silent = pod("silent", 3, room=1)
    assert names(adapter_candidates("sql", [blocked, silent], BALANCE)) == ["silent"]


def test_drains_are_few_at_once_one_per_eight_pods():
    """Each drain sends its copy's requests to the adapter's other holders: at most one at a time per eight
    pods (at least one), so a saturated fleet does not drain its hot adapters' copies over and over."""
    eps = [pod(f"p{i}", i, ("hot", f"x{i}"), room=0) for i in range(16)]
    drains = AdapterDrains(timeout_s=10.0)
    assert drains.make_place("a", eps, now=0.0) is eps[0]
    assert drains.make_place("b", eps, now=0.0) is eps[1]
    assert drains.make_place("c", eps, now=0.0) is None  # two at once for sixteen pods
    drains.settle(eps, now=11.0)
    assert drains.make_place("c", eps, now=11.0) is eps[0]
    assert AdapterDrains().make_place("a", eps[:4], now=0.0) is eps[0]  # a small fleet still gets one
