"""Pod networking for the process kubelet: one bridge per test session, one network namespace per pod.

Every pod gets its own network namespace joined to the session's bridge by a veth pair, and an address
from a private /24 that exists only on that bridge and inside those namespaces. The host holds `.1` on
the bridge: the API server listens there too, so pods reach it exactly as in-cluster clients do. Pods get
no default route, only the bridge's own subnet: nothing a pod sends can leave the machine, and the host
never forwards for them.

Names carry a per-session tag, so concurrent sessions on one machine never touch each other's links and
the teardown sweep (`PodNetwork.destroy`) removes exactly what this session made, even after the kubelet
died: it kills every process still inside a pod namespace, deletes the namespaces, then the bridge. A
session killed before its teardown leaves its network behind; every network is recorded with its
session's pid (session_registry.py), and the next `create` sweeps those whose session is gone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass

from session_registry import alive, locked

REGISTRY = "networks"  # tag -> {"pid": the owning session, "subnet": its /24}


class NetworkSetupError(RuntimeError):
    """Pod networking cannot be set up here (not root, no `ip`, no netns support): no weaker fallback."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise NetworkSetupError("the `ip` command (iproute2) is needed for pod network namespaces") from e
    if check and proc.returncode != 0:
        raise NetworkSetupError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _ip("-4", "-o", "addr", "show").stdout.split()
    nets = [ipaddress.ip_interface(w).network for w in out if "/" in w and w[0].isdigit()]
    routes = _ip("-4", "route", "show").stdout.split()
    nets += [ipaddress.ip_network(w, strict=False) for w in routes if "/" in w and w[0].isdigit()]
    return nets


@dataclass(frozen=True, slots=True)
class PodNetwork:
    """The session's bridge and subnet; `attach`/`detach` one pod namespace at a time."""

    tag: str  # 6 hex chars, unique per session
    subnet: str  # e.g. "10.213.7.0/24"

    @property
    def bridge(self) -> str:
        return f"tfbr{self.tag}"

    @property
    def host_ip(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[1])

    @property
    def prefix_len(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def pod_ip(self, index: int) -> str:
        assert 2 <= index <= 254, index
        return str(ipaddress.ip_network(self.subnet)[index])

    def netns(self, index: int) -> str:
        return f"tf{self.tag}-p{index}"

    # ---------------------------------------------------------------------------------------------- lifecycle
    @classmethod
    def create(cls) -> PodNetwork:
        """A fresh bridge on an unused 10.213.N.0/24; fails with a clear message when netns can't work."""
        if os.geteuid() != 0:
            raise NetworkSetupError("pod network namespaces need root (ip netns, veth pairs, bind mounts)")
        with locked(REGISTRY) as owners:
            for stale in [t for t, owner in owners.items() if not alive(owner["pid"])]:
                cls(tag=stale, subnet=owners.pop(stale)["subnet"]).destroy(unregister=False)
            net = cls._create()
            owners[net.tag] = {"pid": os.getpid(), "subnet": net.subnet}
        return net

    @classmethod
    def _create(cls) -> PodNetwork:
        tag = os.urandom(3).hex()
        used = _used_networks()
        candidates = [ipaddress.ip_network(f"10.213.{n}.0/24") for n in range(256)]
        random.shuffle(candidates)
        subnet = next((c for c in candidates if not any(c.overlaps(u) for u in used)), None)
        if subnet is None:
            raise NetworkSetupError("no free /24 left in 10.213.0.0/16 for pod addresses")
        net = cls(tag=tag, subnet=str(subnet))
        _ip("link", "add", net.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{net.host_ip}/{net.prefix_len}", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
            # Probe that namespaces work at all before a control plane is started on top of this.
            probe = f"tf{tag}-probe"
            _ip("netns", "add", probe)
            _ip("netns", "del", probe)
        except NetworkSetupError:
            _ip("link", "del", net.bridge, check=False)
            raise
        return net

    def attach(self, index: int) -> tuple[str, str]:
        """Create the pod's namespace and veth; returns (netns name, pod IP)."""
        ns, ip = self.netns(index), self.pod_ip(index)
        host_if, pod_if = f"tf{self.tag}h{index}", f"tf{self.tag}c{index}"
        self.detach(index)  # a leftover from a killed kubelet must not block the slot
        _ip("netns", "add", ns)
        try:
            _ip("link", "add", host_if, "type", "veth", "peer", "name", pod_if)
            _ip("link", "set", pod_if, "netns", ns)
            _ip("link", "set", host_if, "master", self.bridge)
            _ip("link", "set", host_if, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", pod_if, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{ip}/{self.prefix_len}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        except NetworkSetupError:
            self.detach(index)
            raise
        return ns, ip

    def detach(self, index: int) -> None:
        ns = self.netns(index)
        self._kill_inside(ns)
        _ip("netns", "del", ns, check=False)  # takes the pod end of the veth (and so the host end) with it
        _ip("link", "del", f"tf{self.tag}h{index}", check=False)

    def namespaces(self) -> list[str]:
        names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
        return [n for n in names if n.startswith(f"tf{self.tag}-")]

    def destroy(self, unregister: bool = True) -> None:
        """Remove every namespace and link of this session; processes still inside are killed first."""
        for ns in self.namespaces():
            self._kill_inside(ns)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        if unregister:
            with locked(REGISTRY) as owners:
                owners.pop(self.tag, None)

    @staticmethod
    def _kill_inside(ns: str) -> None:
        for _ in range(50):
            pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
