"""The fairness and priority experiments run end to end on one replica (their tables live in
docs/simulator.md) and keep their direction."""

from __future__ import annotations

from tokenfleet.sim import experiments


def test_fairness_rows_show_fair_share_keeping_the_light_tenant_served(capsys):
    alone, off, on, pods = experiments.fairness(5, replicas=1, warmup=5)
    assert [r[0] for r in (alone, off, on, pods)] == [
        "B alone",
        "A + B, fair share off",
        "A + B, fair share in the router",
        "A + B, fair share in the router and the pods",
    ]
    assert alone[7] is None and off[8] > 0  # A is in the mixed runs only, and its flood is refused
    # B's TTFT p50: the queue's deadline first come first served, far below it with fair share, whether
    # the router's queue or the pods' own queues hold the flood.
    assert off[1] > 4.0 and on[1] * 3 < off[1] and pods[1] * 3 < off[1]
    assert on[5] == 0 == pods[5] < off[5]  # B refused only first come first served
    # The flood fills every pod's batch, so each step B waits through is longer than with B alone.
    assert 0 < alone[10] < on[10] and alone[10] < pods[10]
    # B's TTFT in its parts: under the flood its own prefill runs in those longer steps, and it also waits.
    assert all(len(r[12]) == 3 and min(r[12]) >= 0 for r in (alone, off, on, pods))
    assert on[12][2] > alone[12][2] and sum(on[12][:2]) > sum(alone[12][:2])
    assert "| A + B, fair share in the router and the pods |" in capsys.readouterr().out


def test_priority_rows_show_preemption_mattering_only_when_pods_hold_the_backlog():
    rows = experiments.priority(10, replicas=1)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("interactive alone", 256, "fcfs"),
        ("batch alone", 256, "fcfs"),
        ("batch + interactive", 256, "fcfs"),
        ("batch + interactive", 256, "priority"),
        ("batch alone", 1024, "fcfs"),
        ("batch + interactive", 1024, "fcfs"),
        ("batch + interactive", 1024, "priority"),
        ("long batch prompts alone", 1024, "fcfs"),
        ("long batch prompts + interactive", 1024, "fcfs"),
        ("long batch prompts + interactive", 1024, "priority"),
    ]
    # The router holding the backlog leaves the pods nothing to preempt for: the same run either way.
    assert rows[2][3:9] == rows[3][3:9] and rows[3][8] == 0
    # Pods holding it: priority preempts batch, and the interactive p99 drops.
    assert rows[6][4] * 2 < rows[5][4] and rows[6][8] > 0
    assert rows[1][7] == 0.0 and rows[4][7] == 0.0 and rows[5][7] > 0  # loss against batch alone
    # Long prompts chunked over steps: under priority their chunks go after the interactive admissions, so
    # the interactive TTFT drops without preempting anything.
    assert rows[9][4] < rows[8][4] and rows[9][8] == 0 and rows[7][7] == 0.0
