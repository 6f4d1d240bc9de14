"""Which pods the autoscaler counts, and how (the scrapes themselves run over real HTTP in
test_autoscaler.py's loop tests)."""

from __future__ import annotations

from typing import Any

from tokenfleet.operator.autoscaling_policy import PodState
from tokenfleet.operator.fleet_scrape import cold_start_seconds, pod_view


def test_pod_classification():
    def pod(**status: Any) -> dict[str, Any]:
        return {"metadata": {"name": "p"}, "spec": {}, "status": status}

    ready = [{"type": "Ready", "status": "True"}]
    assert pod_view(pod(podIP="10.0.0.7", conditions=ready)).url == "http://10.0.0.7:8000/metrics"
    assert pod_view(pod(podIP="fd00::7", conditions=ready)).url == "http://[fd00::7]:8000/metrics"
    assert pod_view(pod(phase="Pending")).state is PodState.STARTING  # not even scheduled yet
    loading = [{"name": "runtime", "started": False, "restartCount": 0}]
    assert pod_view(pod(phase="Running", containerStatuses=loading)).state is PodState.STARTING
    went_unready = [{"name": "runtime", "started": True, "restartCount": 0}]
    assert pod_view(pod(phase="Running", containerStatuses=went_unready)).state is PodState.UNKNOWN
    crashed = [{"name": "runtime", "started": False, "restartCount": 2}]
    assert pod_view(pod(phase="Running", containerStatuses=crashed)).state is PodState.UNKNOWN
    leaving = pod(podIP="10.0.0.7", conditions=ready)
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_view(leaving) is None
    assert pod_view(pod(phase="Failed")) is None


def _pod(created: str, ready_at: str | None) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True", "lastTransitionTime": ready_at}] if ready_at else []
    return {"metadata": {"name": created, "creationTimestamp": created}, "status": {"conditions": conditions}}


def test_the_cold_start_is_the_newest_ready_pods_creation_to_ready():
    pods = [
        _pod("2026-01-01T00:00:00Z", "2026-01-01T00:01:40Z"),
        _pod("2026-01-01T00:10:00Z", "2026-01-01T00:10:42Z"),
        _pod("2026-01-01T00:20:00Z", None),  # still starting: not a measurement
    ]
    assert cold_start_seconds(pods) == 42.0
    assert cold_start_seconds(pods[2:]) is None
