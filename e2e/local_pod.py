"""Play the kubelet for one pod: run a Deployment's container command as a local process.

The pod template is taken from the API server as the operator wrote it: the container's command and args,
its env, and its volumes (ConfigMap volumes are materialised from the ConfigMap; emptyDirs become temp
dirs). Paths the container would see are remapped under a temp root, and the container port is mapped to
a free local port by rewriting `server.port`/`server.host` in the runtime config file (what a kubelet's
network namespace + a port-forward would give). Nothing else is changed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPod:
    def __init__(self, cluster: Any, namespace: str, deployment: str, root: Path):
        self.cluster = cluster
        self.namespace = namespace
        self.deployment = deployment
        self.root = root
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    def _volume_dir(self, volume: dict[str, Any]) -> Path:
        path = self.root / "volumes" / volume["name"]
        path.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            cm = self.cluster.get("configmap", volume["configMap"]["name"], self.namespace)
            for key, text in (cm.get("data") or {}).items():
                if key.endswith(".yaml") and "server" in (data := yaml.safe_load(text) or {}):
                    data["server"] = {**data["server"], "host": "127.0.0.1", "port": self.port}
                    text = yaml.safe_dump(data)
                (path / key).write_text(text)
        elif "emptyDir" not in volume:
            raise NotImplementedError(f"volume {volume['name']}: only configMap and emptyDir run locally")
        return path

    def command(self) -> tuple[list[str], dict[str, str]]:
        dep = self.cluster.get("deployment", self.deployment, self.namespace)
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        volumes = {v["name"]: self._volume_dir(v) for v in pod.get("volumes", [])}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}

        def remap(arg: str) -> str:
            for mount_path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
                if arg == mount_path or arg.startswith(mount_path.rstrip("/") + "/"):
                    return str(local) + arg[len(mount_path) :]
            return arg

        argv = [remap(a) for a in [*container.get("command", []), *container.get("args", [])]]
        if argv[0] == "tokenfleet":  # the image's console script = this venv's
            argv = [sys.executable, "-m", "tokenfleet.runtime.cli", *argv[1:]]
        env = {**os.environ, **{e["name"]: remap(e["value"]) for e in container.get("env", [])}}
        return argv, env

    def start(self, log_path: Path) -> None:
        argv, env = self.command()
        log = open(log_path, "wb")  # noqa: SIM115 (kept open by the child)
        self.proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the pod's process exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.url}/ready not 200 after {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root / "volumes", ignore_errors=True)
