"""The operator as a real subprocess (`tokenfleet operator --kubeconfig ...`): killable and restartable.
It runs the image payload's `tokenfleet` script (image_payload.py), as the operator Deployment runs the
image's."""

from __future__ import annotations

import signal
import subprocess
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
    ):
        self.kubeconfig = kubeconfig
        self.image = image
        self.log_path = log_path
        self.resync_seconds = resync_seconds
        self.autoscale_seconds = autoscale_seconds
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        # The payload's console script, exactly as the operator Deployment runs it.
        return [
            str(self.image / "bin" / "tokenfleet"), "operator",
            "--kubeconfig", str(self.kubeconfig),
            "--resync-seconds", str(self.resync_seconds),
            "--autoscale-seconds", str(self.autoscale_seconds),
        ]  # fmt: skip

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        log = open(self.log_path, "ab")  # noqa: SIM115 (kept open by the child)
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
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
