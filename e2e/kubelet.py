"""A process kubelet: registers Nodes, keeps their Leases fresh, and runs the Pods bound to them as local
processes, each in its own network namespace (pod_network.py) and mount namespace (pod_exec.py).

Run by the e2e harness as its own process (`python e2e/kubelet.py ...`, see `KubeletProcess`), so it
can be killed like a node and never shares the test's event loop. It polls the API server twice a second
for the pods of its nodes (a cluster of a few pods needs no watch), hands each new pod to a `PodWorker`,
starts graceful termination when a pod gets a deletionTimestamp, and kills at once a pod that vanished.
On SIGTERM it kills every pod it runs and removes their namespaces; the harness sweeps again after it.

Nodes advertise the allocatable cpu, memory and (optionally) `nvidia.com/gpu` they are given, so the
real scheduler places pods — or leaves them Pending with its own reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from image_payload import image_paths  # noqa: E402
from kube_api import ApiError, KubeApi  # noqa: E402
from pod_network import PodNetwork  # noqa: E402
from pod_worker import PodWorker  # noqa: E402
from session_registry import alive  # noqa: E402
from tether import tethered  # noqa: E402

log = logging.getLogger("kubelet")
LEASE_SECONDS = 40
SYNC_SECONDS = 0.5
OBJECT_TTL = 0.5
KUBE_VERSION = "v1.37.2"


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    cpu: str = "8"
    memory: str = "32Gi"
    gpus: int = 0

    @classmethod
    def parse(cls, text: str) -> NodeSpec:
        name, cpu, memory, gpus = ([*text.split(":"), "", "", "", ""])[:4]
        return cls(name, cpu or "8", memory or "32Gi", int(gpus or 0))

    def __str__(self) -> str:
        return f"{self.name}:{self.cpu}:{self.memory}:{self.gpus}"

    def allocatable(self) -> dict[str, str]:
        out = {"cpu": self.cpu, "memory": self.memory, "pods": "110", "ephemeral-storage": "100Gi"}
        if self.gpus:
            out["nvidia.com/gpu"] = str(self.gpus)
        return out


def micro_time() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Kubelet:
    def __init__(
        self,
        api: KubeApi,
        network: PodNetwork,
        nodes: list[NodeSpec],
        workdir: Path,
        owner_pid: int,
        image: Path,
        indexes: range = range(2, 255),
    ):
        self.api = api
        self.network = network
        self.nodes = {n.name: n for n in nodes}
        self.workdir = workdir
        self.owner_pid = owner_pid
        # Containers run the image payload (a venv holding the image's wheel) instead of pulling an image.
        # What that image would hold is the venv and the site directories it borrows: a pod volume mounted
        # over one of them (an emptyDir on /tmp while a path lives under /tmp) must not hide it, so
        # pod_exec.py binds these back at their own paths after the volumes.
        self.image_bin = str(image / "bin")
        self.image_paths = image_paths(image)
        self.host_ip = network.host_ip
        self.api_port = int(api.server.rsplit(":", 1)[1])
        self.workers: dict[str, tuple[PodWorker, asyncio.Task]] = {}
        self.finished: set[str] = set()
        # Pod slots on the session's bridge (address, namespace and link names); one kubelet process per
        # node, each with slots of its own, so that a node can be stopped alone.
        self.free_indexes = list(indexes)
        self._objects: dict[str, tuple[float, dict[str, Any] | None]] = {}
        self._background: set[asyncio.Task] = set()

    def _spawn(self, coro: Any) -> None:
        """A background task, referenced until done (the loop holds tasks only weakly)."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------------------------------- for workers
    async def get_object(self, kind: str, key: str) -> dict[str, Any] | None:
        """A ConfigMap or Secret (`kind` is the plural), cached for half a second across pods."""
        cached = self._objects.get(f"{kind}/{key}")
        if cached and time.monotonic() - cached[0] < OBJECT_TTL:
            return cached[1]
        ns, name = key.split("/")
        obj = await self.api.get(f"/api/v1/namespaces/{ns}/{kind}/{name}")
        if obj is not None:
            obj.setdefault("kind", "Secret" if kind == "secrets" else "ConfigMap")
        self._objects[f"{kind}/{key}"] = (time.monotonic(), obj)
        return obj

    async def request_token(self, pod: dict[str, Any], spec: dict[str, Any]) -> tuple[str, float]:
        meta = pod["metadata"]
        sa = pod["spec"].get("serviceAccountName") or "default"
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [spec["audience"]] if spec.get("audience") else None,
                "expirationSeconds": int(spec.get("expirationSeconds") or 3600),
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        out = await self.api.request(
            "POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token", body
        )
        assert out is not None
        expires = dt.datetime.strptime(out["status"]["expirationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")
        return out["status"]["token"], expires.replace(tzinfo=dt.UTC).timestamp()

    def allocatable(self, pod: dict[str, Any]) -> dict[str, str]:
        return self.nodes[pod["spec"]["nodeName"]].allocatable()

    # ------------------------------------------------------------------------------------------------- nodes
    async def register(self) -> None:
        for node in self.nodes.values():
            labels = {
                "kubernetes.io/hostname": node.name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            }
            await self.api.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                    "metadata": {"name": node.name, "labels": labels}})  # fmt: skip
            await self._node_status(node)

    async def _node_status(self, node: NodeSpec) -> None:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

        def cond(ctype: str, ok: bool, reason: str) -> dict[str, Any]:
            return {"type": ctype, "status": "True" if ok else "False", "reason": reason,
                    "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}  # fmt: skip

        status = {
            "capacity": node.allocatable(),
            "allocatable": node.allocatable(),
            "conditions": [
                cond("Ready", True, "KubeletReady"),
                cond("MemoryPressure", False, "KubeletHasSufficientMemory"),
                cond("DiskPressure", False, "KubeletHasNoDiskPressure"),
                cond("PIDPressure", False, "KubeletHasSufficientPID"),
            ],
            "addresses": [{"type": "InternalIP", "address": self.host_ip}, {"type": "Hostname", "address": node.name}],
            "nodeInfo": {
                "kubeletVersion": KUBE_VERSION, "kubeProxyVersion": "", "operatingSystem": "linux",
                "architecture": "amd64", "containerRuntimeVersion": "process://tokenfleet-e2e",
                "osImage": "process kubelet", "kernelVersion": os.uname().release,
                "machineID": "", "systemUUID": "", "bootID": "",
            },
        }  # fmt: skip
        await self.api.merge_patch(f"/api/v1/nodes/{node.name}/status", {"status": status})

    async def keep_leases(self) -> None:
        ticks = 0
        while True:
            for node in self.nodes.values():
                try:
                    await self._renew(node, heartbeat=ticks % 4 == 3)
                except (ApiError, OSError, TimeoutError) as e:  # a busy API server: try again next tick
                    log.warning("lease %s: %r", node.name, e)
            ticks += 1
            await asyncio.sleep(LEASE_SECONDS / 4)

    async def _renew(self, node: NodeSpec, heartbeat: bool) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node.name}"
        spec = {"holderIdentity": node.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": micro_time()}
        if await self.api.merge_patch(path, {"spec": spec}) is None:
            await self.api.create(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": node.name}, "spec": spec},
            )  # fmt: skip
        if heartbeat:
            await self._node_status(node)  # lastHeartbeatTime moves

    # -------------------------------------------------------------------------------------------------- pods
    async def sync_once(self) -> None:
        seen: set[str] = set()
        for node in self.nodes:
            listed = await self.api.get("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")
            for pod in (listed or {}).get("items", []):
                uid = pod["metadata"]["uid"]
                seen.add(uid)
                await self._sync_pod(uid, pod)
        for uid in [u for u in self.workers if u not in seen]:  # deleted at once (grace 0, namespace gone)
            worker, task = self.workers.pop(uid)
            task.cancel()
            self._spawn(self._finish(worker))
        self.finished &= seen

    async def _sync_pod(self, uid: str, pod: dict[str, Any]) -> None:
        deleting = pod["metadata"].get("deletionTimestamp") is not None
        if uid in self.workers:
            worker, task = self.workers[uid]
            worker.pod["metadata"] = pod["metadata"]  # labels/annotations for the downward API
            if deleting and not worker.deleting:
                grace = float(pod["metadata"].get("deletionGracePeriodSeconds") or 0)
                self._spawn(self._guard(worker.terminate(grace, task), worker))
            return
        if uid in self.finished or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            if deleting:
                await self.api.delete(
                    f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}",
                    {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
                )
            return
        if deleting:  # never started here: nothing to stop
            await self.api.delete(
                f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
            )
            return
        worker = PodWorker(self, pod, self.free_indexes.pop(0))
        task = asyncio.create_task(self._guard(worker.run(), worker))
        self.workers[uid] = (worker, task)
        log.info("pod %s/%s: starting (netns %s)", worker.ns, worker.name, worker.index)

    async def _guard(self, coro: Any, worker: PodWorker) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod %s/%s", worker.ns, worker.name)
        finally:
            if worker.done and worker.uid in self.workers:
                self.workers.pop(worker.uid)
                self._free(worker.index)
            elif not worker.deleting and worker.phase in ("Succeeded", "Failed"):
                self.finished.add(worker.uid)

    async def _finish(self, worker: PodWorker) -> None:
        await worker.cleanup()
        self._free(worker.index)

    def _free(self, index: int) -> None:
        if index not in self.free_indexes:
            self.free_indexes.append(index)

    async def run(self, stop: asyncio.Event) -> None:
        await self.register()
        leases = asyncio.create_task(self.keep_leases())
        try:
            while not stop.is_set():
                if not alive(self.owner_pid):
                    # The test session died without stopping us (SIGKILL, a crash): end the pods rather
                    # than leave them, and ourselves, running with no one to stop them.
                    log.warning("owner process %d is gone: stopping every pod", self.owner_pid)
                    break
                try:
                    await self.sync_once()
                except (ApiError, OSError, TimeoutError) as e:
                    log.warning("sync: %r", e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), SYNC_SECONDS)
        finally:
            leases.cancel()
            for worker, task in list(self.workers.values()):
                task.cancel()
                await worker.cleanup()


# ---------------------------------------------------------------------------------------------- the process
class KubeletProcess:
    """The kubelet as a child process of the test session; `stop()` ends it and its pods (a node that
    crashed: its Lease goes stale, the node lifecycle controller marks it NotReady and evicts its pods);
    `start()` again brings the node back."""

    def __init__(
        self,
        kubeconfig: Path,
        network: PodNetwork,
        nodes: list[NodeSpec],
        workdir: Path,
        image: Path,
        indexes: range = range(2, 255),
    ):
        self.workdir = workdir
        self.log_path = workdir / "kubelet.log"
        workdir.mkdir(parents=True, exist_ok=True)
        self.cmd = [
            sys.executable, str(HERE / "kubelet.py"), "--kubeconfig", str(kubeconfig),
            "--network", f"{network.tag}/{network.subnet}", "--workdir", str(workdir),
            "--owner-pid", str(os.getpid()), "--image", str(image), *(f"--node={n}" for n in nodes),
            "--indexes", f"{indexes.start}-{indexes.stop - 1}",
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    def start(self) -> KubeletProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                tethered(self.cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--network", required=True, help="TAG/SUBNET of the session's pod bridge")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--owner-pid", type=int, required=True)
    parser.add_argument(
        "--image", type=Path, required=True, help="the image payload's venv (image_payload.py)"
    )
    parser.add_argument("--node", action="append", type=NodeSpec.parse, required=True)
    parser.add_argument(
        "--indexes", default="2-254", help="FIRST-LAST: this kubelet's pod slots on the bridge"
    )
    args = parser.parse_args()
    first, last = (int(x) for x in args.indexes.split("-"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    tag, subnet = args.network.split("/", 1)
    network = PodNetwork(tag=tag, subnet=subnet)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with KubeApi(args.kubeconfig) as api:
            kubelet = Kubelet(
                api, network, args.node, args.workdir, args.owner_pid, args.image, range(first, last + 1)
            )
            await kubelet.run(stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
