"""One pod's life on the process kubelet: network, volumes, init containers, containers with probes and
restarts, status, and graceful deletion.

Each container is a local process started through pod_exec.py inside the pod's network namespace and a
mount namespace of its own. The kubelet's rules are kept: init containers run one by one to completion;
containers restart per `restartPolicy` (the first restart at once, then back-off 10 s doubling to 300 s,
reported as CrashLoopBackOff); `lastState.terminated` carries the exit code, reason and message (the
termination-message file, or the log's tail under FallbackToLogsOnError); a deleted pod gets its preStop
hooks, SIGTERM, the grace period, SIGKILL, and is then removed from the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from host_paths import ensure_target
from pod_container import Container, now, seconds_between, termination
from pod_env import PodSpecError, container_argv, container_env, expand
from pod_probes import ProbeRunner
from pod_volumes import Volumes

if TYPE_CHECKING:
    from kubelet import Kubelet

log = logging.getLogger("kubelet.pod")
POD_EXEC = str(Path(__file__).resolve().parent / "pod_exec.py")
BACKOFF_INITIAL, BACKOFF_MAX = 10.0, 300.0


class PodWorker:
    def __init__(self, kubelet: Kubelet, pod: dict[str, Any], index: int):
        self.kubelet = kubelet
        self.pod = pod
        self.index = index
        self.uid = pod["metadata"]["uid"]
        self.ns, self.name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.dir = kubelet.workdir / "pods" / self.uid
        self.netns: str | None = None
        self.ip: str | None = None
        self.volumes: Volumes | None = None
        self.init = [Container(c, init=True) for c in pod["spec"].get("initContainers") or []]
        for c in self.init:
            c.state = {"waiting": {"reason": "PodInitializing"}}
        self.containers = [Container(c) for c in pod["spec"]["containers"]]
        self.initialized = not self.init
        self.phase = "Pending"
        self.start_time = now()
        self.conditions: dict[str, dict[str, Any]] = {}
        self.deleting = False
        self.done = False
        self.tasks: list[asyncio.Task] = []
        self._dirty = asyncio.Event()
        self._written: dict[str, Any] | None = None

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.ns}/pods/{self.name}"

    # ------------------------------------------------------------------------------------------------- status
    def kick(self) -> None:
        self._dirty.set()

    def _condition(self, ctype: str, ok: bool, reason: str | None = None) -> dict[str, Any]:
        status = "True" if ok else "False"
        before = self.conditions.get(ctype)
        cond = {"type": ctype, "status": status, "lastProbeTime": None}
        cond["lastTransitionTime"] = (
            before["lastTransitionTime"] if before and before["status"] == status else now()
        )
        if reason and not ok:
            cond["reason"] = reason
        self.conditions[ctype] = cond
        return cond

    def status(self) -> dict[str, Any]:
        scheduled = next(
            (c for c in self.pod.get("status", {}).get("conditions") or [] if c["type"] == "PodScheduled"),
            {
                "type": "PodScheduled",
                "status": "True",
                "lastProbeTime": None,
                "lastTransitionTime": self.start_time,
            },
        )
        ready = self.initialized and all(c.ready for c in self.containers) and not self.deleting
        conditions = [
            self._condition("PodReadyToStartContainers", self.netns is not None),
            self._condition("Initialized", self.initialized, "ContainersNotInitialized"),
            self._condition("ContainersReady", ready, "ContainersNotReady"),
            self._condition("Ready", ready, "ContainersNotReady"),
            scheduled,
        ]
        out = {
            "phase": self.phase,
            "conditions": conditions,
            "hostIP": self.kubelet.host_ip,
            "hostIPs": [{"ip": self.kubelet.host_ip}],
            "startTime": self.start_time,
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.ip:
            out |= {"podIP": self.ip, "podIPs": [{"ip": self.ip}]}
        if self.init:
            out["initContainerStatuses"] = [c.status() for c in self.init]
        return out

    async def status_writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            status = self.status()
            comparable = json.dumps(status, sort_keys=True)
            if comparable != self._written:
                try:
                    await self.kubelet.api.merge_patch(f"{self.path}/status", {"status": status})
                    self._written = comparable
                except Exception as e:  # the API hiccuped: keep the pod, write again shortly
                    log.warning("pod %s/%s: status write failed: %s", self.ns, self.name, e)
                    self._dirty.set()
                    await asyncio.sleep(1)
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        self.tasks.append(asyncio.create_task(self.status_writer()))
        self.kick()
        self.netns, self.ip = await asyncio.to_thread(self.kubelet.network.attach, self.index)
        self.kick()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.volumes = Volumes(
            pod=self.pod,
            root=self.dir / "volumes",
            pvc_root=self.kubelet.workdir / "pvc",
            get_object=self.kubelet.get_object,
            request_token=self.kubelet.request_token,
            allocatable=self.kubelet.allocatable(self.pod),
        )
        while True:
            try:
                await self.volumes.setup()
                break
            except PodSpecError as e:
                for c in [*self.init, *self.containers]:
                    c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
                self.kick()
                await asyncio.sleep(2)
        self.tasks.append(asyncio.create_task(self._refresh_volumes()))
        for c in self.init:
            if not await self._supervise(c):
                self.phase = "Failed"
                self.kick()
                return
        self.initialized = True
        for c in self.containers:
            c.state = {"waiting": {"reason": "ContainerCreating"}}
        self.kick()
        results = await asyncio.gather(*(self._supervise(c) for c in self.containers))
        self.phase = "Succeeded" if all(results) else "Failed"
        self.kick()

    async def _refresh_volumes(self) -> None:
        while True:
            await asyncio.sleep(1)
            try:
                await self.volumes.refresh()
            except Exception as e:  # a source went away or the API hiccuped: the pod keeps the last files
                log.debug("pod %s/%s: volume refresh: %s", self.ns, self.name, e)

    async def _supervise(self, c: Container) -> bool:
        """Run `c` until it ends for good; True when it completed successfully."""
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if c.init and policy == "Always":
            policy = "OnFailure"  # init containers must complete
        backoff = 0.0
        while True:
            try:
                exit_code = await self._run_once(c)
            except (
                PodSpecError
            ) as e:  # e.g. an env var's ConfigMap key is missing: wait for it, as kubelets do
                c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
                self.kick()
                await asyncio.sleep(2)
                continue
            if exit_code == 0 and (c.init or policy != "Always"):
                return True
            if policy == "Never" or (policy == "OnFailure" and exit_code == 0):
                return exit_code == 0
            if backoff:
                message = f"back-off {backoff:.0f}s restarting failed container={c.name} pod={self.name}_{self.ns}({self.uid})"
                c.state = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
                self.kick()
                await asyncio.sleep(backoff)
            c.restart_count += 1
            ran = c.last_state["terminated"]
            long_run = seconds_between(ran["startedAt"], ran["finishedAt"]) > 2 * BACKOFF_MAX
            backoff = BACKOFF_INITIAL if (not backoff or long_run) else min(2 * backoff, BACKOFF_MAX)

    async def _run_once(self, c: Container) -> int:
        env = await container_env(
            self.pod, c.spec, self.kubelet.get_object, self.kubelet.host_ip, self.kubelet.api_port,
            self.ip or "", self.kubelet.host_ip, self.kubelet.allocatable(self.pod), self.kubelet.image_bin,
        )  # fmt: skip
        argv = container_argv(c.spec, env)
        term_file = self.dir / "termination" / c.name
        term_file.parent.mkdir(parents=True, exist_ok=True)
        term_file.write_bytes(b"")
        mounts = self._mounts(c, term_file, env)
        spec_file = self.dir / f"{c.name}.exec.json"
        spec_file.write_text(json.dumps({
            "argv": argv, "env": env, "mounts": mounts, "workingDir": c.spec.get("workingDir"),
            "hostname": self.pod["spec"].get("hostname") or self.name, "image": self.kubelet.image_paths,
        }))  # fmt: skip
        # Outside the pod's dir (removed with the pod): the logs outlive it for a failure report.
        log_path = (
            self.kubelet.workdir / "logs" / f"{self.ns}_{self.name}" / f"{c.name}-{c.restart_count}.log"
        )
        log_path.parent.mkdir(parents=True, exist_ok=True)
        started_at = now()
        with open(log_path, "wb") as log:
            c.proc = await asyncio.create_subprocess_exec(
                "ip", "netns", "exec", self.netns, "unshare", "--mount", "--uts", "--propagation", "private",
                "--", sys.executable, POD_EXEC, str(spec_file),
                stdout=log, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        c.state = {"running": {"startedAt": started_at}}
        c.killing = None
        if not c.init:
            self.phase = "Running"
        self.kick()
        probes = [] if c.init else [asyncio.create_task(self._probe(c))]
        try:
            code = await c.proc.wait()
        finally:
            for task in probes:
                task.cancel()
        c.ready = c.started = False
        exit_code = 128 + (-code) if code < 0 else code
        terminated = termination(c.spec, exit_code, started_at, term_file, log_path)
        c.last_state = {"terminated": terminated}
        c.state = {"terminated": terminated}
        self.kick()
        return exit_code

    def _mounts(self, c: Container, term_file: Path, env: dict[str, str]) -> list[dict[str, Any]]:
        assert self.volumes is not None
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            if m["name"] not in self.volumes.paths:
                raise PodSpecError(f"volumeMount {m['name']} names no volume of the pod")
            source = self.volumes.paths[m["name"]]
            # subPathExpr: the container's `$(VAR)`s expanded, as the kubelet does.
            sub = m.get("subPath") or (expand(m["subPathExpr"], env) if m.get("subPathExpr") else None)
            if sub:
                if Path(sub).is_absolute() or ".." in Path(sub).parts:
                    raise PodSpecError(f"volumeMount {m['name']}: subPath {sub!r} leaves its volume")
                source = (source / sub).resolve()
                if not source.exists():
                    source.mkdir(parents=True)
            mounts.append(
                {"source": str(source), "target": m["mountPath"], "readOnly": bool(m.get("readOnly"))}
            )
        term_path = c.spec.get("terminationMessagePath") or "/dev/termination-log"
        mounts.append({"source": str(term_file), "target": term_path, "readOnly": False})
        for m in mounts:
            ensure_target(m["target"], Path(m["source"]).is_dir(), self.kubelet.owner_pid)
        return sorted(mounts, key=lambda m: m["target"].count("/"))

    async def _probe(self, c: Container) -> None:
        spec = c.spec

        def runner(probe: dict[str, Any]) -> ProbeRunner:
            return ProbeRunner(
                probe, spec, self.ip or "", self.netns or "", lambda: c.proc.pid if c.proc else None
            )

        if "startupProbe" in spec:
            started = asyncio.get_running_loop().create_future()

            def on_startup(ok: bool, message: str) -> None:
                if not started.done():
                    started.set_result((ok, message))

            task = asyncio.create_task(runner(spec["startupProbe"]).run(on_startup))
            ok, message = await started
            task.cancel()
            if not ok:
                await self._kill_for_probe(c, f"Startup probe failed: {message}")
                return
        c.started = True
        self.kick()
        tasks = []
        if "readinessProbe" in spec:

            def on_ready(ok: bool, _message: str) -> None:
                c.ready = ok and not self.deleting
                self.kick()

            tasks.append(asyncio.create_task(runner(spec["readinessProbe"]).run(on_ready)))
        else:
            c.ready = True
            self.kick()
        if "livenessProbe" in spec:
            died = asyncio.get_running_loop().create_future()

            def on_live(ok: bool, message: str) -> None:
                if not ok and not died.done():
                    died.set_result(message)

            tasks.append(asyncio.create_task(runner(spec["livenessProbe"]).run(on_live)))
            try:
                message = await died
            finally:
                for t in tasks:
                    t.cancel()
            await self._kill_for_probe(c, f"Liveness probe failed: {message}")
        else:
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()

    async def _kill_for_probe(self, c: Container, why: str) -> None:
        c.killing = why
        grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        await self._stop_process(c, grace)

    async def _stop_process(self, c: Container, grace: float) -> None:
        proc = c.proc
        if proc is None or proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    # -------------------------------------------------------------------------------------------------- delete
    async def terminate(self, grace: float, main: asyncio.Task) -> None:
        """Graceful deletion: readiness off, preStop, SIGTERM, grace period, SIGKILL; then the Pod goes."""
        self.deleting = True
        for c in self.containers:
            c.ready = False
        self.kick()
        main.cancel()  # no more restarts or init steps
        deadline = asyncio.get_running_loop().time() + grace
        running = [c for c in self.containers if c.proc is not None and c.proc.returncode is None]
        await asyncio.gather(*(self._pre_stop(c, deadline) for c in running), return_exceptions=True)
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        await asyncio.gather(*(self._stop_process(c, remaining) for c in running))
        await self.cleanup()
        await self.kubelet.api.delete(
            self.path, {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        )

    async def _pre_stop(self, c: Container, deadline: float) -> None:
        hook = (c.spec.get("lifecycle") or {}).get("preStop")
        if not hook:
            return
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        if "sleep" in hook:
            await asyncio.sleep(min(float(hook["sleep"]["seconds"]), timeout))
            return
        probe = {**hook, "timeoutSeconds": max(1, int(timeout))}
        runner = ProbeRunner(
            probe, c.spec, self.ip or "", self.netns or "", lambda: c.proc.pid if c.proc else None
        )
        await asyncio.wait_for(runner.check(), timeout)

    async def cleanup(self) -> None:
        """Kill whatever is left (a pod deleted at once), free the network and the pod's files."""
        for task in self.tasks:
            task.cancel()
        for c in [*self.init, *self.containers]:
            if c.proc is not None and c.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                await c.proc.wait()
        await asyncio.to_thread(self.kubelet.network.detach, self.index)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.done = True
