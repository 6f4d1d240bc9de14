"""status.loading: which pods are asked, what their /ready answers mean, and the tick that writes it (against
real HTTP servers on loopback standing in for the pods)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web
from tokenfleet.operator.loading_report import loading_wanted, report_loading
from tokenfleet.operator.model_loading import (
    MAX_REPORTED_PODS,
    loading_entry,
    loading_status,
    loading_targets,
)


def _pod(name: str, ip: str | None = "10.0.0.5", ready: bool = False, started: bool | None = None,
         port: int = 8000, **meta: Any) -> dict[str, Any]:  # fmt: skip
    status: dict[str, Any] = {"phase": "Running" if started is not None else "Pending"}
    if ip:
        status["podIP"] = ip
    status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    if started is not None:
        status["containerStatuses"] = [{"name": "runtime", "started": started}]
    return {
        "metadata": {"name": name, **meta},
        "spec": {"containers": [{"name": "runtime", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": status,
    }


def test_the_pods_asked_are_those_on_their_way_to_ready():
    pods = [
        _pod("b-fetching"),  # init container running: no container status for the runtime yet
        _pod("a-loading", started=False, ip="fd00::5"),
        _pod("c-ready", ready=True, started=True),
        _pod("d-asleep", started=True),  # loaded, not Ready for another reason: not a load to report
        _pod("e-leaving", deletionTimestamp="2026-01-01T00:00:00Z"),
        _pod("f-no-ip", ip=None),
    ]
    assert loading_targets(pods, 8000) == [
        ("a-loading", "http://[fd00::5]:8000/ready"),
        ("b-fetching", "http://10.0.0.5:8000/ready"),
    ]
    many = [_pod(f"p{i:02}") for i in range(20)]
    assert len(loading_targets(many, 8000)) == MAX_REPORTED_PODS


def test_what_the_answers_mean():
    fetching = {
        "status": "fetching",
        "progress": {
            "phase": "download",
            "bytes": 1200,
            "total": 4000,
            "percent": 30.04,
            "file": "model.gguf",
        },
    }
    assert loading_entry("p", fetching) == {
        "pod": "p", "stage": "download", "bytes": 1200, "totalBytes": 4000, "percent": 30.0, "file": "model.gguf",
    }  # fmt: skip
    retry = {
        "status": "fetching",
        "progress": {"phase": "error", "attempt": 2, "reason": "HTTP 503 from the Hub"},
    }
    assert loading_entry("p", retry) == {
        "pod": "p",
        "stage": "error",
        "attempt": 2,
        "message": "HTTP 503 from the Hub",
    }
    loading = {
        "status": "loading",
        "progress": {"seconds": 3.1, "weights": {"done": 29, "total": 290, "percent": 10}},
    }
    assert loading_entry("p", loading) == {
        "pod": "p", "stage": "load", "weightsLoaded": 29, "weightsTotal": 290, "percent": 10.0,
    }  # fmt: skip
    assert loading_entry("p", {"status": "loading"}) == {"pod": "p", "stage": "load"}  # before the weights
    assert loading_entry("p", None) == {"pod": "p", "stage": "starting"}  # no process listening yet
    assert loading_entry("p", {"status": "sleeping"}) is None
    # Odd types from a pod never reach the status.
    odd = loading_entry(
        "p", {"status": "fetching", "progress": {"bytes": True, "total": [1], "percent": "x"}}
    )
    assert odd == {"pod": "p", "stage": "download"}
    assert loading_status([None, None]) is None
    assert loading_status([None, {"pod": "p", "stage": "load"}]) == [{"pod": "p", "stage": "load"}]


def test_the_tick_runs_only_while_a_pod_is_on_its_way():
    assert loading_wanted({"replicas": 2, "readyReplicas": 1})
    assert loading_wanted({"replicas": 1, "readyReplicas": 1, "loading": [{"pod": "p", "stage": "load"}]})
    assert not loading_wanted({"replicas": 2, "readyReplicas": 2})
    roles = {"prefill": {"replicas": 1, "readyReplicas": 0}, "decode": {"replicas": 1, "readyReplicas": 1}}
    assert loading_wanted({"replicas": 1, "readyReplicas": 1, "roles": roles})  # a prefill pod loads
    assert not loading_wanted(None)


class FakeKube:
    def __init__(self, pods: list[dict[str, Any]], status: dict[str, Any]):
        self.pods, self.status, self.patches = pods, status, []

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        assert (kind, label_selector) == ("Pod", "serving.tokenfleet.dev/model-deployment=llama")
        return self.pods

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        return {"metadata": {"name": name}, "status": self.status}

    def patch_status(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.patches.append(patch)
        self.status = {**self.status, **patch}


async def _pod_server(answer: Any) -> tuple[web.AppRunner, int]:
    async def ready(_: web.Request) -> web.Response:
        return answer()

    app = web.Application()
    app.router.add_get("/ready", ready)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def test_the_tick_writes_each_pods_answer_and_clears_it_when_all_are_ready():
    async def run() -> FakeKube:
        fetch = {
            "status": "fetching",
            "progress": {"phase": "download", "bytes": 5, "total": 10, "percent": 50.0},
        }
        runner_a, port_a = await _pod_server(lambda: web.json_response(fetch, status=503))
        runner_b, port_b = await _pod_server(lambda: web.Response(text="not json", status=503))
        pods = [_pod("a", ip="127.0.0.1", port=port_a), _pod("b", ip="127.0.0.1", port=port_b)]
        kube = FakeKube(pods, {"replicas": 2, "readyReplicas": 0})
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
                await report_loading(kube, "ns", "llama", session)
                await report_loading(kube, "ns", "llama", session)  # the same answers: nothing written
                for pod in pods:
                    pod["status"]["conditions"][0]["status"] = "True"
                await report_loading(kube, "ns", "llama", session)
        finally:
            await runner_a.cleanup()
            await runner_b.cleanup()
        return kube

    kube = asyncio.run(run())
    assert kube.patches == [
        {
            "loading": [
                {"pod": "a", "stage": "download", "bytes": 5, "totalBytes": 10, "percent": 50.0},
                {"pod": "b", "stage": "starting"},
            ]
        },
        {"loading": None},
    ]
    json.dumps(kube.patches)  # what is written is plain JSON
