"""A harness process started with `tethered` gets SIGTERM when the test session dies without a teardown
(SIGKILL); the control, started plainly in a session of its own, outlives it. No cluster needed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tether

HERE = Path(__file__).resolve().parent

# The "session": starts one harness-like child (own session, as the harness starts its processes), says
# its pid, and waits to be killed.
PARENT = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import tether
child = [sys.executable, "-c", sys.argv[2], sys.argv[3]]
cmd = child if sys.argv[4] == "plain" else tether.tethered(child, sys.argv[4])
proc = subprocess.Popen(cmd, start_new_session=True)
print(proc.pid, flush=True)
time.sleep(60)
"""
# The child: notes a SIGTERM in its marker file and exits.
CHILD = """
import pathlib, signal, sys, time
marker = pathlib.Path(sys.argv[1])
def term(*_):
    marker.write_text("terminated")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
marker.write_text("ready")
time.sleep(60)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that is not there)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _orphan(tmp_path: Path, mode: str) -> tuple[int, Path]:
    """Start a parent that starts a child, SIGKILL the parent; (the child's pid, its marker file)."""
    marker = tmp_path / f"{mode}.marker"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(HERE), CHILD, str(marker), mode], stdout=subprocess.PIPE, text=True
    )
    try:
        pid = int(parent.stdout.readline())
        assert _wait(lambda: marker.exists() and marker.read_text() == "ready", 20), "the child never started"
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        parent.stdout.close()
    return pid, marker


@pytest.mark.skipif(tether.SETPRIV is None, reason="util-linux setpriv is not installed")
def test_a_tethered_process_is_terminated_when_the_session_is_killed(tmp_path):
    pid, marker = _orphan(tmp_path, "TERM")
    try:
        assert _wait(lambda: marker.read_text() == "terminated", 10)  # it had its SIGTERM handler run
        assert _wait(lambda: not _running(pid), 10)
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(tether.SETPRIV is None, reason="util-linux setpriv is not installed")
def test_a_process_tethered_with_kill_dies_without_running_its_handlers(tmp_path):
    pid, marker = _orphan(tmp_path, "KILL")
    try:
        assert _wait(lambda: not _running(pid), 10)
        assert marker.read_text() == "ready"
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def test_the_control_a_plain_child_in_its_own_session_outlives_the_killed_session(tmp_path):
    pid, marker = _orphan(tmp_path, "plain")
    try:
        time.sleep(1.0)
        assert _running(pid) and marker.read_text() == "ready"
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_command_off_the_main_thread_is_left_untethered():
    out: list[list[str]] = []
    worker = threading.Thread(target=lambda: out.append(tether.tethered(["etcd", "--x"])))
    worker.start()
    worker.join()
    assert out == [["etcd", "--x"]]
    assert tether.program(tether.tethered(["/opt/bin/etcd", "--x"])) == "etcd"
