"""EndpointSlices -> pod URLs (every address not terminating; the ready ones only for watchers without probes),
and the endpoint set's diffing."""

from __future__ import annotations

import threading

import pytest
from tokenfleet.runtime.router.config import ROLE_LABEL, Backend, Discovery
from tokenfleet.runtime.router.endpoints import (
    EndpointSet,
    EndpointSliceWatch,
    ready_endpoints,
    ready_urls,
    role_ref,
    slice_endpoints,
)


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


def test_discovery_keeps_not_ready_addresses_and_drops_terminating_ones():
    """A pod Kubernetes marks not ready (loading, or asleep: its /ready is 503) stays known, so the router's
    own probes can take it in and the router can wake it; a terminating one is going away."""
    slices = [
        slice_(
            [
                ep("10.0.0.1"),
                ep("10.0.0.2", ready=False),
                ep("10.0.0.3", ready=False, serving=False),
                ep("10.0.0.4", terminating=True),
                ep("10.0.0.5", ready=False, serving=True, terminating=True),
                ep("10.0.0.6", ready=None),
            ]
        )
    ]
    assert list(slice_endpoints(slices, 8000)) == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
        "http://10.0.0.6:8000",
    ]
    assert list(slice_endpoints(slices, 8000, ready_only=True)) == ["http://10.0.0.1:8000"]


class _Published:
    """Stands in for the event loop: keeps what the watch hands `on_change`."""

    def __init__(self):
        self.urls = None

    def call_soon_threadsafe(self, callback, backend, urls):
        self.urls = urls


def test_a_backends_watch_publishes_not_ready_endpoints_and_the_peers_watch_does_not():
    """The backend's watch must hand the router its not-ready pods (or a sleeping pod is never woken and a
    request waits out its deadline); the peers' watch has no probes of its own, so it takes ready ones."""
    backend = Backend(name="chat", model="m", url="http://chat.ns.svc:8000")
    slices = {"s": slice_([ep("10.0.0.1"), ep("10.0.0.2", ready=False), ep("10.0.0.3", terminating=True)])}
    seen = {}
    for name, kw in (("backend", {}), ("peers", {"read_roles": False, "ready_only": True})):
        loop = _Published()
        watch = EndpointSliceWatch(backend, "ns", lambda b, urls: None, loop, **kw)
        watch._slices = slices
        watch._publish()
        seen[name] = list(loop.urls)
    assert seen == {
        "backend": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        "peers": ["http://10.0.0.1:8000"],
    }


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


def _pod(addr, pod):
    return {**ep(addr), "targetRef": {"kind": "Pod", "name": pod}}


def test_roles_come_from_the_pods_labels_else_the_slices():
    # One Service over both roles: its slice has no role label; the pods' labels say.
    mixed = {**slice_([_pod("10.0.0.1", "chat-p-1"), _pod("10.0.0.2", "chat-d-1"), _pod("10.0.0.3", "x")])}
    pods = {"chat-p-1": "prefill", "chat-d-1": "decode"}
    assert ready_endpoints([mixed], 8000, pod_roles=pods) == {
        "http://10.0.0.1:8000": "prefill",
        "http://10.0.0.2:8000": "decode",
        "http://10.0.0.3:8000": None,
    }
    # A per-role Service: the endpoint-slice controller copies its labels onto the slice.
    per_role = slice_([_pod("10.0.1.1", "chat-decode-1")])
    per_role["metadata"]["labels"] = {ROLE_LABEL: "decode", "kubernetes.io/service-name": "chat-decode"}
    assert ready_endpoints([per_role], 8000) == {"http://10.0.1.1:8000": "decode"}
    # The pod's own label wins over its slice's.
    assert ready_endpoints([per_role], 8000, pod_roles={"chat-decode-1": "prefill"}) == {
        "http://10.0.1.1:8000": "prefill"
    }


def test_endpoint_roles_follow_labels_only_in_a_backend_of_both_roles():
    es = EndpointSet(Discovery())
    mixed = Backend(name="chat", model="m", url="http://chat.ns.svc:8000")
    configured = Backend(name="pre", model="m", url="http://pre.ns.svc:8000", role="prefill")
    es.sync(
        mixed,
        {"http://10.0.0.1:8000": "prefill", "http://10.0.0.2:8000": "decode", "http://10.0.0.3:8000": None},
    )
    es.sync(configured, {"http://10.0.1.1:8000": "decode"})  # the configured role wins
    assert {e.url: e.role for e in es.by_id.values()} == {
        "http://10.0.0.1:8000": "prefill",
        "http://10.0.0.2:8000": "decode",
        "http://10.0.0.3:8000": "both",
        "http://10.0.1.1:8000": "prefill",
    }
    assert [e.url for e in es.of_backends([role_ref("chat", "decode")])] == ["http://10.0.0.2:8000"]
    assert len(es.of_backends(["chat"])) == 3
    # A relabelled pod: same endpoint (its health and load history stay), new role.
    before = es.by_id["http://10.0.0.2:8000"]
    added, removed = es.sync(mixed, {"http://10.0.0.1:8000": "prefill", "http://10.0.0.2:8000": "prefill"})
    assert added == [] and [e.url for e in removed] == ["http://10.0.0.3:8000"]
    assert es.by_id["http://10.0.0.2:8000"] is before and before.role == "prefill"


def test_a_backend_name_cannot_hold_the_role_separator():
    with pytest.raises(ValueError, match="cannot contain"):
        Backend(name="a#b", model="m", url="http://a:8000")


class _Loop:
    """Records what the watch threads queue, in queue order (the order the event loop would run it)."""

    def __init__(self, on_first=None):
        self.queued: list[tuple[bool, dict]] = []
        self._on_first = on_first
        self.watch: EndpointSliceWatch | None = None

    def call_soon_threadsafe(self, callback, backend, urls):
        first, self._on_first = self._on_first, None
        if first is not None:
            first()  # the publishing thread is held up here, between its snapshot and its place in the queue
        self.queued.append((self.watch._lock.locked(), urls))


def test_the_last_snapshot_queued_by_the_two_watch_threads_is_the_newest():
    """The slice watch snapshots a pod as unlabelled; before its snapshot is queued, the pod watch learns the
    pod's role and publishes. The loop must apply the labelled snapshot last, not the older one."""
    backend = Backend(name="chat", model="m", url="http://chat.ns.svc:8000")
    other_done = threading.Event()

    def pod_watch_publishes():
        def run():
            with watch._lock:
                watch._pod_roles["chat-d-1"] = "decode"
            watch._publish()
            other_done.set()

        thread = threading.Thread(target=run)
        thread.start()
        threads.append(thread)
        # Gives the other thread every chance to queue first; it cannot while this one queues under the lock.
        other_done.wait(0.3)

    threads: list[threading.Thread] = []
    loop = _Loop(on_first=pod_watch_publishes)
    watch = EndpointSliceWatch(backend, None, lambda b, urls: None, loop)
    loop.watch = watch
    watch._slices = {"s": slice_([_pod("10.0.0.2", "chat-d-1")])}
    watch._publish()
    for thread in threads:
        thread.join(5)
    assert [urls for _, urls in loop.queued] == [
        {"http://10.0.0.2:8000": None},
        {"http://10.0.0.2:8000": "decode"},
    ]
    assert all(locked for locked, _ in loop.queued)  # each was queued while its snapshot was current
