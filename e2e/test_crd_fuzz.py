"""CRD fuzz: 600 ModelDeployment / CachePolicy / RoutingPolicy documents (valid, boundary,
malformed; crd_fuzz.py, fixed seed) applied to the real API server with the real operator running.

Each document is rejected by the API server naming the offending field, or accepted and then reconciled
(at zero replicas: no pod starts) or given a False ConfigValid condition naming the field plus a Warning
Event (crd_fuzz_run.judge). Over the whole run the operator never dies, no handler fails with an unexpected
exception, and its API calls per object stay bounded (counted by the API server's audit log: a hot loop
shows up there whatever causes it). FUZZ_DOCS / FUZZ_SEED run another amount or another sample
(bench/crd_fuzz.py prints the figures).
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics

import pytest
from audit_log import read_calls
from crd_fuzz import field_names, generate, spec_schemas
from crd_fuzz_run import call_figures, run_fuzz
from kube_api import KubeApi

# 600 keeps the suite within its budget on two cores; bench/crd_fuzz.py runs 1000 or more.
FUZZ_DOCS = int(os.environ.get("FUZZ_DOCS", "600"))
FUZZ_SEED = int(os.environ.get("FUZZ_SEED", "20261204"))
BATCH = 12
# A reconcile reads the object, applies its children (ConfigMap, Deployment, Service, InferencePool),
# reads the Deployment, lists pods and may patch status and post an Event; a RoutingPolicy's also writes
# the router's five children. Far above that is a loop inside one reconcile.
MAX_CALLS_PER_RECONCILE = 25


def handler_failures(log: str) -> list[str]:
    """kopf's lines for a handler or timer that raised something other than kopf's own Permanent/Temporary
    errors (an unexpected exception: kopf retries it after its backoff)."""
    return [line for line in log.splitlines() if "failed with an exception" in line]


@pytest.mark.slow
def test_crd_fuzz(cluster, operator):
    pid, log_start = operator.proc.pid, len(operator.log())
    docs = generate(FUZZ_DOCS, FUZZ_SEED, BATCH)
    fields = field_names(spec_schemas())

    async def go():
        async with KubeApi(cluster.kubeconfig("admin")) as api:
            return await run_fuzz(api, docs, fields, batch_size=BATCH)

    outcomes, log = asyncio.run(go())
    namespaces = set(log.judged_at)

    problems = [
        f"{o.doc.kind} {o.doc.name[:70]} ({o.doc.family} {o.doc.mutation} {o.doc.field}): {p} -- "
        f"{o.message[:300]}"
        for o in outcomes
        for p in o.problems
    ]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:25])
    results = {
        r: sum(o.result == r for o in outcomes) for r in ("rejected", "reconciled", "pending", "flagged")
    }
    # The sample really exercises every path.
    assert all(results.values()), results

    assert operator.alive() and operator.proc.pid == pid, operator.log()[-3000:]
    failures = handler_failures(operator.log()[log_start:])
    assert not failures, "\n".join(failures[:20])

    figures = call_figures(outcomes, read_calls(cluster.audit_log, namespaces), log)
    per_reconcile = figures.per_reconcile()
    assert per_reconcile, "no API call attributed to any document"
    worst = max(per_reconcile, key=per_reconcile.get)
    assert per_reconcile[worst] <= MAX_CALLS_PER_RECONCILE, (
        worst,
        figures.calls[worst],
        figures.reconciles[worst],
    )
    # Reconciles come from events and the resync timer: a few per resync period of the object's life, not
    # a retry loop (kopf's default backoff for an unexpected error would show up as far more).
    for name, count in figures.reconciles.items():
        bound = 6 + 3 * figures.lifetime[name] / operator.resync_seconds
        assert count <= bound, (
            f"{name}: {count} reconciles in {figures.lifetime[name]:.0f} s (bound {bound:.0f})"
        )
    print(
        f"fuzz: {len(outcomes)} documents {results}; API calls per reconcile median "
        f"{statistics.median(per_reconcile.values()):.1f} max {per_reconcile[worst]:.1f}"
    )


def test_fuzz_documents_are_reproducible():
    """The same seed gives the same documents, and each family and mutation is present."""
    a, b = generate(120, 7, BATCH), generate(120, 7, BATCH)
    assert [d.body for d in a] == [d.body for d in b]
    assert {d.family for d in a} == {"valid", "boundary", "malformed"}
    assert {d.mutation for d in a} >= {"wrong-type", "unknown-field", "out-of-range", "contradictory"}
    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", d.name) and len(d.name) <= 253 for d in a)
