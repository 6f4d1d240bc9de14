"""A request's priority number: asking can lower urgency, never raise it past the API key's tier."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.router.config import PriorityClass
from tokenfleet.runtime.router.priority_classes import PriorityClasses, PriorityError

CLASSES = PriorityClasses(
    [
        PriorityClass(name="interactive", priority=-10, tiers=("gold",)),
        PriorityClass(name="standard", priority=0),
        PriorityClass(name="batch", priority=10, tiers=("bulk",)),
        PriorityClass(name="flex", priority=20),
    ]
)


def test_the_tier_gives_the_default():
    assert CLASSES.resolve("gold", True, None, {}).priority == -10
    assert CLASSES.resolve("bulk", True, None, {}).priority == 10
    assert CLASSES.resolve("unlisted", True, None, {}).priority == 0


def test_a_class_above_the_tier_is_lowered_to_it_not_obeyed():
    r = CLASSES.resolve("bulk", True, "interactive", {})
    assert (r.priority, r.lowered) == (10, True)
    r = CLASSES.resolve("unlisted", True, None, {"priority": -100})
    assert (r.priority, r.lowered) == (0, True)
    r = CLASSES.resolve("bulk", True, None, {"service_tier": "standard"})
    assert (r.priority, r.lowered) == (10, True)


def test_asking_for_less_urgency_is_obeyed():
    assert CLASSES.resolve("gold", True, "batch", {}).priority == 10
    assert CLASSES.resolve("gold", True, None, {"priority": 5}).priority == 5
    r = CLASSES.resolve("gold", True, None, {"service_tier": "flex"})
    assert (r.priority, r.lowered) == (20, False)


def test_several_ways_of_asking_take_the_least_urgent():
    assert (
        CLASSES.resolve("gold", True, "interactive", {"priority": 3, "service_tier": "batch"}).priority == 10
    )


def test_openai_default_service_tiers_mean_the_keys_default():
    for tier in ("auto", "default"):
        assert CLASSES.resolve("gold", True, None, {"service_tier": tier}).priority == -10


def test_without_api_keys_what_the_client_asks_for_is_obeyed():
    r = CLASSES.resolve("default", False, "interactive", {})
    assert (r.priority, r.lowered) == (-10, False)


@pytest.mark.parametrize(
    ("header", "payload", "param", "words"),
    [
        ("vip", {}, "priority", "unknown priority class 'vip'"),
        (None, {"service_tier": "scale"}, "service_tier", "unknown priority class 'scale'"),
        (None, {"service_tier": 3}, "service_tier", "must be a string"),
        (None, {"priority": "high"}, "priority", "must be an integer"),
        (None, {"priority": True}, "priority", "must be an integer"),
    ],
)
def test_bad_requests_name_the_problem(header, payload, param, words):
    with pytest.raises(PriorityError) as e:
        CLASSES.resolve("gold", True, header, payload)
    assert e.value.param == param and words in str(e.value)
    assert "interactive" in str(e.value) or "must be" in str(e.value)  # names the classes there are
