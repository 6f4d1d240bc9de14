"""What a failed e2e test's namespace looked like when it failed, added to the failure's report.

A CI log is often all there is of a failure: an assertion that timed out says what did not happen, not why.
This is read right after the test body fails, while its namespace still holds everything: each pod
(phase, readiness, restarts, node), each Deployment's counts, each ModelDeployment's status, the latest
Events, and the operator's last lines. It is bounded (a long report would push the assertion itself out
of a CI log's tail) and best effort: a read that fails says so in place of its part.
"""

from __future__ import annotations

import json
from typing import Any

MAX_EVENTS = 25
OPERATOR_LINES = 40
MAX_LINE = 240


def _clip(line: str) -> str:
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."


def _items(cluster: Any, kind: str, namespace: str) -> list[dict[str, Any]]:
    return json.loads(cluster.kubectl("get", kind, "-n", namespace, "-o", "json", check=True))["items"]


def pod_lines(pods: list[dict[str, Any]]) -> list[str]:
    out = []
    for pod in pods:
        status = pod.get("status") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        containers = status.get("containerStatuses") or []
        restarts = sum(int(c.get("restartCount") or 0) for c in containers)
        waiting = [
            (c.get("state") or {}).get("waiting", {}).get("reason")
            for c in containers
            if (c.get("state") or {}).get("waiting")
        ]
        gone = " terminating" if pod["metadata"].get("deletionTimestamp") else ""
        out.append(
            f"pod {pod['metadata']['name']}: {status.get('phase')}{gone} ready={conditions.get('Ready', '?')} "
            f"restarts={restarts} node={pod['spec'].get('nodeName') or '-'} ip={status.get('podIP') or '-'}"
            + (f" waiting={','.join(w for w in waiting if w)}" if any(waiting) else "")
        )
    return out


def deployment_lines(deployments: list[dict[str, Any]]) -> list[str]:
    out = []
    for d in deployments:
        st = d.get("status") or {}
        out.append(
            f"deployment {d['metadata']['name']}: spec {d['spec'].get('replicas')} replicas "
            f"{st.get('replicas', 0)} ready {st.get('readyReplicas', 0)} "
            f"available {st.get('availableReplicas', 0)}"
        )
    return out


def model_deployment_lines(mds: list[dict[str, Any]]) -> list[str]:
    out = []
    for md in mds:
        status = {k: v for k, v in (md.get("status") or {}).items() if k not in ("conditions", "kopf")}
        out.append(f"modeldeployment {md['metadata']['name']}: status {json.dumps(status, sort_keys=True)}")
        for c in (md.get("status") or {}).get("conditions") or []:
            if c.get("status") != "True" or c.get("type") != "Ready":
                out.append(
                    f"  condition {c.get('type')}={c.get('status')} {c.get('reason')}: {c.get('message')}"
                )
    return out


def event_lines(events: list[dict[str, Any]]) -> list[str]:
    def when(e: dict[str, Any]) -> str:
        return e.get("lastTimestamp") or e.get("eventTime") or e["metadata"].get("creationTimestamp") or ""

    latest = sorted(events, key=when)[-MAX_EVENTS:]
    return [
        f"event {when(e)} {e.get('type')} {e.get('reason')} "
        f"{(e.get('involvedObject') or {}).get('kind')}/{(e.get('involvedObject') or {}).get('name')}: "
        f"{e.get('message')}"
        for e in latest
    ]


def namespace_report(cluster: Any, namespace: str, operator: Any | None) -> str:
    """The namespace's state and the operator's last lines, one clipped line per fact."""
    lines: list[str] = [f"namespace {namespace}"]
    parts = [
        ("pods", pod_lines),
        ("deployments", deployment_lines),
        ("modeldeployments.serving.tokenfleet.dev", model_deployment_lines),
        ("events", event_lines),
    ]
    for kind, render in parts:
        try:
            lines += render(_items(cluster, kind, namespace))
        except Exception as e:  # the API may be what failed: the rest of the report still helps
            lines.append(f"{kind}: not read ({type(e).__name__}: {e})")
    if operator is not None:
        tail = operator.log().splitlines()[-OPERATOR_LINES:]
        lines.append(f"operator ({'running' if operator.alive() else 'not running'}), its last lines:")
        lines += ["  " + line for line in tail]
    return "\n".join(_clip(line) for line in lines)
