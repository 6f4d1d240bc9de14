"""Chaos under sustained load at length: the e2e harness's real cluster (control plane, one process kubelet
per node, pods in network namespaces, the image payload, the operator as a process), the fleet and load of
e2e/chaos.py, and every fault, repeated until the run has lasted `--minutes`.

    python bench/chaos.py [--minutes 10] [--workers 4] [--seed 0] [--gap 20]

The first round injects each fault once, in an order where each leaves the fleet whole for the next (the
scale-down and the node loss come last: after them one decode pod serves); later rounds repeat the faults
that leave the fleet as they found it. Between faults the load runs `--gap` seconds undisturbed. Prints
the chaos table (requests sent / completed / disconnected / client-visible errors by kind with why /
retried / resumed / leaked KV blocks, and per fault the seconds back to steady state). Needs root (network
namespaces), as the e2e suite does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

E2E = Path(__file__).resolve().parent.parent / "e2e"
sys.path.insert(0, str(E2E))

import host_paths  # noqa: E402
from chaos import ChaosRun  # noqa: E402
from cluster import running_cluster  # noqa: E402
from image_payload import cached_payload  # noqa: E402
from operator_process import OperatorProcess  # noqa: E402
from pod_network import PodNetwork  # noqa: E402

FIRST_ROUND = [
    "edit_routing_policy",
    "kill_decode_pod",
    "kill_router",
    "restart_operator",
    "kill_prefill_pod",
    "restart_apiserver",
    "edit_cache_policy",
    "rolling_update",
    "scale_down",
    "lose_node",
]
REPEATABLE = [
    "kill_decode_pod",
    "edit_routing_policy",
    "kill_router",
    "kill_prefill_pod",
    "restart_apiserver",
    "restart_operator",
    "edit_cache_policy",
    "rolling_update",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="of load, faults included")
    p.add_argument("--workers", type=int, default=4, help="concurrent clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gap", type=float, default=20.0, help="seconds of undisturbed load between faults")
    p.add_argument("--budget", type=float, default=300.0, help="seconds a fault may take to settle")
    args = p.parse_args()

    network = PodNetwork.create()
    failed = True
    try:
        image = cached_payload()
        with running_cluster(network, image, report=lambda: failed) as plane:
            operator = OperatorProcess(plane.kubeconfig("operator"), plane.dir / "operator.log", image)
            operator.start()
            try:
                ns = f"chaos-{uuid.uuid4().hex[:6]}"
                plane.kubectl("create", "namespace", ns)
                run = ChaosRun(plane, network, operator, ns, workers=args.workers, seed=args.seed)
                run.deploy()
                schedule = list(FIRST_ROUND)
                end = run.started + args.minutes * 60
                while time.monotonic() < end:
                    if not schedule:
                        schedule = [*REPEATABLE]
                    name = schedule.pop(0)
                    result = run.inject(name, budget=args.budget)
                    steady = "not steady" if result.steady_s is None else f"{result.steady_s:.1f} s"
                    print(
                        f"[{result.at:6.0f} s] {name}: {result.detail}; back to steady in {steady}",
                        flush=True,
                    )
                    time.sleep(max(0.0, min(args.gap, end - time.monotonic())))
                run.finish()
                print(run.report())
                failed = bool(run.defects()) or any(run.leaked.values())
            finally:
                operator.stop()
    finally:
        network.destroy()
        host_paths.release(os.getpid())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
