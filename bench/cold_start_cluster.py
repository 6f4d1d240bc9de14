"""Cold start of a ModelDeployment from zero replicas on the real-cluster harness, part by part.

The e2e harness's cluster (control plane, process kubelets, pods in network namespaces, the image payload,
the operator as a process) with one RoutingPolicy and one ModelDeployment (the built-in model) that
autoscales to zero. Each run waits until no pod is left, sends one streaming completion through the
router and times its first token; the parts come from what each component logs with millisecond
timestamps, on this one machine's clock:

- request -> scale-up written: the router holds the request, the operator reads the routers' held requests
  (every second at zero) and writes 0 -> 1 (its log line);
- scale-up -> pod starting on a node: Deployment, ReplicaSet, Pod, scheduler, kubelet (the kubelet's
  "starting" line);
- pod starting -> server process started: network namespace, volumes, the container's exec (the process's
  own start time: its `startup:` line's total subtracted from when it was logged);
- the server's own phases (its `startup:` line, as `bench/cold_start.py` prints them), grouped;
- server ready -> first token: the router sees the pod Ready (its own probe), routes the held request,
  prefill, the first token back to the client.

    python bench/cold_start_cluster.py [--runs 3]

Needs root (network namespaces), as the e2e suite does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
import urllib.request
import uuid
from pathlib import Path

E2E = Path(__file__).resolve().parent.parent / "e2e"
sys.path.insert(0, str(E2E))

import host_paths  # noqa: E402
import yaml  # noqa: E402
from cluster import running_cluster  # noqa: E402
from envtest import wait_for  # noqa: E402
from image_payload import cached_payload  # noqa: E402
from operator_process import OperatorProcess  # noqa: E402
from pod_network import PodNetwork  # noqa: E402
from tokenfleet.runtime.startup_timing import parse_line  # noqa: E402

RUNTIME = "app.kubernetes.io/instance=cold,app.kubernetes.io/component=runtime"
ROUTER = "app.kubernetes.io/instance=cold-front,app.kubernetes.io/component=router"
ROUTING_POLICY = {
    "apiVersion": "serving.tokenfleet.dev/v1alpha1",
    "kind": "RoutingPolicy",
    "metadata": {"name": "cold-front"},
    "spec": {"strategy": "least-load", "router": {"replicas": 1}, "queueTimeoutSeconds": 300},
}
MODEL_DEPLOYMENT = {
    "apiVersion": "serving.tokenfleet.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "cold"},
    "spec": {
        "model": {"servedName": "cold"},
        "routingPolicyRef": "cold-front",
        "autoscaling": {
            "minReplicas": 0,
            "maxReplicas": 1,
            "targets": {"waitingRequestsPerReplica": 1},
            "scaleDown": {"stabilizationWindowSeconds": 0, "cooldownSeconds": 0},
            "scaleToZeroAfterSeconds": 5,
        },
    },
}
# The server's phases, grouped as bench/cold_start.py's table reads them.
GROUPS = {
    "interpreter + imports": ("imports",),
    "config, listener, model resolve": ("config", "listen", "engine_init", "model_resolve"),
    "GGUF header + tokenizer": ("gguf_header", "tokenizer_build", "checkpoint_open"),
    "model build + weights": ("model_build", "weight_read", "dequant", "weight_copy", "model_finish"),
    "KV cache + engine": ("kv_alloc", "engine_build", "engine_start", "tokenizer_json", "ready"),
}


def _log_time(line: str) -> float | None:
    """Epoch seconds of a `2026-12-06 01:28:27,254 ...` log line (Python logging's asctime, local time)."""
    try:
        stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    except ValueError:
        return None
    return stamp.timestamp()


def _first_after(lines: list[str], t0: float, needle: str) -> float | None:
    for line in lines:
        at = _log_time(line)
        if at is not None and at >= t0 and needle in line:
            return at
    return None


def _pods(plane, ns: str) -> list[dict]:
    return [p for p in plane.pods(ns, RUNTIME) if not p["metadata"].get("deletionTimestamp")]


def _first_token(url: str) -> float:
    body = {"model": "cold", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "stream": True}  # fmt: skip
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            if raw.startswith(b"data: {") and b'"text":""' not in raw:
                return time.time()
    raise RuntimeError("the stream ended without a token")


def one_run(plane, operator: OperatorProcess, ns: str, router_url: str) -> dict[str, float]:
    wait_for(lambda: not _pods(plane, ns), timeout=300, interval=0.5, what="no runtime pod left")
    time.sleep(1.0)  # the router's view settles: the pod it knew is gone
    t0 = time.time()
    first = _first_token(f"{router_url}/v1/completions")
    (pod,) = _pods(plane, ns)
    name = pod["metadata"]["name"]
    scaled = _first_after(operator.log().splitlines(), t0, "autoscaler: ")
    starting = None
    container_log = None
    for kubelet in plane.kubelets.values():
        starting = starting or _first_after(kubelet.log().splitlines(), t0, f"pod {ns}/{name}: starting")
        path = kubelet.workdir / "logs" / f"{ns}_{name}" / "runtime-0.log"
        container_log = container_log or (path if path.exists() else None)
    assert scaled and starting and container_log, (scaled, starting, container_log)
    record, ready_at = None, None
    for line in container_log.read_text(errors="replace").splitlines():
        if (parsed := parse_line(line)) is not None:
            record, ready_at = parsed, _log_time(line)
    assert record is not None and ready_at is not None, "no startup line in the server's log"
    process_start = ready_at - record["total_s"]
    parts = {
        "request -> scale-up written": scaled - t0,
        "scale-up -> pod starting on a node": starting - scaled,
        "pod starting -> server process start": process_start - starting,
    }
    phases = record["phases"]
    for group, names in GROUPS.items():
        parts[f"  server: {group}"] = sum(phases.get(n, 0.0) for n in names)
    parts["  server: process start -> ready"] = record["total_s"]
    parts["server ready -> first token at the client"] = first - ready_at
    parts["request -> first token"] = first - t0
    return parts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    network = PodNetwork.create()
    failed = True
    try:
        image = cached_payload()
        with running_cluster(network, image, report=lambda: failed) as plane:
            operator = OperatorProcess(plane.kubeconfig("operator"), plane.dir / "operator.log", image)
            operator.start()
            try:
                ns = f"cold-{uuid.uuid4().hex[:6]}"
                plane.kubectl("create", "namespace", ns)
                plane.kubectl("apply", "-n", ns, "-f", "-",
                              stdin=yaml.safe_dump_all([ROUTING_POLICY, MODEL_DEPLOYMENT]))  # fmt: skip
                # Its one pod: the router rolls once when the deployment's backend joins its config.
                (router,) = wait_for(
                    lambda: (r := plane.pods(ns, ROUTER)) and len(r) == 1 and any(
                        c["type"] == "Ready" and c["status"] == "True" for c in r[0]["status"].get("conditions", [])
                    ) and r,
                    timeout=240, interval=0.5, what="router Ready",
                )  # fmt: skip
                router_url = f"http://{router['status']['podIP']}:8080"
                runs = []
                for i in range(args.runs):
                    runs.append(one_run(plane, operator, ns, router_url))
                    print(f"run {i + 1}: request -> first token {runs[-1]['request -> first token']:.2f} s",
                          flush=True)  # fmt: skip
                print(f"\ncold start of a ModelDeployment from zero (built-in model, CPU), median of {args.runs} "
                      f"run(s), seconds; load average {os.getloadavg()[0]:.2f} (2 CPUs)")  # fmt: skip
                for part in runs[0]:
                    values = [r[part] for r in runs]
                    print(
                        f"  {part:<44} {statistics.median(values):7.2f}  [{min(values):.2f} .. {max(values):.2f}]"
                    )
                failed = False
            finally:
                operator.stop()
    finally:
        network.destroy()
        host_paths.release(os.getpid())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
