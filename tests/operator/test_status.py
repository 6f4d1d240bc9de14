"""Status: phase and conditions from the reconcile outcome and the Deployment as stored."""

from __future__ import annotations

from tokenfleet.operator.status import (
    ReconcileOutcome,
    model_deployment_status,
    pod_trouble,
    rollout_state,
    status_changed,
)

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
OK = ReconcileOutcome(desired_replicas=2, selector="a=b", endpoint="http://x.ns.svc:8000", config_hash="h")


def _dep(generation=3, observed=3, replicas=2, updated=2, ready=2, conditions=()):
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "updatedReplicas": updated,
            "readyReplicas": ready,
            "conditions": list(conditions),
        },
    }


def test_rollout_phases():
    assert rollout_state(None, 2)[0] == "Progressing"
    assert rollout_state(_dep(), 2)[:3] == ("Ready", 2, 2)
    assert rollout_state(_dep(observed=2), 2)[0] == "Progressing"  # the Deployment has not seen the change
    assert rollout_state(_dep(updated=1, ready=1), 2)[0] == "Progressing"  # rolling
    assert rollout_state(_dep(ready=1), 2)[0] == "Degraded"  # rolled, but a pod is not ready
    stuck = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]
    assert rollout_state(_dep(ready=0, updated=0, conditions=stuck), 2)[0] == "Failed"
    assert rollout_state(_dep(ready=1, updated=1, conditions=stuck), 2)[0] == "Degraded"
    assert rollout_state(_dep(replicas=0, updated=0, ready=0), 0)[0] == "Ready"


def test_ready_status_and_transition_times():
    first = model_deployment_status(OK, _dep(ready=0, updated=0), 3, None, NOW)
    assert first["phase"] == "Progressing"
    assert (first["replicas"], first["readyReplicas"], first["observedGeneration"]) == (2, 0, 3)
    assert (first["selector"], first["endpoint"], first["configHash"]) == ("a=b", "http://x.ns.svc:8000", "h")
    ready = model_deployment_status(OK, _dep(), 3, first, LATER)
    cond = {c["type"]: c for c in ready["conditions"]}
    assert ready["phase"] == "Ready"
    assert cond["Ready"] == {
        "type": "Ready", "status": "True", "reason": "ReplicasReady", "message": "2/2 replicas ready",
        "lastTransitionTime": LATER, "observedGeneration": 3,
    }  # fmt: skip
    assert cond["ConfigValid"]["lastTransitionTime"] == NOW  # unchanged status keeps its time
    again = model_deployment_status(OK, _dep(), 3, ready, "2026-01-01T01:00:00Z")
    assert again == ready and not status_changed(ready, again)


def test_invalid_spec_and_missing_policy():
    failed = model_deployment_status(ReconcileOutcome(config_error="bad gpus"), None, 1, None, NOW)
    assert failed["phase"] == "Failed"
    assert {c["type"]: (c["status"], c["reason"]) for c in failed["conditions"]}["ConfigValid"] == (
        "False",
        "InvalidSpec",
    )
    pending = model_deployment_status(
        ReconcileOutcome(missing_policies=("CachePolicy/x",)), None, 1, None, NOW
    )
    cond = {c["type"]: c for c in pending["conditions"]}
    assert pending["phase"] == "Pending"
    assert cond["PoliciesResolved"]["message"] == "referenced policies not found: CachePolicy/x"
    assert cond["ConfigValid"]["status"] == "True"


def test_status_changed_treats_missing_as_none():
    assert not status_changed({"phase": "Ready"}, {"phase": "Ready", "endpoint": None})
    assert status_changed({"phase": "Ready"}, {"phase": "Degraded"})


def _pod(name, container_statuses=(), conditions=(), deleting=False):
    meta = {"name": name, **({"deletionTimestamp": NOW} if deleting else {})}
    return {
        "metadata": meta,
        "status": {"containerStatuses": list(container_statuses), "conditions": list(conditions)},
    }


def test_a_stuck_pod_says_why_the_deployment_is_not_ready():
    crash = {"name": "runtime", "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
             "lastState": {"terminated": {"exitCode": 1, "message": "ConfigError: model 'x' is unknown\n"}}}  # fmt: skip
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}  # fmt: skip
    starting = {"name": "runtime", "state": {"waiting": {"reason": "ContainerCreating"}}}
    assert pod_trouble([_pod("a", [starting])]) is None  # on its way: nothing to explain
    assert pod_trouble([_pod("b", [crash], deleting=True)]) is None  # going away anyway
    assert pod_trouble([_pod("b", [crash]), _pod("a", conditions=[unschedulable])]) == (
        "Unschedulable",
        "pod a: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
    )  # the first pod by name
    st = model_deployment_status(OK, _dep(ready=0, updated=2), 3, None, NOW, [_pod("b", [crash])])
    ready = {c["type"]: c for c in st["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "CrashLoopBackOff"
    assert ready["message"].endswith("pod b: container runtime CrashLoopBackOff (exit code 1): "
                                     "ConfigError: model 'x' is unknown")  # fmt: skip
    # A Ready deployment is not second-guessed by a pod's past.
    assert model_deployment_status(OK, _dep(), 3, None, NOW, [_pod("b", [crash])])["phase"] == "Ready"
