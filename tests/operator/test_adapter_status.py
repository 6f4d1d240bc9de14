"""status.adapters from the Ready pods' /load answers (pure), and the ticker against a fake API."""

from __future__ import annotations

import asyncio

from tokenfleet.operator.adapter_status import adapter_status, adapter_targets, loaded_adapters


def pod(name: str, ready: bool = True, ip: str | None = "10.0.0.1", deleting: bool = False) -> dict:
    meta = {"name": name, **({"deletionTimestamp": "now"} if deleting else {})}
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    status = {"conditions": conditions, **({"podIP": ip} if ip else {})}
    spec = {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]}
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
        {"name": "sql", "loadedPods": 2, "ready": True},
        {"name": "chat", "loadedPods": 1, "ready": False},
    ]
    assert ready == "1/2"


def test_no_answer_counts_as_not_loaded_and_no_pods_means_not_ready():
    assert adapter_status(["sql"], [None, {"lora_adapters": {"sql": "k"}}])[0][0]["ready"] is False
    assert adapter_status(["sql"], []) == ([{"name": "sql", "loadedPods": 0, "ready": False}], "0/1")
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
        {"adapters": [{"name": "sql", "loadedPods": 1, "ready": True}], "adaptersReady": "1/1"}
    ]
