"""LoRA adapters through the router: a request naming an adapter goes to a backend serving it, and its
prefix matches are exact — hashed with the key each pod reports for the adapter on /load, as the pod hashes
them — and apart from the base model's blocks of the same prompt."""

from __future__ import annotations

import time

import aiohttp

from .test_prefix_routing import CLIENT_TIMEOUT, chat, send


def adapter_chat(model: str) -> dict:
    return {**chat(1, "w1999"), "model": model}


async def test_adapter_requests_follow_the_pod_holding_the_adapters_blocks(
    serve_app, start_router, make_pod, wait_until
):
    pods = [make_pod() for _ in range(2)]
    for pod in pods:
        pod.adapters = {"sql": "sql@digest-1"}
    async with serve_app(pods[0].app()) as u0, serve_app(pods[1].app()) as u1:
        backends = [
            {"name": f"p{i}", "model": "m", "url": u, "adapters": ["sql"]} for i, u in enumerate((u0, u1))
        ]
        # Affinity unbounded: this is about which blocks match, not about spreading load.
        routing = {"strategy": "prefix-affinity", "balance": {"maxRatio": None}}
        async with start_router(backends, routing) as (url, router):
            eps = router.fleet.endpoints.by_id.values()
            await wait_until(
                lambda: all(router.fleet.kv_events_live().values()) and all(ep.lora_adapters for ep in eps)
            )
            # The adapter's prompt is computed on pod 1 behind the router's back: only its events tell.
            async with (
                aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
                s.post(u1 + "/v1/chat/completions", json=adapter_chat("sql")) as r,
            ):
                assert r.status == 200
            await wait_until(lambda: router.fleet.exact.num_blocks(u1) == len(pods[1].cached) > 0)
            for _ in range(3):
                assert await send(url, adapter_chat("sql")) == (200, u1, "prefix_hit")
            assert pods[1].hit_blocks > 0 and pods[0].hit_blocks == 0  # the pod's own count: reused
            # The same prompt for the base model matches nothing: its blocks would be other KV.
            status, _, reason = await send(url, adapter_chat("m"))
            assert status == 200 and reason != "prefix_hit"
            # An adapter no backend lists is unknown to the router.
            async with (
                aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
                s.post(url + "/v1/chat/completions", json=adapter_chat("nope")) as r,
            ):
                assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_an_edited_adapter_list_applies_live_and_keeps_the_endpoints(
    serve_app, start_router, make_pod, wait_until
):
    """The operator rewrites the router's config when spec.adapters changes: the backend's endpoints, their
    health and KV-event streams stay (no re-discovery), and the new name routes at once."""
    pod = make_pod()
    pod.adapters = {"sql": "sql@1"}
    async with serve_app(pod.app()) as u0:
        backend = {"name": "p0", "model": "m", "url": u0, "adapters": ["sql"]}
        async with start_router([backend], {"strategy": "prefix-affinity"}) as (url, router):
            await wait_until(lambda: all(router.fleet.kv_events_live().values()))
            endpoint = router.fleet.endpoints.by_id[u0]
            old = router.config
            new = old.model_copy(
                update={"backends": (old.backends[0].model_copy(update={"adapters": ("chat",)}),)}
            )
            pod.adapters = {"chat": "chat@1"}
            router.apply_config(old, new)
            assert router.fleet.endpoints.by_id[u0] is endpoint and router.fleet.kv_events_live()[u0]
            assert (await send(url, adapter_chat("chat")))[0] == 200
            async with (
                aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
                s.post(url + "/v1/chat/completions", json=adapter_chat("sql")) as r,
            ):
                assert r.status == 404


async def test_an_adapters_requests_stay_on_its_holders_until_they_are_busy_then_spill(
    serve_app, start_router, make_pod, wait_until
):
    """Placement: with one pod holding the adapter, its requests go there (the other pod would have to load
    it), whatever their prompts; when the holder is clearly busier (the balance queue rule), one goes to
    the other pod, which loads it and from then on holds it too."""
    pods = [make_pod() for _ in range(2)]
    for pod in pods:
        pod.loadable = {"sql"}
    pods[0].adapters = {"sql": "sql@1"}
    async with serve_app(pods[0].app()) as u0, serve_app(pods[1].app()) as u1:
        backends = [
            {"name": f"p{i}", "model": "m", "url": u, "adapters": ["sql"]} for i, u in enumerate((u0, u1))
        ]
        routing = {"strategy": "prefix-affinity", "balance": {"absolute": 2, "relative": 1.5}}
        async with start_router(backends, routing) as (url, router):
            eps = router.fleet.endpoints.by_id
            await wait_until(lambda: eps[u0].lora_adapters == {"sql": "sql@1"})
            for k in range(3):  # distinct prompts: no prefix to follow, only the adapter
                body = {**chat(k, f"w{k}"), "model": "sql"}
                assert (await send(url, body))[:2] == (200, u0)
            assert "sql" not in pods[1].adapters
            pods[0].running = 6  # its /load now reports a queue the other pod does not have
            await wait_until(lambda: eps[u0].reported_load >= 6)
            assert (await send(url, {**chat(0, "w9"), "model": "sql"}))[:2] == (200, u1)
            assert "sql" in pods[1].adapters  # the spill loaded it there
            await wait_until(lambda: "sql" in eps[u1].lora_adapters)


async def test_a_pod_with_no_adapter_room_is_passed_over_for_that_adapter_and_stays_in_rotation(
    serve_app, start_router, make_pod, wait_until
):
    """A pod whose adapter places are all in use answers a request for another adapter with 503
    `lora_slots_busy`. That is a placement miss, not ill health: the router retries the request on a pod
    with room, records no room on the first one until its next report, and keeps sending it the requests
    it can take — it is not taken out of rotation as a loading or draining pod's 503 would take it."""
    pods = [make_pod() for _ in range(2)]
    for pod in pods:
        pod.loadable = {"sql", "chat"}
    pods[0].adapters = {"chat": "chat@1"}
    pods[0].max_adapters = 1  # holds "chat" and has no place for "sql"
    pods[0].report_room = False  # an older pod: the router learns its room from the refusal
    pods[1].running = 3  # busier: a choice by load alone goes to pod 0 first
    async with serve_app(pods[0].app()) as u0, serve_app(pods[1].app()) as u1:
        backends = [
            {"name": f"p{i}", "model": "m", "url": u, "adapters": ["sql", "chat"]}
            for i, u in enumerate((u0, u1))
        ]
        async with start_router(backends, {"strategy": "least-load"}) as (url, router):
            eps = router.fleet.endpoints.by_id
            await wait_until(lambda: eps[u0].lora_adapters and eps[u1].reported_load >= 3)
            assert eps[u0].lora_room is None
            assert (await send(url, {**chat(0, "w1"), "model": "sql"}))[:2] == (200, u1)
            assert [r["payload"]["model"] for r in pods[0].requests] == ["sql"]  # refused there first
            assert "sql" in pods[1].adapters and "sql" not in pods[0].adapters
            assert router.fleet.available(eps[u0])  # still in rotation
            assert router.fleet.metrics.retries.labels("lora_busy")._value.get() == 1
            # The adapter it holds, and the base model, still go to it at once (the less loaded pod).
            assert (await send(url, {**chat(1, "w2"), "model": "chat"}))[:2] == (200, u0)
            assert (await send(url, chat(2, "w3")))[:2] == (200, u0)


async def test_an_adapter_no_pod_has_room_for_is_refused_at_once_and_a_place_is_made_for_the_next(
    serve_app, start_router, make_pod, wait_until
):
    """Every pod's adapter places are in use: the client gets the pods' 503 `lora_slots_busy` with
    Retry-After at once (both pods tried), and the router makes a place: the copy of the adapter both pods
    hold on the less loaded pod gets no new requests; once that pod has evicted it (its report shows room),
    the refused adapter's next request is served there."""
    pods = [make_pod() for _ in range(2)]
    for i, pod in enumerate(pods):
        pod.loadable = {"hot", "a0", "a1", "new"}
        pod.adapters = {"hot": "hot@1", f"a{i}": f"a{i}@1"}
        pod.max_adapters = 2
    pods[1].running = 2  # pod 0 is the less loaded
    async with serve_app(pods[0].app()) as u0, serve_app(pods[1].app()) as u1:
        backends = [
            {"name": f"p{i}", "model": "m", "url": u, "adapters": ["hot", "a0", "a1", "new"]}
            for i, u in enumerate((u0, u1))
        ]
        async with start_router(backends, {"strategy": "least-load"}) as (url, router):
            eps = router.fleet.endpoints.by_id
            await wait_until(lambda: eps[u0].lora_room == 0 and eps[u1].reported_load == 2)
            started = time.monotonic()
            async with (
                aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
                s.post(url + "/v1/chat/completions", json={**chat(0, "w1"), "model": "new"}) as r,
            ):
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["code"] == "lora_slots_busy"
            assert time.monotonic() - started < 2.0  # refused at once, not held
            assert [q["payload"]["model"] for p in pods for q in p.requests] == ["new", "new"]
            assert router.fleet.metrics.adapter_drains._value.get() == 1
            assert router.fleet.adapter_drains.by_pod[u0].victim == "hot"
            # "hot" now goes to pod 1 although pod 0 is less loaded: its copy there is let go idle.
            assert (await send(url, {**chat(1, "w2"), "model": "hot"}))[:2] == (200, u1)
            assert (await send(url, {**chat(2, "w3"), "model": "a0"}))[:2] == (200, u0)  # the rest still go
            del pods[0].adapters["hot"]  # idle, then evicted: pod 0 reports a free place
            await wait_until(lambda: eps[u0].lora_room == 1)
            assert (await send(url, {**chat(0, "w4"), "model": "new"}))[:2] == (200, u0)
            assert "new" in pods[0].adapters


async def test_an_adapter_a_pod_cannot_download_is_retried_elsewhere_and_the_pod_stays_in_rotation(
    serve_app, start_router, make_pod, wait_until
):
    """A pod that cannot download an hf:// adapter now answers 503 `lora_source_unavailable`: the request's
    trouble, not the pod's — the router tries another pod (which may hold the adapter or reach the Hub), keeps
    the first one in rotation, and when no pod can, the client gets the 503 with its code and Retry-After."""
    pods = [make_pod() for _ in range(2)]
    for pod in pods:
        pod.loadable = {"hub-a", "hub-b"}
        pod.source_down = {"hub-b"}
    pods[0].source_down.add("hub-a")
    pods[1].running = 3  # busier: pod 0 is tried first
    async with serve_app(pods[0].app()) as u0, serve_app(pods[1].app()) as u1:
        backends = [
            {"name": f"p{i}", "model": "m", "url": u, "adapters": ["hub-a", "hub-b"]}
            for i, u in enumerate((u0, u1))
        ]
        async with start_router(backends, {"strategy": "least-load"}) as (url, router):
            eps = router.fleet.endpoints.by_id
            await wait_until(lambda: eps[u1].reported_load >= 3)
            assert (await send(url, {**chat(0, "w1"), "model": "hub-a"}))[:2] == (200, u1)
            assert [r["payload"]["model"] for r in pods[0].requests] == ["hub-a"]  # refused there first
            assert router.fleet.available(eps[u0]) and router.fleet.available(eps[u1])
            assert router.fleet.metrics.retries.labels("lora_source")._value.get() == 1
            assert (await send(url, chat(1, "w2")))[:2] == (200, u0)  # still the first pick for the rest
            async with (
                aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
                s.post(url + "/v1/chat/completions", json={**chat(2, "w3"), "model": "hub-b"}) as r,
            ):
                assert r.status == 503 and r.headers["Retry-After"]
                assert (await r.json())["error"]["code"] == "lora_source_unavailable"
            assert router.fleet.available(eps[u0]) and router.fleet.available(eps[u1])
            assert (await send(url, chat(2, "w4")))[:2] == (200, u0)


async def test_an_adapter_at_its_max_copies_never_spills_and_a_retry_stays_on_its_holders(
    serve_app, start_router, make_pod, wait_until
):
    """maxCopies 1: however busy the one pod holding the adapter is, its requests stay there (no spill
    loads a second copy); when that pod fails one, the retry does not load it elsewhere either."""
    pods = [make_pod() for _ in range(2)]
    for pod in pods:
        pod.loadable = {"sql"}
    pods[0].adapters = {"sql": "sql@1"}
    pods[0].running = 9  # clearly busier: without the bound its requests would spill to pod 1
    async with serve_app(pods[0].app()) as u0, serve_app(pods[1].app()) as u1:
        backends = [
            {
                "name": f"p{i}",
                "model": "m",
                "url": u,
                "adapters": ["sql"],
                "adapterCopies": {"sql": {"maxCopies": 1}},
            }
            for i, u in enumerate((u0, u1))
        ]
        routing = {"strategy": "prefix-affinity", "balance": {"absolute": 2, "relative": 1.5}}
        async with start_router(backends, routing) as (url, router):
            eps = router.fleet.endpoints.by_id
            await wait_until(lambda: eps[u0].lora_adapters == {"sql": "sql@1"} and eps[u0].reported_load >= 9)
            for k in range(3):
                assert (await send(url, {**chat(k, f"w{k}"), "model": "sql"}))[:2] == (200, u0)
            assert "sql" not in pods[1].adapters
            assert (await send(url, chat(0, "w5")))[:2] == (200, u1)  # other requests balance as ever
            pods[0].fail_status = 500
            async with (
                aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
                s.post(url + "/v1/chat/completions", json={**chat(1, "w6"), "model": "sql"}) as r,
            ):
                assert r.status in (500, 503), await r.text()
            assert "sql" not in pods[1].adapters


async def test_an_adapter_goes_where_it_steps_at_once_not_to_a_holder_whose_slots_are_taken(
    serve_app, start_router, make_pod, wait_until
):
    """The pod holding the adapter steps two adapters at once and both slots are taken by others: the
    request would wait there for a slot. It goes to a pod with a free slot (which loads it), and the router
    counts the adapter active there at once, so a second new adapter is not sent into the last slot too."""
    pods = [make_pod() for _ in range(2)]
    for pod in pods:
        pod.loadable = {"sql", "chat", "new"}
        pod.max_adapters = 8
        pod.lora_slots = 2
    pods[0].adapters = {"sql": "sql@1", "a": "a@1", "b": "b@1"}
    pods[0].lora_active = ("a", "b")
    pods[1].adapters = {"c": "c@1"}
    pods[1].lora_active = ("c",)
    async with serve_app(pods[0].app()) as u0, serve_app(pods[1].app()) as u1:
        backends = [
            {"name": f"p{i}", "model": "m", "url": u, "adapters": ["sql", "chat", "new"]}
            for i, u in enumerate((u0, u1))
        ]
        # Probes far apart: the second request must go by what the router marked, not a fresh report.
        discovery = {"probeIntervalSeconds": 30}
        async with start_router(backends, {"strategy": "least-load"}, discovery=discovery) as (url, router):
            eps = router.fleet.endpoints.by_id
            await wait_until(lambda: eps[u0].lora_slots == 2 and eps[u1].lora_slots == 2)
            assert (await send(url, {**chat(0, "w1"), "model": "sql"}))[:2] == (200, u1)
            assert eps[u1].lora_active == {"c", "sql"}  # marked when sent: both its slots are taken now
            assert (await send(url, {**chat(1, "w2"), "model": "sql"}))[:2] == (200, u1)  # joins it there
            # "new": no pod has a free slot; the holder-less fallback is any pod (the request waits there).
            assert (await send(url, {**chat(2, "w3"), "model": "new"}))[0] == 200
