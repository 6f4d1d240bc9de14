"""`decision.decide`, the choice the live router and the simulator share."""

from __future__ import annotations

from tokenfleet.runtime.router.config import RoutingSpec
from tokenfleet.runtime.router.decision import AT_CAPACITY, NO_READY_ENDPOINT, EndpointState, decide
from tokenfleet.runtime.router.scoring import RouteQuery, make_strategy

SPEC = RoutingSpec(strategy="least-load")


def test_no_endpoint_and_all_at_the_limit_say_why():
    strategy = make_strategy(SPEC, clock=lambda: 0.0)
    assert decide(strategy, RouteQuery(), [], {}, 2) == (None, NO_READY_ENDPOINT)
    full = [EndpointState("a", 0, 2), EndpointState("b", 0, 3)]
    assert decide(strategy, RouteQuery(), full, {}, 2) == (None, AT_CAPACITY)
    # An admitted request (a retry, a decode phase) passes the limit rather than fail.
    assert decide(strategy, RouteQuery(), full, {}, 2, admitted=True).decision.endpoint_id == "a"


def test_an_endpoint_at_the_limit_is_skipped_while_another_is_below_it():
    strategy = make_strategy(SPEC, clock=lambda: 0.0)
    states = [EndpointState("a", 0, 2), EndpointState("b", 9, 1)]
    assert decide(strategy, RouteQuery(), states, {}, 2).decision.endpoint_id == "b"


def test_load_is_the_larger_of_the_report_and_the_in_flight_count():
    strategy = make_strategy(SPEC, clock=lambda: 0.0)
    # a: reported 1 but 5 in flight here (load 5); b: reported 4, 0 in flight (load 4).
    states = [EndpointState("a", 1, 5), EndpointState("b", 4, 0)]
    assert decide(strategy, RouteQuery(), states, {}, 32).decision.endpoint_id == "b"


def test_prefix_matches_reach_the_strategy():
    strategy = make_strategy(RoutingSpec(strategy="prefix-affinity"), clock=lambda: 0.0)
    states = [EndpointState("a", 0, 0), EndpointState("b", 0, 0)]
    d = decide(strategy, RouteQuery(4, None, b"k"), states, {"b": 4}, 32).decision
    assert (d.endpoint_id, d.reason, d.prefix_blocks) == ("b", "prefix_hit", 4)
