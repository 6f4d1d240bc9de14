"""Pods that cannot become ready, and a ModelDeployment status that says why, not only "not ready":

- a pod whose command fails (a model that does not exist): the kubelet restarts it with back-off into
  CrashLoopBackOff; the status carries the reason and the container's last message;
- a GPU model on CPU-only nodes: the scheduler leaves the pod Pending; the status carries its reason."""

from __future__ import annotations

import json

import pytest

MD = {
    "apiVersion": "serving.tokenfleet.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "broken"},
    "spec": {"model": {"source": "no-such-model"}, "engine": {"maxNumSeqs": 4}},
}


@pytest.mark.slow
def test_failing_command_crash_loops_and_the_status_says_why(cluster, namespace, wait):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(MD))

    def crash_looping():
        for pod in cluster.pods(namespace, "app.kubernetes.io/instance=broken"):
            for cs in pod.get("status", {}).get("containerStatuses") or []:
                if (cs["state"].get("waiting") or {}).get("reason") == "CrashLoopBackOff":
                    return cs
        return None

    cs = wait(crash_looping, timeout=180, what="CrashLoopBackOff")
    assert cs["restartCount"] >= 1 and not cs["ready"]
    last = cs["lastState"]["terminated"]
    assert last["exitCode"] != 0 and last["reason"] == "Error"
    assert "no-such-model" in last["message"]  # the log's tail: FallbackToLogsOnError

    def explained():
        st = (cluster.get("md", "broken", namespace) or {}).get("status") or {}
        ready = {c["type"]: c for c in st.get("conditions") or []}.get("Ready") or {}
        return ready.get("reason") == "CrashLoopBackOff" and (st, ready)

    st, ready = wait(explained, timeout=60, what="the ModelDeployment's status to name the crash loop")
    assert st["phase"] != "Ready" and st["readyReplicas"] == 0
    assert ready["status"] == "False" and "no-such-model" in ready["message"]


@pytest.mark.slow
def test_gpu_model_on_cpu_nodes_is_pending_with_the_schedulers_reason(cluster, namespace, wait):
    gpu = {**MD, "metadata": {"name": "gpu"}, "spec": {"resources": {"gpus": 1}}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(gpu))

    def unschedulable():
        for pod in cluster.pods(namespace, "app.kubernetes.io/instance=gpu"):
            for cond in pod.get("status", {}).get("conditions") or []:
                if cond["type"] == "PodScheduled" and cond["status"] == "False":
                    return cond
        return None

    cond = wait(unschedulable, what="the scheduler to leave the pod Pending")
    assert cond["reason"] == "Unschedulable" and "Insufficient nvidia.com/gpu" in cond["message"]

    def explained():
        st = (cluster.get("md", "gpu", namespace) or {}).get("status") or {}
        ready = {c["type"]: c for c in st.get("conditions") or []}.get("Ready") or {}
        return ready.get("reason") == "Unschedulable" and (st, ready)

    st, ready = wait(explained, timeout=60, what="the scheduler's reason in the ModelDeployment's status")
    assert st["phase"] != "Ready" and "Insufficient nvidia.com/gpu" in ready["message"]
