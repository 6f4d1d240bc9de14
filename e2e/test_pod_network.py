"""A session killed before its teardown leaves its pod network; the next session's `create` removes it
(the bridge, its namespaces, what still runs inside) and keeps the networks of live sessions. No cluster."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import session_registry
from pod_network import REGISTRY, PodNetwork, _ip

HERE = Path(__file__).resolve().parent

# A "session" that makes a network and a pod namespace with a process inside, then is killed.
SESSION = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from pod_network import PodNetwork, _ip
net = PodNetwork.create()
net.attach(2)
inside = subprocess.Popen(["ip", "netns", "exec", net.netns(2), "sleep", "60"], start_new_session=True)
print(net.tag, inside.pid, flush=True)
time.sleep(60)
"""


def _has_link(name: str) -> bool:
    return _ip("link", "show", name, check=False).returncode == 0


def _has_netns(name: str) -> bool:
    return name in _ip("netns", "list").stdout.split()


def test_a_killed_sessions_network_is_swept_by_the_next_one_and_a_live_ones_is_kept():
    live = PodNetwork.create()  # this session's: alive, must survive the sweep
    session = subprocess.Popen([sys.executable, "-c", SESSION, str(HERE)], stdout=subprocess.PIPE, text=True)
    dead = None
    try:
        tag, inside_pid = session.stdout.readline().split()
        dead = PodNetwork(tag=tag, subnet="")
        assert _has_link(dead.bridge) and _has_netns(dead.netns(2))
    finally:
        session.send_signal(signal.SIGKILL)
        session.wait(10)
        session.stdout.close()
    with session_registry.locked(REGISTRY) as owners:
        assert owners[dead.tag]["pid"] == session.pid  # left behind: no teardown ran
    fresh = PodNetwork.create()
    try:
        assert not _has_link(dead.bridge) and not _has_netns(dead.netns(2))
        deadline = time.monotonic() + 10
        while session_registry.alive(int(inside_pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        stat = Path(f"/proc/{inside_pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        assert _has_link(live.bridge)
        with session_registry.locked(REGISTRY) as owners:
            assert dead.tag not in owners and {live.tag, fresh.tag} <= owners.keys()
    finally:
        fresh.destroy()
        live.destroy()
    with session_registry.locked(REGISTRY) as owners:
        assert live.tag not in owners and fresh.tag not in owners
    assert not _has_link(live.bridge) and not _has_link(fresh.bridge)
