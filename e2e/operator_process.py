"""The operator as a real subprocess (`tokenfleet operator --kubeconfig ...`): killable and restartable.
It runs the image payload's `tokenfleet` script (image_payload.py), as the operator Deployment runs the
image's."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

from tether import tethered


class OperatorProcess:
    def __init__(
        self,
        kubeconfig: Path,
        log_path: Path,
        image: Path,
        resync_seconds: float = 3.0,
        autoscale_seconds: float = 3.0,
        node_cache_dir: Path | None = None,
    ):
        self.kubeconfig = kubeconfig
        self.image = image
        self.log_path = log_path
        self.resync_seconds = resync_seconds
        self.autoscale_seconds = autoscale_seconds
        # Every "node" of the e2e cluster is this machine: one cache directory stands for each node's.
        self.node_cache_dir = node_cache_dir
        self.proc: subprocess.Popen | None = None
        self._log_start = 0  # where the running process's output starts in the (appended) log file

    def command(self) -> list[str]:
        # The payload's console script, exactly as the operator Deployment runs it.
        return [
            str(self.image / "bin" / "tokenfleet"), "operator",
            "--kubeconfig", str(self.kubeconfig),
            "--resync-seconds", str(self.resync_seconds),
            "--autoscale-seconds", str(self.autoscale_seconds),
            *(["--node-cache-dir", str(self.node_cache_dir)] if self.node_cache_dir else []),
        ]  # fmt: skip

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        log = open(self.log_path, "ab")  # noqa: SIM115 (kept open by the child)
        self._log_start = log.tell()
        self.proc = subprocess.Popen(
            tethered(self.command()), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, like a node dying under the operator."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        """What the current (or last) operator process wrote: a restarted one says its start-up lines again."""
        return self.session_log(self._log_start)

    def session_log(self, start: int = 0) -> str:
        """Every operator process's output this session (from byte `start`)."""
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")


# A log record starts with logging's timestamp; a traceback's lines continue it.
RECORD_START = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
# After an API server restart its RBAC caches fill for a moment after it answers: every identity is refused
# then (its /readyz waits for them; clients do not), so 403s near a restart are not a missing rule.
RESTART_MARGIN_S = 10.0


def refused_requests(log: str, apiserver_restarts: list[tuple[float, float]]) -> list[str]:
    """The operator log's records (a timestamped line and its traceback) that hold an RBAC refusal — the
    API server's `forbidden: User "..." cannot <verb> ...` — except those written while the API server was
    restarting. Other 403s are not a missing rule: a namespace being deleted refuses new objects, and so
    does a CustomResourceDefinition being deleted."""
    records: list[tuple[float | None, list[str]]] = []
    for line in log.splitlines():
        if m := RECORD_START.match(line):
            when = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
            records.append((when, [line]))
        elif records:
            records[-1][1].append(line)
        else:
            records.append((None, [line]))
    refused = []
    for when, lines in records:
        if not any("forbidden: User" in line for line in lines):
            continue
        if when is not None and any(
            start <= when <= ready + RESTART_MARGIN_S for start, ready in apiserver_restarts
        ):
            continue
        refused.append("\n".join(lines))
    return refused
