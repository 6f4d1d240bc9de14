"""EndpointSlices -> pod URLs (ready addresses only), and the endpoint set's diffing."""

from __future__ import annotations

from tokenfleet.runtime.router.config import Backend, Discovery
from tokenfleet.runtime.router.endpoints import EndpointSet, ready_urls


def slice_(endpoints, ports=({"name": "http", "port": 8000},)):
    return {"metadata": {"name": "s"}, "ports": list(ports), "endpoints": endpoints}


def ep(addr, ready=True, serving=None, terminating=None):
    cond = {"ready": ready}
    if serving is not None:
        cond["serving"] = serving
    if terminating is not None:
        cond["terminating"] = terminating
    return {"addresses": [addr], "conditions": cond}


def test_only_ready_addresses_become_urls():
    slices = [
        slice_([ep("10.0.0.1"), ep("10.0.0.2", ready=False), ep("10.0.0.3", terminating=True)]),
        slice_([ep("fd00::7")]),
    ]
    assert ready_urls(slices, 8000) == ["http://10.0.0.1:8000", "http://[fd00::7]:8000"]


def test_the_slice_target_port_wins_over_the_service_port():
    slices = [slice_([ep("10.0.0.1")], ports=[{"name": "http", "port": 8080}])]
    assert ready_urls(slices, 80) == ["http://10.0.0.1:8080"]


def test_sync_reports_additions_and_removals_per_backend():
    es = EndpointSet(Discovery())
    a = Backend(name="a", model="m", url="http://a.ns.svc:8000")
    b = Backend(name="b", model="m", url="http://b.ns.svc:8000")
    added, removed = es.sync(a, ["http://10.0.0.1:8000", "http://10.0.0.2:8000/"])
    assert [e.url for e in added] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"] and removed == []
    es.sync(b, ["http://10.0.1.1:8000"])
    added, removed = es.sync(a, ["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
    assert [e.url for e in added] == ["http://10.0.0.3:8000"]
    assert [e.url for e in removed] == ["http://10.0.0.1:8000"]
    assert sorted(e.url for e in es.of_backends(["b"])) == ["http://10.0.1.1:8000"]
