"""The router's front door against real aiohttp pods on loopback: tiers bound priorities, canary splits stick
to sessions, fallbacks take over (failure before the first byte, a primary over its queue bound, a primary
at zero), and held demand counts under the model the pods serve, never the alias."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from .conftest import until
from .test_proxy import CLIENT_TIMEOUT, backend, completion, post


async def _metric(url: str, name: str, labels: str = "") -> float:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s, s.get(url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(name + (f"{{{labels}}}" if labels else "")) and " " in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


CLASSES = [
    {"name": "interactive", "priority": -10, "tiers": ["gold"]},
    {"name": "batch", "priority": 10, "tiers": ["bulk"]},
]


async def test_a_key_cannot_raise_its_priority_and_router_and_pod_rank_with_one_number(
    serve_app, start_router, make_pod
):
    pod = make_pod()
    routing = {"priorityClasses": CLASSES}
    async with (
        serve_app(pod.app()) as pod_url,
        start_router([backend("a", pod_url)], routing, api_keys=["g:gold", "b:bulk"]) as (url, _),
    ):
        bulk, gold = {"Authorization": "Bearer b"}, {"Authorization": "Bearer g"}
        assert (await post(url, completion(), {**bulk, "x-priority-class": "interactive"}))[0] == 200
        assert (await post(url, completion(priority=-50), bulk))[0] == 200
        assert (await post(url, completion(service_tier="interactive"), bulk))[0] == 200
        assert (await post(url, completion(), {**gold, "x-priority-class": "batch"}))[0] == 200
        assert (await post(url, completion(priority=3), gold))[0] == 200
        sent = [(r["headers"]["x-tokenfleet-priority"], r["payload"].get("priority")) for r in pod.requests]
        assert sent == [("10", None), ("10", 10), ("10", None), ("10", None), ("3", 3)]
        assert await _metric(url, "tokenfleet:router_priority_lowered_total") == 3
        status, _, body = await post(url, completion(service_tier="platinum"), gold)
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == "service_tier" and "'platinum'" in error["message"]
        assert len(pod.requests) == 5  # refused before anything was sent


async def test_a_canary_split_keeps_each_session_on_one_version(serve_app, start_router, make_pod):
    v1, v2 = make_pod("llama"), make_pod("llama-next")
    async with serve_app(v1.app()) as u1, serve_app(v2.app()) as u2:
        backends = [backend("v1", u1, "llama"), backend("v2", u2, "llama-next")]
        split = [{"backend": "v1", "weight": 1}, {"backend": "v2", "weight": 1}]
        async with start_router(backends, {"modelRoutes": [{"model": "chat", "split": split}]}) as (url, _):
            served: dict[str, set[str]] = {}
            for _turn in range(2):
                for i in range(12):
                    status, _, body = await post(url, completion("chat"), {"x-session-id": f"s{i}"})
                    assert status == 200
                    served.setdefault(f"s{i}", set()).add(json.loads(body)["model"])  # names who served it
    assert all(len(models) == 1 for models in served.values())
    assert {m for models in served.values() for m in models} == {"llama", "llama-next"}
    assert {r["payload"]["model"] for r in v1.requests} == {"llama"}  # asked by the pods' own name


async def test_the_last_attempt_goes_to_the_fallback_when_the_primary_fails_before_the_first_byte(
    serve_app, start_router, make_pod
):
    big1, big2, small = make_pod("big"), make_pod("big"), make_pod("small")
    big1.fail_status = big2.fail_status = 500
    async with serve_app(big1.app()) as b1, serve_app(big2.app()) as b2, serve_app(small.app()) as s1:
        backends = [backend("big", b1, "big"), backend("big2", b2, "big"), backend("small", s1, "small")]
        routes = [{"model": "big", "backends": ["big", "big2"], "fallback": ["small"]}]
        for attempts, expected in ((3, 200), (1, 500)):
            routing = {"modelRoutes": routes, "retries": {"maxAttempts": attempts}}
            async with start_router(backends, routing) as (url, _):
                status, headers, _ = await post(url, completion("big"))
                assert status == expected
                if expected == 200:
                    assert headers["x-tokenfleet-route"] == "fallback"
                    assert len(big1.requests) + len(big2.requests) == 2  # both primary pods were tried first
    assert len(small.requests) == 1


async def test_a_primary_over_its_queue_bound_spills_to_the_fallback(serve_app, start_router, make_pod):
    big, small = make_pod("big", tokens=2), make_pod("small")
    big.gate = asyncio.Event()  # the primary's one stream holds its only slot
    async with serve_app(big.app()) as b, serve_app(small.app()) as s:
        backends = [backend("big", b, "big"), backend("small", s, "small")]
        routing = {
            "modelRoutes": [{"model": "big", "fallback": ["small"], "maxQueued": 1}],
            "maxInFlightPerEndpoint": 1,
            "queueTimeoutSeconds": 5,
        }
        async with start_router(backends, routing) as (url, router):
            first = asyncio.create_task(post(url, completion("big", stream=True)))
            await until(lambda: big.running == 1)
            waiting = asyncio.create_task(post(url, completion("big")))  # under the bound: waits for big
            await until(lambda: router.fleet.gate.num_waiting("big") == 1)
            status, headers, _ = await post(url, completion("big"))  # over it: the fallback, at once
            assert status == 200 and headers["x-tokenfleet-route"] == "fallback"
            assert not waiting.done()
            big.gate.set()
            assert (await first)[0] == 200 and (await waiting)[0] == 200
    assert [r["payload"]["model"] for r in small.requests] == ["small"]
    assert len(big.requests) == 2


async def test_an_alias_at_zero_counts_as_pending_for_the_model_its_pods_serve(
    serve_app, start_router, make_pod, closed_port_url
):
    small = make_pod("small")
    async with serve_app(small.app()) as s:
        backends = [backend("llama", closed_port_url, "llama-3"), backend("small", s, "small")]
        routes = [
            {"model": "chat", "backends": ["llama"]},
            {"model": "helpdesk", "backends": ["llama"], "fallback": ["small"]},
        ]
        routing = {"modelRoutes": routes, "queueTimeoutSeconds": 0.6}
        async with start_router(backends, routing, wait_ready=False) as (url, router):
            held = asyncio.create_task(post(url, completion("chat")))
            await until(lambda: router.fleet.gate.num_waiting() == 1)
            assert await _metric(url, "tokenfleet:router_pending_requests", 'model="llama-3"') == 1
            assert await _metric(url, "tokenfleet:router_pending_requests", 'model="chat"') == 0
            status, headers, _ = await held
            assert status == 503 and "Retry-After" in headers
            # With a fallback the request is served at once, and still counts for llama-3 while it runs.
            small.gate = asyncio.Event()
            served = asyncio.create_task(post(url, completion("helpdesk", stream=True)))
            await until(lambda: small.running == 1)
            assert await _metric(url, "tokenfleet:router_pending_requests", 'model="llama-3"') == 1
            small.gate.set()
            status, headers, _ = await served
            assert status == 200 and headers["x-tokenfleet-route"] == "fallback"
            assert await _metric(url, "tokenfleet:router_pending_requests", 'model="llama-3"') == 0


async def test_the_pods_queues_are_summed_per_model_for_the_autoscaler(serve_app, start_router, make_pod):
    # Between its scrapes of the pods, the operator reads this every second: a burst queued in the pods
    # starts new capacity at once.
    a, b, other = make_pod("llama"), make_pod("llama"), make_pod("small")
    a.waiting, b.waiting, other.waiting = 3, 4, 9
    async with serve_app(a.app()) as ua, serve_app(b.app()) as ub, serve_app(other.app()) as uo:
        backends = [
            backend("llama-a", ua, "llama"),
            backend("llama-b", ub, "llama"),
            backend("small", uo, "small"),
        ]
        async with start_router(backends) as (url, _):
            seen: dict[str, float] = {}
            for _ in range(100):  # the router's load polls arrive within a few of its poll intervals
                seen = {m: await _metric(url, "tokenfleet:router_pod_waiting_requests", f'model="{m}"')
                        for m in ("llama", "small")}  # fmt: skip
                if seen == {"llama": 7, "small": 9}:
                    break
                await asyncio.sleep(0.05)
            assert seen == {"llama": 7, "small": 9}


async def test_v1_models_lists_a_split_alias_while_any_side_of_it_can_serve(
    serve_app, start_router, make_pod, closed_port_url
):
    canary = make_pod("llama-next")
    async with serve_app(canary.app()) as u2:
        backends = [backend("v1", closed_port_url, "llama"), backend("v2", u2, "llama-next")]
        routes = [
            {"model": "chat", "split": [{"backend": "v1", "weight": 95}, {"backend": "v2", "weight": 5}]},
            {"model": "legacy", "backends": ["v1"]},
        ]
        async with start_router(backends, {"modelRoutes": routes}, wait_ready=False) as (url, router):
            await until(lambda: router.fleet.healthy_endpoints(router.fleet.targets("llama-next")))
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s, s.get(url + "/v1/models") as r:
                listed = {m["id"] for m in (await r.json())["data"]}
    # The 95 % side has no pod, the 5 % side does: the sessions that draw it are served, so the alias is
    # there; the route whose only backend is down is not.
    assert "chat" in listed and "legacy" not in listed
