"""Real `tokenfleet serve` pods of the default model on loopback, for the benches that compare fleets."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import yaml

MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pod(tmp: Path, port: int, num_blocks: int) -> subprocess.Popen:
    cfg = {
        "model": {"model": MODEL},
        "cache": {"num_blocks": num_blocks},
        "server": {"host": "127.0.0.1", "port": port},
    }
    path = tmp / f"pod-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "tokenfleet.runtime.cli", "serve", "--config", str(path)]
    with open(tmp / f"pod-{port}.log", "w") as log:  # the child keeps its own descriptor
        # cwd: never the repo root, whose `operator/` folder would shadow the stdlib module.
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)


async def wait_ready(
    session: aiohttp.ClientSession, url: str, proc: subprocess.Popen, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pod {url} exited ({proc.returncode}); see its log")
        try:
            async with session.get(url + "/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(1.0)
    raise TimeoutError(f"pod {url} not ready after {timeout}s")
