"""CRD fuzz at length: many more documents than the e2e test, the same generator and the same judge.

    python bench/crd_fuzz.py [--docs 5000] [--seed 1] [--batch 12] [--lanes 8] [--resync 3]

Starts its own control plane (etcd, kube-apiserver with the audit log, controller-manager, scheduler; no
kubelet: every accepted document runs at zero replicas), installs manifests/ and runs the operator as a
subprocess under its least-privilege identity, exactly as the e2e session does. Prints documents tried,
how many were rejected by the API server with a message naming the field, reconciled, waiting on a
missing policy, flagged by the operator (ConfigValid False + Warning Event), every judge problem, the
operator's restarts and failed handlers, and its API calls per reconcile (max / median, counted by the
API server's audit log) with reconciles per object against the resync timer's own count as the peer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

E2E = Path(__file__).resolve().parent.parent / "e2e"
sys.path.insert(0, str(E2E))

from audit_log import read_calls  # noqa: E402
from cluster import install  # noqa: E402
from crd_fuzz import field_names, generate, spec_schemas  # noqa: E402
from crd_fuzz_run import call_figures, run_fuzz  # noqa: E402
from envtest import ControlPlane  # noqa: E402
from image_payload import cached_payload  # noqa: E402
from kube_api import KubeApi  # noqa: E402
from operator_process import OperatorProcess  # noqa: E402
from test_crd_fuzz import handler_failures  # noqa: E402
from tether import program  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=5000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--lanes", type=int, default=8, help="batches (namespaces) in flight at once")
    p.add_argument("--resync", type=float, default=3.0)
    args = p.parse_args()

    plane = ControlPlane().start()
    # The operator runs the image payload's `tokenfleet`, as in the e2e suite.
    operator = OperatorProcess(
        plane.kubeconfig("operator"), plane.dir / "operator.log", cached_payload(), args.resync, 3.0
    )
    try:
        install(plane)
        operator.start()
        pid = operator.proc.pid
        docs = generate(args.docs, args.seed, args.batch)

        async def go():
            async with KubeApi(plane.kubeconfig("admin")) as api:
                return await run_fuzz(
                    api, docs, field_names(spec_schemas()), batch_size=args.batch, batches_at_once=args.lanes
                )

        started = time.monotonic()
        outcomes, log = asyncio.run(go())
        elapsed = time.monotonic() - started
        alive = operator.alive() and operator.proc.pid == pid
        namespaces = set(log.judged_at)
        figures = call_figures(outcomes, read_calls(plane.audit_log, namespaces), log)
        failures = handler_failures(operator.log())
        cpu = {"operator": cpu_seconds(pid), **{program(p.args): cpu_seconds(p.pid) for p in plane.procs}}
    finally:
        operator.stop()
        plane.stop()

    results = Counter(o.result for o in outcomes)
    # Documents the operator never got to (a busy machine) last: the others say more.
    problems = sorted(
        ((o, p) for o in outcomes for p in o.problems), key=lambda op: op[0].result == "unsettled"
    )
    per_reconcile = sorted(figures.per_reconcile().values())
    recs = figures.reconciles
    timer_peer = {n: figures.lifetime[n] / args.resync for n in recs}
    ratio = sorted(recs[n] / max(1.0, timer_peer[n]) for n in recs)
    print(f"documents tried           {len(outcomes)} in {elapsed:.0f} s (seed {args.seed})")
    lifetimes = sorted(log.judged_at[ns] - log.started_at[ns] for ns in log.judged_at)
    print(f"  batch of {args.batch}: median {statistics.median(lifetimes):.1f} s, max {lifetimes[-1]:.1f} s"
          f" from namespace to judgement, {args.lanes} at once")  # fmt: skip
    print(f"  by family               {dict(Counter(o.doc.family for o in outcomes))}")
    print(f"rejected, field named     {sum(o.result == 'rejected' and not o.problems for o in outcomes)}"
          f" / {results['rejected']} rejected")  # fmt: skip
    print(f"reconciled                {results['reconciled']}")
    print(f"pending on a policy       {results['pending']}")
    print(f"flagged (condition+Event) {results['flagged']}")
    print(f"unsettled                 {results['unsettled']}")
    print(f"judge problems            {len(problems)}")
    for o, prob in problems[:15]:
        print(f"  {o.doc.kind} {o.doc.name[:50]} {o.doc.mutation} {o.doc.field}: {prob}: {o.message[:160]}")
    print(f"operator restarts         {0 if alive else 1} (alive, same pid: {alive})")
    print(f"failed handlers           {len(failures)}")
    for line in sorted({line.split(": ", 1)[-1][:200] for line in failures})[:10]:
        print(f"  {line}")
    if per_reconcile:
        print(f"API calls per reconcile   max {per_reconcile[-1]:.1f}  median {statistics.median(per_reconcile):.1f}"
              f"  over {len(per_reconcile)} accepted objects")  # fmt: skip
        print(f"reconciles / resync ticks max {ratio[-1]:.2f}  median {statistics.median(ratio):.2f}"
              " (peer: one timer reconcile per resync period = 1.00)")  # fmt: skip
    print("CPU seconds               " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
    return 0 if alive and not problems and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
