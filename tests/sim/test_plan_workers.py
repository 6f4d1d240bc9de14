"""A plan's worker processes never outlive the plan: SIGKILL it mid-search and its simulations stop too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PLAN = (
    "from tokenfleet.sim.cli import main; main(['plan', '--model', '8b', '--rate', '40', '--duration', '60',"
    " '--gpus', 'h100,a100', '--tp', '1', '--jobs', '2'])"
)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0], int(fields[1])


def _workers(parent: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(int(entry))
        if stat is None or stat[1] != parent:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(int(entry))
        except FileNotFoundError:
            pass
    return out


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def test_killing_a_plan_kills_its_worker_processes():
    proc = subprocess.Popen(
        [sys.executable, "-c", PLAN], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(workers) < 2 and proc.poll() is None:
            time.sleep(0.2)
            workers = _workers(proc.pid)
        assert len(workers) == 2, "the plan did not start its two workers"
        time.sleep(1.0)  # into their first simulations
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), "a worker outlived its plan"
    finally:
        proc.kill()
        proc.wait(10)
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
