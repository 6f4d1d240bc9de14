"""A pod's load as the router counts it: the last /load report (one poll old) brought up to date with this
router's own requests started and ended there since, and never below its own in-flight count.

Without the update, a pod whose stream ended a moment ago looks as busy as one still serving until the next
poll, and a client that sends its next request at once can be routed to the pod that is busy.
"""

from __future__ import annotations

import asyncio

from tokenfleet.runtime.router.config import Backend, Discovery, RouterConfig, RoutingSpec
from tokenfleet.runtime.router.endpoints import Endpoint
from tokenfleet.runtime.router.fleet import Fleet, PromptKey
from tokenfleet.runtime.router.health import HealthState
from tokenfleet.runtime.router.metrics import RouterMetrics


def endpoint() -> Endpoint:
    return Endpoint("http://pod:8000", "b", "m", HealthState(Discovery()))


def test_the_report_is_brought_up_to_date_until_the_next_one():
    ep = endpoint()
    ep.load_report(num_running=2, num_waiting=1, kv_cache_usage=0.5)
    assert (ep.reported_load, ep.load) == (3, 3)
    ep.since_report += 2  # two requests sent here after the report
    assert (ep.reported_load, ep.load) == (5, 5)
    ep.since_report -= 4  # those two and two of the reported ones ended here
    assert (ep.reported_load, ep.load) == (1, 1)
    ep.in_flight = 2  # another router's pod figure is lower than what this router has there
    assert ep.load == 2
    ep.since_report -= 5  # more ends than the report counted (it was taken before they started)
    assert ep.reported_load == 0
    ep.load_report(num_running=4, num_waiting=0, kv_cache_usage=0.1)
    assert (ep.reported_load, ep.since_report) == (4, 0)


def test_a_pod_whose_stream_just_ended_wins_over_a_busy_one_before_the_next_poll():
    async def run() -> None:
        spec = RoutingSpec(strategy="least-load")
        a, b = "http://a.test:8000", "http://b.test:8000"
        backends = (Backend(name="a", model="m", url=a), Backend(name="b", model="m", url=b))
        fleet = Fleet(RouterConfig(routing=spec, backends=backends), RouterMetrics(), None, watch=False)
        for backend in backends:
            fleet.sync_backend(backend, [backend.url])
        eps = fleet.endpoints.by_id
        for ep in eps.values():
            fleet.report(ep, True)  # a probe answered: in rotation
        targets = fleet.targets("m")

        def pick() -> str:
            got = fleet.pick(targets, PromptKey((1, 2, 3), "", None), None, frozenset())
            assert got is not None
            return got.endpoint.id

        # This router's stream runs on a; b serves another router's. A poll sees one running on each, and
        # a's cache is the fuller: on a tie, b would be chosen.
        fleet.acquire(eps[a])
        eps[a].load_report(1, 0, 0.6)
        eps[b].load_report(1, 0, 0.2)
        assert pick() == b  # the tie
        # a's stream ends; the client sends its next request before the next poll.
        fleet.release(eps[a])
        assert (eps[a].load, eps[b].load) == (0, 1)
        assert pick() == a
        # The next poll says what a runs now (someone else's request started there): the estimate is reset.
        eps[a].load_report(2, 0, 0.6)
        assert eps[a].load == 2 and pick() == b

    asyncio.run(run())
