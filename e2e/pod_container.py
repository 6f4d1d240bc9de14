"""One container's bookkeeping on the process kubelet: its state as the API shows it, and what a finished
run leaves in `lastState.terminated` (exit code, reason, message)."""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MESSAGE_BYTES, LOG_TAIL_LINES, LOG_TAIL_BYTES = 4096, 80, 2048
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime(TIME_FORMAT)


def seconds_between(start: str, end: str) -> float:
    return (dt.datetime.strptime(end, TIME_FORMAT) - dt.datetime.strptime(start, TIME_FORMAT)).total_seconds()


@dataclass
class Container:
    spec: dict[str, Any]
    init: bool = False
    restart_count: int = 0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    proc: asyncio.subprocess.Process | None = None
    killing: str | None = None  # why the kubelet is stopping it (a failed probe)

    @property
    def name(self) -> str:
        return self.spec["name"]

    def status(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "state": self.state,
            "lastState": self.last_state,
            "ready": self.ready,
            "restartCount": self.restart_count,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "started": self.started,
        }
        if self.proc is not None:
            out["containerID"] = f"process://{self.proc.pid}"
        return out


def termination(
    spec: dict[str, Any], exit_code: int, started_at: str, message_file: Path, log_file: Path
) -> dict[str, Any]:
    """`terminated` for a run that ended: the termination-message file, else (a failed start, or a failure
    under FallbackToLogsOnError) the log's last lines, as the kubelet reports them."""
    message = message_file.read_bytes()[:MESSAGE_BYTES].decode(errors="replace")
    fallback = spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"
    if not message and (exit_code == 128 or (fallback and exit_code != 0)):
        lines = log_file.read_bytes().decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        message = "\n".join(lines)[-LOG_TAIL_BYTES:]
    reason = "Completed" if exit_code == 0 else ("StartError" if exit_code == 128 else "Error")
    out = {"exitCode": exit_code, "reason": reason, "startedAt": started_at, "finishedAt": now()}
    if message:
        out["message"] = message
    return out
