"""status.adapters from the Ready pods' /load answers (pure), and the ticker against a fake API."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestServer
from tokenfleet.operator.adapter_status import adapter_status, adapter_targets, loaded_adapters


def pod(
    name: str, ready: bool = True, ip: str | None = "10.0.0.1", deleting: bool = False, port: int = 8000
) -> dict:
    meta = {"name": name, **({"deletionTimestamp": "now"} if deleting else {})}
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    status = {"conditions": conditions, **({"podIP": ip} if ip else {})}
    spec = {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]}
    return {"metadata": meta, "status": status, "spec": spec}


def test_only_ready_pods_with_an_ip_that_stay_are_asked():
    pods = [
        pod("b"),
        pod("a", ip="fd00::1"),
        pod("c", ready=False),
        pod("d", ip=None),
        pod("e", deleting=True),
    ]
    assert adapter_targets(pods, 9000) == [
        ("a", "http://[fd00::1]:8000/load"),
        ("b", "http://10.0.0.1:8000/load"),
    ]


def test_an_adapter_is_ready_when_every_ready_pod_reports_it():
    answers = [
        {"lora_adapters": {"sql": "sql@1", "chat": "chat@2"}},
        {"lora_adapters": {"sql": "sql@1"}},  # chat refused or not loaded yet on this pod
    ]
    entries, ready = adapter_status(["sql", "chat"], answers)
    assert entries == [
        {"name": "sql", "loadedPods": 2, "ready": True, "pinnedPods": 0},
        {"name": "chat", "loadedPods": 1, "ready": False, "pinnedPods": 0},
    ]
    assert ready == "1/2"


def test_no_answer_counts_as_not_loaded_and_no_pods_means_not_ready():
    assert adapter_status(["sql"], [None, {"lora_adapters": {"sql": "k"}}])[0][0]["ready"] is False
    assert adapter_status(["sql"], []) == (
        [{"name": "sql", "loadedPods": 0, "ready": False, "pinnedPods": 0}],
        "0/1",
    )
    answers = [{"lora_adapters": {"sql": "k"}, "lora_pinned": ["sql"]}, {"lora_pinned": "not a list"}]
    assert adapter_status(["sql"], answers)[0][0]["pinnedPods"] == 1
    assert adapter_status([], [{"lora_adapters": {"sql": "k"}}]) == (None, None)
    assert loaded_adapters({"lora_adapters": ["not", "a", "map"]}) == frozenset()
    assert loaded_adapters({"num_running": 0}) == frozenset()


def test_the_tick_writes_the_status_only_when_it_changed():
    from tokenfleet.operator import adapter_report

    class Kube:
        def __init__(self):
            self.body = {"metadata": {"name": "m"}, "spec": {"adapters": [{"name": "sql"}]}, "status": {}}
            self.patches = []

        def get(self, kind, namespace, name):
            return self.body

        def list(self, kind, namespace, selector):
            return [pod("p0")]

        def patch_status(self, kind, namespace, name, patch):
            self.patches.append(patch)
            self.body["status"].update(patch)

    async def answer(session, url):
        return {"lora_adapters": {"sql": "sql@1"}}

    kube = Kube()
    original = adapter_report.read_json
    adapter_report.read_json = answer
    try:
        for _ in range(2):
            asyncio.run(adapter_report.report_adapters(kube, "ns", "m", session=None))
    finally:
        adapter_report.read_json = original
    assert kube.patches == [
        {
            "adapters": [{"name": "sql", "loadedPods": 1, "ready": True, "pinnedPods": 0}],
            "adaptersReady": "1/1",
        }
    ]


class PinningPod:
    """A runtime pod's /load and /v1/pin_lora_adapter over real HTTP, requiring the internal key to pin."""

    def __init__(self, adapters: dict[str, str], room: int, running: int):
        self.adapters, self.room, self.running = adapters, room, running
        self.pins: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/load", self.load)
        app.router.add_post("/v1/pin_lora_adapter", self.pin)
        return app

    async def load(self, request: web.Request) -> web.Response:
        body = {"num_running": self.running, "num_waiting": 0, "kv_cache_usage": 0.0}
        return web.json_response({**body, "lora_adapters": self.adapters, "lora_room": self.room})

    async def pin(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer the-internal-key":
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        self.pins.append(await request.json())
        return web.json_response({"ok": True})


def test_the_tick_pins_each_adapters_minimum_copies_with_the_internal_key():
    """minCopies 2 of three pods: the pod holding it and the least loaded with room are pinned, for a lease
    of PIN_TICKS ticks, with the deployment's internal key; an adapter without a minimum is not pinned."""
    import base64

    import aiohttp
    from tokenfleet.operator import adapter_report
    from tokenfleet.operator.adapter_copies import PIN_TICKS

    pods = {
        "p0": PinningPod({"chat": "chat@1"}, room=1, running=5),
        "p1": PinningPod({"sql": "sql@1"}, room=1, running=9),
        "p2": PinningPod({}, room=2, running=1),
    }
    adapters = [
        {"name": "sql", "source": "pvc://c/sql", "minCopies": 2},
        {"name": "chat", "source": "pvc://c/chat"},
    ]
    key = base64.b64encode(b"the-internal-key").decode()

    async def run() -> None:
        servers = {name: TestServer(p.app(), host="127.0.0.1") for name, p in pods.items()}
        for server in servers.values():
            await server.start_server()
        meta = {"name": "m", "namespace": "ns"}

        class Kube:
            def __init__(self):
                self.body = {
                    "metadata": meta,
                    "spec": {"adapters": adapters, "lora": {"maxCpuLoras": 2}},
                    "status": {},
                }

            def get(self, kind, namespace, name):
                return {"data": {"key": key}} if kind == "Secret" else self.body

            def list(self, kind, namespace, selector):
                return [pod(name, ip="127.0.0.1", port=s.port) for name, s in servers.items()]

            def patch_status(self, kind, namespace, name, patch):
                self.body["status"].update(patch)

        try:
            async with aiohttp.ClientSession() as session:
                await adapter_report.report_adapters(Kube(), "ns", "m", session, interval_seconds=5.0)
        finally:
            for server in servers.values():
                await server.close()

    asyncio.run(run())
    lease = {"lora_name": "sql", "seconds": PIN_TICKS * 5.0}
    assert (pods["p0"].pins, pods["p1"].pins, pods["p2"].pins) == ([], [lease], [lease])
