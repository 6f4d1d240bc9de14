"""Which pods the operator pins an adapter on to keep its minimum copies (adapter_copies.pins)."""

from __future__ import annotations

from tokenfleet.operator.adapter_copies import PodLoad, pins


def pod(name: str, adapters: set[str] = frozenset(), room: int | None = 2, load: int = 0) -> PodLoad:
    return PodLoad(name, frozenset(adapters), room, load)


def test_holders_are_pinned_first_then_the_least_loaded_pods_with_room():
    pods = [
        pod("p0", load=1),
        pod("p1", {"sql"}, load=9),
        pod("p2", room=0, load=0),  # no room: would refuse to load it
        pod("p3", load=0),
    ]
    assert pins({"sql": 3}, pods, host_limit=4, listed=8) == [("p1", "sql"), ("p3", "sql"), ("p0", "sql")]


def test_the_choice_stays_put_from_tick_to_tick():
    """Once loaded where it was pinned, the same pods are chosen again (holders first): no churn."""
    first = pins({"sql": 2}, [pod("a", load=5), pod("b", load=0), pod("c", load=1)], host_limit=4, listed=8)
    assert first == [("b", "sql"), ("c", "sql")]
    # Next tick: b and c hold it now, and a became the least loaded.
    again = pins(
        {"sql": 2},
        [pod("a", load=0), pod("b", {"sql"}, load=3), pod("c", {"sql"}, load=4)],
        host_limit=4,
        listed=8,
    )
    assert again == first


def test_never_more_copies_than_pods_and_a_place_stays_free_for_other_adapters():
    pods = [pod("p0"), pod("p1")]
    assert pins({"a": 5}, pods, host_limit=4, listed=8) == [("p0", "a"), ("p1", "a")]
    # Two places per pod and more adapters listed than places: one pin per pod at most, the scarcest first.
    got = pins({"a": 1, "b": 2, "c": 1}, pods, host_limit=2, listed=5)
    assert got == [("p0", "b"), ("p1", "b")]
    # When every listed adapter fits on a pod, pins only keep them there: no place needs to stay free.
    assert len(pins({"a": 2, "b": 2}, pods, host_limit=2, listed=2)) == 4


def test_a_pod_that_did_not_answer_is_left_out():
    assert PodLoad.of("p0", None) is None
    got = PodLoad.of(
        "p1", {"lora_adapters": {"sql": "sql@1"}, "lora_room": 1, "num_running": 2, "num_waiting": 1}
    )
    assert got == PodLoad("p1", frozenset({"sql"}), 1, 3)
