"""Real `tokenfleet serve` pods of the default model on this machine, for measuring what the simulator models.

Used by the served calibration (calibrate.py), the fidelity harness (fidelity.py), bench/routing.py and
bench/priority.py: start a pod as its own process, wait until it is Ready, put the real router in front of
pods, stream one completion of exact token ids and time it as a client does (arrival of every streamed
event), stop the pod without leaving a process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pod(
    tmp: Path,
    port: int,
    num_blocks: int,
    scheduler: dict | None = None,
    model: dict | None = None,
    server: dict | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """`model` / `server`: RuntimeConfig sections merged over the defaults (another model, keys); `env`:
    variables set for the pod's process on top of this one's (e.g. OMP_NUM_THREADS)."""
    import yaml

    cfg = {
        "model": {"model": MODEL, **(model or {})},
        "cache": {"num_blocks": num_blocks},
        "server": {"host": "127.0.0.1", "port": port, **(server or {})},
    }
    if scheduler:
        cfg["scheduler"] = scheduler
    path = tmp / f"pod-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "tokenfleet.runtime.cli", "serve", "--config", str(path)]
    with open(tmp / f"pod-{port}.log", "w") as log:
        # cwd: never the repo root, whose `operator/` folder would shadow the stdlib module.
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env={**os.environ, **env} if env else None
        )


def cpu_seconds(pid: int) -> float:
    """CPU time a process (all its threads) has used so far: user + system, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_pods(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_ready(session, url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    import aiohttp

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
    raise TimeoutError(f"pod {url} not ready after {timeout} s")


@contextlib.asynccontextmanager
async def real_router(
    urls: list[str],
    routing: str | dict = "round-robin",
    kv_events: bool = True,
    probe_interval: float = 0.5,
    model: str = MODEL,
    local_tokenizer: bool = True,
    backend: dict | None = None,
    api_keys: list[str] | None = None,
    port: int | None = None,
    peers: list[str] | None = None,
    handler_cancellation: bool = True,
):
    """The real router (in this process) in front of `urls`: its URL, once every pod is in rotation (and,
    with `kv_events`, its KV-event stream is followed). `routing`: a strategy name or a whole routing spec.
    `model`: the name the pods serve; without `local_tokenizer` the router has none of its own and learns it
    from the pods (then it also waits for that). `backend`: extra Backend fields (e.g. `internalKeyFile`);
    `api_keys`: the keys the router asks its clients for. `port` / `peers`: where it listens and the other
    replicas it shares its rate-limit spending with (active-active routers holding one quota).
    `handler_cancellation`: a client that hangs up cancels its request in the router at once, which closes
    the upstream request (the pod aborts it), as `tokenfleet route` runs.

    Endpoints start out of rotation until their first probe answers: requests sent before that would all
    go to the pods probed first, which no routing strategy would choose."""
    from aiohttp import web
    from tokenfleet.runtime.router.app import ROUTER, build_app
    from tokenfleet.runtime.router.config import RouterConfig
    from tokenfleet.runtime.router.main import load_tokenizer

    tokenizer = await asyncio.to_thread(load_tokenizer, model) if local_tokenizer else None
    spec = {"strategy": routing} if isinstance(routing, str) else dict(routing)
    # On a shared CPU machine a queued prefill can leave a stream silent for minutes: not a failure.
    spec["retries"] = {"firstByteTimeoutSeconds": 900, "idleTimeoutSeconds": 900}
    cfg = RouterConfig.model_validate(
        {
            "port": 0,
            "backends": [
                {"name": f"pod{i}", "model": model, "url": u, **(backend or {})} for i, u in enumerate(urls)
            ],
            "routing": spec,
            "discovery": {"kvEvents": kv_events, "probeIntervalSeconds": probe_interval},
            "apiKeys": api_keys or [],
            "peers": {"urls": peers or []},
        }
    )
    app = build_app(cfg, (lambda source: tokenizer) if local_tokenizer else None)
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    port = port or free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await app[ROUTER].tokenizers_loaded()
        fleet = app[ROUTER].fleet
        deadline = time.monotonic() + 120.0
        router = app[ROUTER]

        def tokenized() -> bool:
            return all(s["state"] == "ok" for s in router.tokenizer_states().values())

        while not (
            fleet.in_rotation(len(urls))
            and (not kv_events or all(fleet.kv_events_live().values()))
            and (local_tokenizer or tokenized())
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the router did not take every pod into rotation: {list(fleet.endpoints.by_id)}"
                )
            await asyncio.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@dataclass
class StreamTiming:
    """One streamed completion as its client saw it (seconds since the request was sent)."""

    status: int = 0
    token_times: list[float] = field(default_factory=list)  # arrival of each event carrying a token
    e2e: float | None = None
    cached_tokens: int = 0  # prompt tokens the pod served from its prefix cache (the usage event)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None


async def stream_completion(
    session,
    url: str,
    prompt: list[int],
    max_tokens: int,
    timing: StreamTiming,
    headers: dict[str, str] | None = None,
) -> None:
    """POST a streamed completion of exact token ids (`ignore_eos`, greedy) and time every event.
    `headers`: extra request headers (e.g. the router's priority-class header)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        timing.status = r.status
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            if b'"usage"' in line and b'"choices":[]' in line:
                details = json.loads(line[6:])["usage"].get("prompt_tokens_details") or {}
                timing.cached_tokens = details.get("cached_tokens") or 0
            elif b'"choices"' in line:
                timing.token_times.append(time.perf_counter() - t0)
    timing.e2e = time.perf_counter() - t0
