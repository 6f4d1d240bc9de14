"""The router wakes a sleeping pod on demand: pods in sleep mode are known (discovery keeps not-ready
endpoints), probed as asleep, and woken with `POST /wake_up` when requests are held with no awake pod.

The pods are fake ones that answer as a sleeping `tokenfleet serve` does: `/ready` 503 `{"status":
"sleeping", "level": N}`, requests 503 `sleeping`, `/load` and `/health` 200, `/wake_up` with the internal
key only when the deployment has one.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
from aiohttp import web
from tokenfleet.runtime.router.endpoints import EndpointSliceWatch

from .conftest import FakePod

KEY = "internal-key"


class SleepyPod(FakePod):
    def __init__(self, *args, level: int = 1, internal_key: str | None = None, **kw):
        super().__init__(*args, **kw)
        self.sleep_level = level  # 0: awake
        self.internal_key = internal_key
        self.wakes: list[dict] = []  # each /wake_up: when, and its Authorization header
        self.fail_wakes = 0  # the next N wakes answer 500 and leave the pod asleep
        self.wake_seconds = 0.0  # how long a wake takes
        self._lock = asyncio.Lock()

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        app.router.add_post("/wake_up", self.wake_up)
        return app

    def _refused(self, request: web.Request) -> bool:
        return (
            self.internal_key is not None
            and request.headers.get("Authorization") != f"Bearer {self.internal_key}"
        )

    async def ready(self, request: web.Request) -> web.Response:
        if self.sleep_level:
            return web.json_response({"status": "sleeping", "level": self.sleep_level}, status=503)
        return web.json_response({"status": "ready", "model": self.model})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": bool(self.sleep_level)})

    async def wake_up(self, request: web.Request) -> web.Response:
        self.wakes.append(
            {"at": asyncio.get_running_loop().time(), "auth": request.headers.get("Authorization")}
        )
        if self._refused(request):
            return web.json_response({"error": {"message": "internal key required"}}, status=401)
        async with self._lock:
            await asyncio.sleep(self.wake_seconds)
            if self.fail_wakes:
                self.fail_wakes -= 1
                return web.json_response({"error": {"message": "cuda out of memory"}}, status=500)
            self.sleep_level = 0
        return web.json_response({"is_sleeping": False, "wake_seconds": self.wake_seconds})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.sleep_level:
            return web.json_response(
                {"error": {"message": "asleep", "code": "sleeping"}}, status=503, headers={"Retry-After": "1"}
            )
        return await super().generate(request)


def body(i: int = 0) -> dict:
    return {"model": "m", "prompt": f"w{i} w{i + 1}", "max_tokens": 3}


async def post(session: aiohttp.ClientSession, url: str, payload: dict) -> tuple[int, dict, dict]:
    async with session.post(url + "/v1/completions", json=payload) as r:
        return r.status, dict(r.headers), await r.json()


async def endpoints_of(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/v1/config") as r:
        return (await r.json())["endpoints"]


async def metric(session: aiohttp.ClientSession, url: str, name: str, **labels) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^tokenfleet:router_" + name + r"\{(.*)\} (\S+)$", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    return 0.0


async def test_a_request_held_for_the_only_pod_asleep_is_served_once_the_router_wakes_it(
    serve_app, start_router, tokenizer, kubelet_mount, wait_until
):
    mount = kubelet_mount({"key": KEY + "\n"})
    pod = SleepyPod("m", tokenizer, internal_key=KEY)
    pod.wake_seconds = 0.3  # the burst arrives while the wake runs: it must not wake the pod again
    async with serve_app(pod.app()) as pod_url:
        backends = [{"name": "p0", "model": "m", "url": pod_url, "internalKeyFile": str(mount.path("key"))}]
        async with (
            start_router(backends, {"queueTimeoutSeconds": 10}, wait_ready=False) as (url, router),
            aiohttp.ClientSession() as s,
        ):
            ep = router.fleet.endpoints.by_id[pod_url]
            await wait_until(lambda: ep.health.asleep)
            state = (await endpoints_of(s, url))[pod_url]
            assert state["asleep"] and not state["available"] and state["sleep_level"] == 1
            assert await metric(s, url, "endpoints_asleep", backend="p0") == 1
            assert pod.wakes == []  # asleep, but nobody asked for it

            started = asyncio.get_running_loop().time()
            results = await asyncio.gather(*(post(s, url, body(i)) for i in range(4)))
            elapsed = asyncio.get_running_loop().time() - started
            assert [status for status, _, _ in results] == [200] * 4
            assert elapsed < 3.0  # the held requests went as soon as the pod woke, not at their deadline
            assert len(pod.wakes) == 1 and pod.wakes[0]["auth"] == f"Bearer {KEY}"
            assert len(pod.requests) == 4  # no request reached it asleep (no 503 to retry around)
            state = (await endpoints_of(s, url))[pod_url]
            assert state["available"] and not state["asleep"] and not state["waking"]
            assert await metric(s, url, "wakes_total", backend="p0", outcome="ok") == 1
            assert await metric(s, url, "endpoints_asleep", backend="p0") == 0


async def test_a_failing_wake_is_retried_after_back_off_and_the_request_gets_a_clear_503(
    serve_app, start_router, tokenizer, wait_until, caplog
):
    pod = SleepyPod("m", tokenizer)
    pod.fail_wakes = 1000
    async with serve_app(pod.app()) as pod_url:
        backends = [{"name": "p0", "model": "m", "url": pod_url}]
        async with (
            start_router(backends, {"queueTimeoutSeconds": 1.5}, wait_ready=False) as (url, router),
            aiohttp.ClientSession() as s,
        ):
            router.fleet.waker.backoff = 0.4
            ep = router.fleet.endpoints.by_id[pod_url]
            await wait_until(lambda: ep.health.asleep)
            started = asyncio.get_running_loop().time()
            status, headers, payload = await post(s, url, body())
            elapsed = asyncio.get_running_loop().time() - started
            assert status == 503 and payload["error"]["code"] == "no_healthy_endpoint"
            assert int(headers["Retry-After"]) >= 1
            assert 1.4 < elapsed < 3.0  # its queue deadline, not a hang
            # Tried again after each back-off, never faster: 1.5 s / 0.4 s -> at most 4 tries.
            assert 2 <= len(pod.wakes) <= 4
            gaps = [b["at"] - a["at"] for a, b in zip(pod.wakes, pod.wakes[1:], strict=False)]
            assert all(g >= 0.39 for g in gaps), gaps
            assert "waking" in caplog.text and "answered 500" in caplog.text
            state = (await endpoints_of(s, url))[pod_url]
            assert state["asleep"] and "answered 500" in state["last_wake_error"]
            assert await metric(s, url, "wakes_total", backend="p0", outcome="refused") == len(pod.wakes)

            # The pod recovers: the next held request wakes it (once its back-off is over) and is served.
            pod.fail_wakes = 0
            tries = len(pod.wakes)
            status, _, _ = await post(s, url, body(1))
            assert status == 200 and len(pod.wakes) == tries + 1
            assert "last_wake_error" not in (await endpoints_of(s, url))[pod_url]


async def test_a_wake_that_does_not_answer_in_time_counts_as_a_timeout(
    serve_app, start_router, tokenizer, wait_until
):
    pod = SleepyPod("m", tokenizer)
    pod.wake_seconds = 5.0
    async with serve_app(pod.app()) as pod_url:
        backends = [{"name": "p0", "model": "m", "url": pod_url}]
        async with (
            start_router(backends, {"queueTimeoutSeconds": 0.8}, wait_ready=False) as (url, router),
            aiohttp.ClientSession() as s,
        ):
            router.fleet.waker.timeout = 0.3
            router.fleet.waker.backoff = 10.0
            ep = router.fleet.endpoints.by_id[pod_url]
            await wait_until(lambda: ep.health.asleep)
            status, _, _ = await post(s, url, body())
            assert status == 503 and len(pod.wakes) == 1
            assert await metric(s, url, "wakes_total", backend="p0", outcome="timeout") == 1
            assert "no answer within 0.3 s" in (await endpoints_of(s, url))[pod_url]["last_wake_error"]


async def test_no_wake_while_an_awake_pod_can_serve_even_at_its_limit(
    serve_app, start_router, tokenizer, wait_until
):
    awake = SleepyPod("m", tokenizer, level=0)
    awake.delay = 0.3
    asleep = SleepyPod("m", tokenizer)
    async with serve_app(awake.app()) as awake_url, serve_app(asleep.app()) as asleep_url:
        backends = [{"name": "p0", "model": "m", "url": awake_url}]
        routing = {"queueTimeoutSeconds": 10, "maxInFlightPerEndpoint": 1}
        async with (
            start_router(backends, routing, wait_ready=False) as (url, router),
            aiohttp.ClientSession() as s,
        ):
            router.fleet.sync_backend(router.config.backends[0], [awake_url, asleep_url])  # one Service
            eps = router.fleet.endpoints.by_id
            await wait_until(lambda: eps[asleep_url].health.asleep and router.fleet.available(eps[awake_url]))
            results = await asyncio.gather(*(post(s, url, body(i)) for i in range(3)))
            assert [status for status, _, _ in results] == [200] * 3
            assert len(awake.requests) == 3 and asleep.wakes == [] and asleep.requests == []


async def test_one_pod_is_woken_per_burst(serve_app, start_router, tokenizer, wait_until):
    pods = [SleepyPod("m", tokenizer, level=level) for level in (2, 1)]
    for pod in pods:
        pod.wake_seconds = 0.3
    async with serve_app(pods[0].app()) as url0, serve_app(pods[1].app()) as url1:
        backends = [{"name": "p0", "model": "m", "url": url0}]
        async with (
            start_router(backends, {"queueTimeoutSeconds": 10}, wait_ready=False) as (url, router),
            aiohttp.ClientSession() as s,
        ):
            router.fleet.sync_backend(router.config.backends[0], [url0, url1])
            eps = router.fleet.endpoints.by_id
            await wait_until(lambda: eps[url0].health.asleep and eps[url1].health.asleep)
            results = await asyncio.gather(*(post(s, url, body(i)) for i in range(6)))
            assert [status for status, _, _ in results] == [200] * 6
            # The lighter sleep (level 1: weights in host memory) was woken, and only it.
            assert (len(pods[0].wakes), len(pods[1].wakes)) == (0, 1)
            assert len(pods[1].requests) == 6


async def test_discovery_hands_the_router_a_sleeping_pod_that_it_then_wakes(
    serve_app, start_router, tokenizer, wait_until, monkeypatch
):
    """Kubernetes marks a sleeping pod not ready (its /ready is 503). The router's discovery must keep it,
    or a request waits out its deadline with a pod that could serve it a second away."""
    monkeypatch.setattr(EndpointSliceWatch, "start", lambda self: None)  # no API server: slices by hand
    pod = SleepyPod("m", tokenizer)
    async with serve_app(pod.app()) as pod_url:
        port = int(pod_url.rsplit(":", 1)[1])
        backends = [{"name": "p0", "model": "m", "url": f"http://m.ns.svc:{port}"}]
        async with (
            start_router(
                backends, {"queueTimeoutSeconds": 5}, discovery={"mode": "kubernetes"}, wait_ready=False
            ) as (url, router),
            aiohttp.ClientSession() as s,
        ):
            watch = router._watches["p0"]
            watch._slices = {
                "m-abc": {
                    "metadata": {"name": "m-abc"},
                    "ports": [{"name": "http", "port": port}],
                    "endpoints": [
                        {"addresses": ["127.0.0.1"], "conditions": {"ready": False, "serving": False}}
                    ],
                }
            }
            watch._publish()
            await wait_until(lambda: pod_url in router.fleet.endpoints.by_id)
            await wait_until(lambda: router.fleet.endpoints.by_id[pod_url].health.asleep)
            status, _, _ = await post(s, url, body())
            assert status == 200 and len(pod.wakes) == 1
