"""Cold start of `tokenfleet serve`: process start -> first token, part by part.

Each run starts the real CLI (`python -m tokenfleet.runtime.cli serve`, what the `tokenfleet` console
script runs) as a fresh process on a free loopback port, polls /ready, sends a streaming chat request the
moment it answers 200 and times the first content chunk. The server's own `startup: {...}` log line
(runtime/startup_timing.py) gives the parts inside the process; first token is measured from here.
Prints the median of each part over --runs, with the load average (this machine's speed drifts).

With --weight-cache, the same run also measures a second pod of the model on the same node: a server with
`--weight-cache-dir` (runtime/model/weight_cache.py) whose entry a first server wrote (that first start, the
cache miss, is reported too), each run beside one without the cache, interleaved so drift hits both. The
server's peak resident memory and, at its first token, its anonymous and file-mapped parts are printed too.

    python bench/cold_start.py --runs 3 [--model smollm2-135m-instruct] [--env KEY=VALUE ...] [--weight-cache]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tokenfleet.runtime.startup_timing import parse_line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(port: int, path: str) -> int | None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", path)
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError:
        return None


def first_token_s(port: int, model: str) -> float:
    """Seconds from sending a streaming chat request to its first content chunk."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        }
    )
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"first request: HTTP {resp.status}: {resp.read()[:300]!r}")
    try:
        while True:
            line = resp.readline()
            if not line:
                raise RuntimeError("stream ended without a token")
            if line.startswith(b"data: {"):
                delta = json.loads(line[6:])["choices"][0].get("delta", {})
                if delta.get("content"):
                    return time.monotonic() - start
    finally:
        conn.close()


def memory_mib(pid: int) -> dict[str, float]:
    """The server's peak resident memory so far and, at its first token, how much of what is resident is
    its own (anonymous) and how much is mapped files (pages of the page cache, shared with every process
    that maps the same file): MiB, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) / 1024
    return {
        "memory: peak resident (MiB)": fields.get("VmHWM", 0.0),
        "memory: anonymous at first token (MiB)": fields.get("RssAnon", 0.0),
        "memory: mapped files at first token (MiB)": fields.get("RssFile", 0.0),
    }


def _entry_written(cache: Path) -> bool:
    return any((cache / "weights").glob("*/entry.json"))


def one_run(
    model: str,
    env: dict[str, str],
    timeout: float,
    cache: Path | None = None,
    keep_until_stored: bool = False,
) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenfleet.runtime.cli", "serve", "--model", model, "--port", str(port)]
    if cache is not None:
        cmd += ["--weight-cache-dir", str(cache)]
    lines: list[str] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
        cwd="/tmp",  # never the repo root: import the installed package, as a deployment does
    )
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        listening = ready = None
        while ready is None:
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError("server exited or timed out before ready:\n" + "".join(lines[-30:]))
            status = _status(port, "/ready")
            now = time.monotonic() - t0
            if status is not None and listening is None:
                listening = now
            if status == 200:
                ready = now
            else:
                time.sleep(0.005)
        ttft = first_token_s(port, model)
        first_token = time.monotonic() - t0
        memory = memory_mib(proc.pid)
        # The entry is written in the background after the load: the first server lives until it is there.
        while keep_until_stored and cache is not None and not _entry_written(cache):
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError("no weight cache entry was written:\n" + "".join(lines[-30:]))
            time.sleep(0.05)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    record = next((r for r in map(parse_line, lines) if r is not None), None)
    if record is None:
        raise RuntimeError("no startup line in the server's log:\n" + "".join(lines[-30:]))
    parts = {f"  {k}": v for k, v in record["phases"].items()}
    return {
        **parts,
        "server: process start -> ready (log)": record["total_s"],
        "bench: spawn -> /ready answers": listening,
        "bench: spawn -> /ready 200": ready,
        "bench: first request -> first token": ttft,
        "bench: spawn -> first token": first_token,
        **memory,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server process")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument(
        "--weight-cache",
        action="store_true",
        help="also time a start whose converted weights a previous start cached (and that first start)",
    )
    args = p.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    load_before = os.getloadavg()
    columns: dict[str, list[dict[str, float]]] = {"no cache": []}
    with tempfile.TemporaryDirectory(prefix="tokenfleet-weight-cache-") as tmp:
        cache = Path(tmp)
        if args.weight_cache:
            columns["cache miss (first pod)"] = [one_run(args.model, env, args.timeout, cache, True)]
            columns["cache hit (second pod)"] = []
        for i in range(args.runs):
            runs = [("no cache", None)] + ([("cache hit (second pod)", cache)] if args.weight_cache else [])
            for name, where in runs:
                run = one_run(args.model, env, args.timeout, where)
                columns[name].append(run)
                print(f"run {i + 1} {name}: spawn -> first token {run['bench: spawn -> first token']:.2f} s")
    load_after = os.getloadavg()
    keys = list(dict.fromkeys(k for runs in columns.values() for run in runs for k in run))
    print(f"\ncold start of `tokenfleet serve --model {args.model}`, median of {args.runs} run(s), seconds")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs)")
    width = max(map(len, keys))
    print(f"{'':<{width}}  " + "  ".join(f"{name:>22}" for name in columns))
    for k in keys:
        cells = []
        for runs in columns.values():
            values = [run.get(k, 0.0) for run in runs]
            cells.append(f"{statistics.median(values):22.3f}")
        print(f"{k:<{width}}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
