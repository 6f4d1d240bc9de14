"""Chaos under sustained load, the CI-sized schedule (e2e/chaos.py has the load, the faults and the table;
`bench/chaos.py` runs the long schedule with every fault, the node loss included).

Under a steady mixed load through two routers to a disaggregated ModelDeployment: a RoutingPolicy edit, the
busiest decode pod SIGKILLed, the prefill pod SIGKILLed, a router SIGKILLed, the operator killed and
restarted, the API server restarted, a CachePolicy edit. Then: no client-visible error except those whose
router was killed under them (each says why), every request whole (the tokens asked for, structured output
that parses), no KV block left taken on any pod, and the fleet back to steady state after every fault.
"""

from __future__ import annotations

import time

import pytest
from chaos import UNRESUMABLE, ChaosRun

SCHEDULE = [
    "edit_routing_policy",
    "kill_decode_pod",
    "kill_router",
    "restart_operator",
    "kill_prefill_pod",
    "restart_apiserver",
    "edit_cache_policy",
]
FAULT_BUDGET_S = 150  # a SIGKILLed runtime pod reloads its model on a busy 2-core machine


@pytest.mark.slow
def test_the_fleet_loses_nothing_resumable_under_faults(cluster, pod_network, operator, namespace):
    run = ChaosRun(cluster, pod_network, operator, namespace, workers=4, seed=0)
    run.deploy()
    try:
        for name in SCHEDULE:
            result = run.inject(name, budget=FAULT_BUDGET_S)
            assert result.steady_s is not None, f"{name} ({result.detail}): not steady\n{run.report()}"
        # The replacement router found the survivor through the routers' Service: one quota again. Each
        # router re-lists the Service's EndpointSlices after the API server's restart (a pause of 2 s per
        # failed try while it comes back) and learns a peer's id on its next read: a minute is generous.
        deadline = time.monotonic() + 60
        while not run.routers_share_one_quota():
            assert time.monotonic() < deadline, "the two routers do not read each other's rate-limit usage"
            time.sleep(0.5)
    finally:
        run.finish()
        print(run.report())
    report = run.report()
    records = [r for r in run.load.records if r.outcome]
    assert sum(r.outcome == "ok" for r in records) >= 20, report
    assert any(r.outcome == "disconnected" for r in records), report
    assert not run.defects(), report
    assert set(run.errors()) <= set(UNRESUMABLE), report
    assert run.leaked and not any(run.leaked.values()), report
