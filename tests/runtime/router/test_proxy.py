"""The router as a client sees it, against real aiohttp pods on loopback: streaming, retries, errors, limits."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=10)


def completion(model="m", prompt="w1 w2 w3", **kw) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 3, **kw}


def backend(name, url, model="m"):
    return {"name": name, "model": model, "url": url}


async def post(url, body, headers=None):
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
        s.post(url + "/v1/completions", json=body, headers=headers or {}) as r,
    ):
        return r.status, dict(r.headers), await r.read()


def sse_events(raw: bytes) -> list[str]:
    return [line[len("data: ") :] for line in raw.decode().split("\n\n") if line.startswith("data: ")]


async def test_stream_is_passed_through_without_buffering(serve_app, start_router, make_pod):
    pod = make_pod(tokens=3)
    pod.gate = asyncio.Event()
    async with (
        serve_app(pod.app()) as pod_url,
        start_router([backend("a", pod_url)]) as (url, _),
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
        s.post(url + "/v1/completions", json=completion(stream=True)) as r,
    ):
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        # The pod is blocked after its first event: that event must already be at the client.
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 2.0)
        assert b"t0" in first
        pod.gate.set()
        rest = await r.read()
    assert sse_events(rest) == ['{"choices": [{"text": "t1"}]}', '{"choices": [{"text": "t2"}]}', "[DONE]"]


@pytest.mark.parametrize("failure", ["connect", "5xx"])
async def test_retries_connect_failures_and_5xx_before_the_first_byte(
    serve_app, start_router, make_pod, free_ports, failure
):
    bad_port, good_port = free_ports(2)  # ascending: round-robin tries the bad one first
    bad, good = make_pod(), make_pod()
    bad.fail_status = 503
    async with contextlib.AsyncExitStack() as stack:
        good_url = await stack.enter_async_context(serve_app(good.app(), good_port))
        bad_stack = await stack.enter_async_context(contextlib.AsyncExitStack())
        bad_url = await bad_stack.enter_async_context(serve_app(bad.app(), bad_port))
        backends = [backend("bad", bad_url), backend("good", good_url)]
        routing = {"strategy": "round-robin", "retries": {"maxAttempts": 3}}
        url, router = await stack.enter_async_context(
            start_router(backends, routing, discovery={"probeIntervalSeconds": 30})
        )
        assert all(router.fleet.available(ep) for ep in router.fleet.endpoints.by_id.values())
        if failure == "connect":
            await bad_stack.aclose()  # the pod dies after its probe said it serves
        status, headers, body = await post(url, completion())
        assert status == 200, body
        assert headers["x-tokenfleet-endpoint"] == good_url
        assert json.loads(body)["usage"]["completion_tokens"] == 3
        assert router.metrics.retries.labels(failure)._value.get() == 1
        assert len(bad.requests) == (failure == "5xx") and len(good.requests) == 1


async def test_attempts_are_bounded_and_the_last_error_is_returned(serve_app, start_router, make_pod):
    pods = [make_pod() for _ in range(3)]
    for p in pods:
        p.fail_status = 500
    async with serve_app(pods[0].app()) as u0, serve_app(pods[1].app()) as u1, serve_app(pods[2].app()) as u2:
        backends = [backend(f"p{i}", u) for i, u in enumerate((u0, u1, u2))]
        async with start_router(backends, {"retries": {"maxAttempts": 2}}) as (url, _):
            status, _, body = await post(url, completion())
    assert status == 500 and b"boom" in body
    assert sum(len(p.requests) for p in pods) == 2


async def test_a_stream_broken_after_the_first_byte_ends_with_an_error_event(
    serve_app, start_router, make_pod
):
    pod = make_pod(tokens=5)
    pod.die_after_events = 2
    async with serve_app(pod.app()) as pod_url, start_router([backend("a", pod_url)]) as (url, router):
        status, _, raw = await post(url, completion(stream=True))
    events = sse_events(raw)
    assert status == 200
    assert events[:2] == ['{"choices": [{"text": "t0"}]}', '{"choices": [{"text": "t1"}]}']
    assert json.loads(events[2])["error"]["code"] == "stream_interrupted"
    assert events[3] == "[DONE]"
    assert router.metrics.stream_errors._value.get() == 1
    assert len(pod.requests) == 1  # never retried after the first byte


async def test_a_silent_stream_times_out_instead_of_hanging(serve_app, start_router, make_pod):
    pod = make_pod(tokens=5)
    pod.hang_after_events = 1
    routing = {"retries": {"idleTimeoutSeconds": 0.3}}
    async with serve_app(pod.app()) as pod_url, start_router([backend("a", pod_url)], routing) as (url, _):
        status, _, raw = await asyncio.wait_for(post(url, completion(stream=True)), 5.0)
    events = sse_events(raw)
    assert status == 200 and len(events) == 3
    assert json.loads(events[1])["error"]["type"] == "upstream_error"


async def test_rate_limit_gives_429_with_retry_after(serve_app, start_router, make_pod):
    pod = make_pod()
    routing = {"rateLimits": {"requestsPerMinute": 2}}
    async with (
        serve_app(pod.app()) as pod_url,
        start_router([backend("a", pod_url)], routing) as (url, router),
    ):
        assert (await post(url, completion()))[0] == 200
        assert (await post(url, completion()))[0] == 200
        status, headers, body = await post(url, completion())
        assert status == 429 and headers["Retry-After"] == "30"
        assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
        # Another key has its own bucket.
        assert (await post(url, completion(), {"Authorization": "Bearer other"}))[0] == 200
        assert router.metrics.rate_limited.labels("requests")._value.get() == 1


async def test_tokens_per_minute_counts_the_streamed_completion(serve_app, start_router, make_pod):
    pod = make_pod(tokens=20)
    routing = {"rateLimits": {"tokensPerMinute": 30}}
    async with serve_app(pod.app()) as pod_url, start_router([backend("a", pod_url)], routing) as (url, _):
        assert (await post(url, completion(prompt="w1 w2", stream=True)))[0] == 200  # 2 + 20 tokens
        assert (await post(url, completion(prompt="w1 w2", stream=True)))[0] == 200  # 44 > 30: now in debt
        status, headers, _ = await post(url, completion(prompt="w1"))
        assert status == 429 and int(headers["Retry-After"]) >= 20


async def test_api_keys(serve_app, start_router, make_pod):
    pod = make_pod()
    async with (
        serve_app(pod.app()) as pod_url,
        start_router([backend("a", pod_url)], api_keys=["k1"]) as (url, _),
    ):
        assert (await post(url, completion()))[0] == 401
        assert (await post(url, completion(), {"Authorization": "Bearer nope"}))[0] == 401
        assert (await post(url, completion(), {"Authorization": "Bearer k1"}))[0] == 200
    assert pod.requests[0]["headers"]["Authorization"] == "Bearer k1"


async def test_model_routing_with_fallback(serve_app, start_router, make_pod, closed_port_url, wait_until):
    small = make_pod("small")
    async with serve_app(small.app()) as small_url:
        backends = [backend("big", closed_port_url, "big"), backend("small", small_url, "small")]
        routing = {"modelRoutes": [{"model": "big", "fallback": ["small"]}], "retries": {"maxAttempts": 1}}
        discovery = {"failureThreshold": 1}
        async with start_router(backends, routing, discovery) as (url, router):
            await wait_until(
                lambda: (
                    not any(router.fleet.available(e) for e in router.fleet.endpoints.of_backends(["big"]))
                )
            )
            status, headers, _ = await post(url, completion("big"))
            assert status == 200 and headers["x-tokenfleet-route"] == "fallback"
            assert small.requests[-1]["payload"]["model"] == "small"  # renamed for the pod
            status, _, body = await post(url, completion("nope"))
            assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
            async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
                ids = [m["id"] for m in (await r.json())["data"]]
            assert ids == ["big", "small"]  # the route name (served through its fallback) and the pod's model


async def test_active_health_ejects_and_readmits(serve_app, start_router, make_pod, wait_until):
    a, b = make_pod(), make_pod()
    async with serve_app(a.app()) as ua, serve_app(b.app()) as ub:
        discovery = {"failureThreshold": 2, "ejectionSeconds": 0.2}
        async with start_router([backend("a", ua), backend("b", ub)], discovery=discovery) as (url, router):
            ep_a = router.fleet.endpoints.by_id[ua]
            a.healthy = False
            await wait_until(lambda: not router.fleet.available(ep_a))
            assert router.metrics.ejections.labels(ua)._value.get() == 1
            for _ in range(4):
                assert (await post(url, completion()))[1]["x-tokenfleet-endpoint"] == ub
            a.healthy = True
            await wait_until(lambda: router.fleet.available(ep_a))
            async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
                text = await r.text()
            assert f'tokenfleet:router_endpoint_healthy{{endpoint="{ua}"}} 1.0' in text


async def test_no_ready_endpoint_holds_the_request_then_503_with_retry_after(
    serve_app, start_router, closed_port_url
):
    routing = {"queueTimeoutSeconds": 0.5}
    async with start_router([backend("a", closed_port_url)], routing, wait_ready=False) as (url, router):
        task = asyncio.create_task(post(url, completion()))
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            assert 'tokenfleet:router_pending_requests{model="m"} 1.0' in await r.text()
        assert not task.done()  # held, not refused
        status, headers, body = await asyncio.wait_for(task, 3.0)
        assert status == 503 and headers["Retry-After"] == "1"
        assert json.loads(body)["error"]["code"] == "no_healthy_endpoint"
        assert router.fleet.gate.num_waiting() == 0
        async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
            assert r.status == 503


async def test_lower_priority_numbers_wait_less(serve_app, start_router, make_pod, wait_until):
    pod = make_pod()
    pod.delay = 0.3
    routing = {
        "maxInFlightPerEndpoint": 1,
        # Lower is sooner, in the router's queue as on the pod.
        "priorityClasses": [{"name": "batch", "priority": 5}, {"name": "interactive", "priority": -5}],
    }
    async with (
        serve_app(pod.app()) as pod_url,
        start_router([backend("a", pod_url)], routing) as (url, _),
    ):
        first = asyncio.create_task(post(url, completion(prompt="w0")))
        await wait_until(lambda: len(pod.requests) == 1)
        low = asyncio.create_task(post(url, completion(prompt="w1"), {"x-priority-class": "batch"}))
        await asyncio.sleep(0.05)
        high = asyncio.create_task(post(url, completion(prompt="w2"), {"x-priority-class": "interactive"}))
        results = await asyncio.gather(first, low, high)
        assert [r[0] for r in results] == [200, 200, 200]
        assert [r["payload"]["prompt"] for r in pod.requests] == ["w0", "w2", "w1"]
        # The pod gets the same number, with the same meaning.
        assert pod.requests[1]["headers"]["x-tokenfleet-priority"] == "-5"
        assert pod.requests[2]["headers"]["x-tokenfleet-priority"] == "5"
        status, _, _ = await post(url, completion(), {"x-priority-class": "vip"})
        assert status == 400
        # The router's part of each one's TTFT: w0 went at once, w2 waited for w0 (~0.25 s), w1 for w0 and
        # w2 (~0.55 s); the refused one was never admitted.
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            waits = {
                sample.name + sample.labels.get("le", ""): sample.value
                for family in text_string_to_metric_families(await r.text())
                if family.name == "tokenfleet:router_queue_wait_seconds"
                for sample in family.samples
                if sample.labels.get("model") == "m"
            }
        assert waits["tokenfleet:router_queue_wait_seconds_count"] == 3
        assert waits["tokenfleet:router_queue_wait_seconds_bucket0.05"] == 1
        assert waits["tokenfleet:router_queue_wait_seconds_bucket0.1"] == 1
        assert 0.7 < waits["tokenfleet:router_queue_wait_seconds_sum"] < 2.0


async def test_a_full_queue_times_out_with_429(serve_app, start_router, make_pod, wait_until):
    pod = make_pod()
    pod.delay = 1.0
    routing = {"maxInFlightPerEndpoint": 1, "queueTimeoutSeconds": 0.2}
    async with serve_app(pod.app()) as pod_url, start_router([backend("a", pod_url)], routing) as (url, _):
        first = asyncio.create_task(post(url, completion()))
        await wait_until(lambda: len(pod.requests) == 1)
        status, headers, body = await post(url, completion())
        assert (
            status == 429 and json.loads(body)["error"]["code"] == "overloaded" and "Retry-After" in headers
        )
        assert (await first)[0] == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_bad_bodies_are_400_at_the_router(serve_app, start_router, make_pod, path):
    pod = make_pod()
    async with (
        serve_app(pod.app()) as pod_url,
        start_router([backend("a", pod_url)]) as (url, _),
        aiohttp.ClientSession() as s,
        s.post(url + path, data=b"[1, 2") as r,
    ):
        assert r.status == 400
    assert pod.requests == []


async def test_requests_sent_while_pods_load_are_all_served_once_they_are_ready(
    serve_app, start_router, make_pod, free_ports, wait_until
):
    """Router and pods start together: the pods say "loading" (503) for a while, one is not even listening
    yet. Nothing is refused and nothing is ejected; everything is served once the pods are up."""
    early_port, late_port = free_ports(2)
    early, late = make_pod(), make_pod()
    early.loading = True
    routing = {"queueTimeoutSeconds": 20}
    backends = [
        backend("early", f"http://127.0.0.1:{early_port}"),
        backend("late", f"http://127.0.0.1:{late_port}"),
    ]
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(serve_app(early.app(), early_port))
        url, router = await stack.enter_async_context(start_router(backends, routing, wait_ready=False))
        burst = [asyncio.create_task(post(url, completion(prompt=f"w{i}"))) for i in range(8)]
        await asyncio.sleep(0.5)  # probes see "loading" and a closed port many times over
        assert not any(t.done() for t in burst)
        assert router.fleet.gate.num_waiting("m") == 8
        early.loading = False
        await stack.enter_async_context(serve_app(late.app(), late_port))  # the slow one comes up too
        results = await asyncio.wait_for(asyncio.gather(*burst), 10)
        assert [status for status, _, _ in results] == [200] * 8
        for ep in router.fleet.endpoints.by_id.values():
            assert router.metrics.ejections.labels(ep.id)._value.get() == 0
        await wait_until(
            lambda: all(router.fleet.available(ep) for ep in router.fleet.endpoints.by_id.values())
        )


async def test_each_pick_is_timed_in_the_pick_latency_histogram(serve_app, start_router, make_pod):
    async with serve_app(make_pod().app()) as pod_url, start_router([backend("a", pod_url)]) as (url, _):
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            assert "tokenfleet:router_pick_seconds_count 0.0" in await r.text()
        assert (await post(url, completion()))[0] == 200
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            text = await r.text()
    assert "tokenfleet:router_pick_seconds_count 1.0" in text
    assert 'tokenfleet:router_pick_seconds_bucket{le="+Inf"} 1.0' in text
    assert 'tokenfleet:router_pick_seconds_bucket{le="1e-05"}' in text  # microsecond buckets
    (total,) = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("tokenfleet:router_pick_seconds_sum")
    ]
    assert 0.0 < total < 1.0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_hangs_up_before_the_first_byte_frees_its_slot_and_its_pod_request(
    serve_app, start_router, make_pod, stream
):
    pod = make_pod()
    pod.delay = 5.0  # the pod is slow to answer
    async with (
        serve_app(pod.app(), handler_cancellation=True) as pod_url,
        start_router([backend("a", pod_url)]) as (url, router),
    ):
        async with aiohttp.ClientSession() as s:
            with contextlib.suppress(TimeoutError):
                await s.post(
                    url + "/v1/completions",
                    json=completion(stream=stream),
                    timeout=aiohttp.ClientTimeout(total=0.5),
                )
        ep = router.fleet.endpoints.by_id[pod_url]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.0  # well before the pod would have answered
        while (ep.in_flight or pod.running) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert ep.in_flight == 0 and pod.running == 0  # the router let go, and so did the pod
