"""How many SSE events per second ONE router process proxies, and its CPU per streamed token.

Fake pods (each its own process, aiohttp on loopback) stream OpenAI chat/completions chunks as fast as they
can write them, with the resume annotations a real pod adds when the router asks (`x-tokenfleet-resume`):
the StreamStart line on the opening role delta, a Progress line (token ids, characters) on every token's
event, then `data: [DONE]`. The events are rendered once per stream length with the pod's own types
(ChatCompletionChunk, StreamStart, Progress), so a pod's cost is its writes, not JSON encoding.

The REAL router runs as a separate process (`tokenfleet route --config FILE`, static backends, one per pod,
no tokenizer: the approximate prefix index). K concurrent streaming clients (this process) drive it for a
fixed time; then the same clients go straight to the pods (same annotated bytes, no router): the harness's
own ceiling. CPU seconds of the router, the pods and the client come from /proc/<pid>/stat (utime+stime).

    python bench/router_throughput.py [--streams 32] [--tokens-per-stream 256] [--pods 2] [--seconds 10]
        [--interval-ms 0] [--max-resumes 2] [--profile router.prof]

With --interval-ms 0 the pods write as fast as they can and the router reads many events per socket read;
a real pod writes one event per decode step per stream, so with a pause (e.g. 20 ms) and many streams the
router reads about one event at a time: its per-read costs become per-event costs.

--profile runs the router under cProfile (slower: the figures of that run are not the router's speed) and
prints its top functions by own time, per event proxied.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

_CLK = os.sysconf("SC_CLK_TCK")


# --- the fake pod (a process of its own: `--pod-port PORT`) ------------------------------------------------


def _render_stream(tokens: int, annotate: bool, usage: bool) -> list[bytes]:
    """The events a pod sends for one chat stream of `tokens` one-token deltas, as runtime/server/chat.py
    writes them (annotation lines first in the event block)."""
    from tokenfleet.runtime.openai.protocol import (
        ChatChunkChoice,
        ChatCompletionChunk,
        DeltaMessage,
        Usage,
    )
    from tokenfleet.runtime.openai.resume import Progress, StreamStart
    from tokenfleet.runtime.server.sse import event

    rid, created, model = "chatcmpl-bench0000000000000000", 1_700_000_000, "m"
    prompt_ids = list(range(1000, 1200))

    def chunk(choices, u=None) -> bytes:
        return event(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=u))

    start = StreamStart(rid, created, prompt_ids, True).encode() if annotate else b""
    out = [start + chunk([ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])]
    chars = 0
    for i in range(tokens):
        text = f" w{i % 1000}"
        chars += len(text)
        progress = Progress([2000 + i % 1000], chars).encode() if annotate else b""
        finish = "length" if i == tokens - 1 else None
        delta = DeltaMessage(content=text)
        out.append(progress + chunk([ChatChunkChoice(index=0, delta=delta, finish_reason=finish)]))
    if usage:
        out.append(chunk([], Usage(prompt_tokens=len(prompt_ids), completion_tokens=tokens, total_tokens=0)))
    out.append(b"data: [DONE]\n\n")
    return out


def _run_pod(port: int, interval: float) -> None:
    from aiohttp import web

    cache: dict[tuple[int, bool, bool], list[bytes]] = {}
    running = 0

    async def generate(request: web.Request) -> web.StreamResponse:
        nonlocal running
        payload = await request.json()
        key = (
            int(payload["max_tokens"]),
            request.headers.get("x-tokenfleet-resume") is not None,
            bool((payload.get("stream_options") or {}).get("include_usage")),
        )
        events = cache.get(key) or cache.setdefault(key, _render_stream(*key))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        running += 1
        try:
            for ev in events:  # one write per event, as the real pod's respond() does
                await resp.write(ev)
                if interval:  # a decode step: the router then reads about one event at a time
                    await asyncio.sleep(interval)
            await resp.write_eof()
        except ConnectionResetError:  # a phase's deadline cut the client off mid-stream: expected, not news
            pass
        finally:
            running -= 1
        return resp

    async def load(request: web.Request) -> web.Response:
        return web.json_response({"num_running": running, "num_waiting": 0, "kv_cache_usage": 0.0})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.add_routes(
        [
            web.post("/v1/chat/completions", generate),
            web.get("/load", load),
            web.get("/ready", ok),
            web.get("/health", ok),
            web.get("/v1/models", models),
        ]
    )
    _use_uvloop()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _use_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


# --- process bookkeeping ----------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (its threads included), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} not ready in {timeout:.0f} s")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# --- the clients ------------------------------------------------------------------------------------------


@dataclass
class Phase:
    wall: float
    streams: int
    events: int
    tokens: int
    cpu: dict[str, float]


async def _drive(
    urls: list[str], args: argparse.Namespace, headers: dict[str, str], pids: dict[str, list[int]]
):
    """K workers, each running streams back to back until `--seconds` pass (or `--max-streams` in all);
    the phase ends when the last stream in flight has finished."""
    import aiohttp

    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "w1 w2 w3 w4 w5 w6 w7 w8"}],
            "max_tokens": args.tokens_per_stream,
            "stream": True,
        }
    ).encode()
    hdrs = {"Content-Type": "application/json", **headers}
    expect = args.tokens_per_stream + 1  # the role delta, then one event per token (then [DONE])
    totals = {"streams": 0, "events": 0}
    started = 0
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:

        async def one(url: str) -> None:
            async with s.post(url + "/v1/chat/completions", data=body, headers=hdrs) as r:
                if r.status != 200:
                    raise SystemExit(f"{url}: {r.status} {(await r.read())[:300]!r}")
                events, done, tail = 0, False, b""
                while chunk := await r.content.readany():
                    window = tail + chunk  # an event marker may straddle two reads
                    events += window.count(b"data: ") - tail.count(b"data: ")
                    done = done or b"data: [DONE]" in window
                    tail = window[-16:]
                if not done or events - 1 != expect:
                    raise SystemExit(f"{url}: a stream ended with {events} events, done={done}")
                totals["streams"] += 1
                totals["events"] += expect

        async def worker(i: int) -> None:
            nonlocal started
            n = 0
            while time.monotonic() < deadline and started < args.max_streams:
                started += 1
                await one(urls[(i + n) % len(urls)])
                n += 1

        before = {name: sum(_cpu_seconds(p) for p in ps) for name, ps in pids.items()}
        t0 = time.monotonic()
        deadline = t0 + args.seconds
        await asyncio.gather(*(worker(i) for i in range(args.streams)))
        wall = time.monotonic() - t0
        after = {name: sum(_cpu_seconds(p) for p in ps) for name, ps in pids.items()}
    return Phase(
        wall,
        totals["streams"],
        totals["events"],
        totals["streams"] * args.tokens_per_stream,
        {k: after[k] - before[k] for k in before},
    )


def _report(name: str, ph: Phase) -> None:
    k = ph.tokens / 1000
    print(
        f"{name}: {ph.streams} streams in {ph.wall:.1f} s: {ph.events / ph.wall:9.0f} events/s, "
        f"{ph.tokens / ph.wall:9.0f} tokens/s"
    )
    for who, sec in ph.cpu.items():
        print(
            f"    {who:<7} CPU {sec:7.2f} s = {sec / k * 1000:7.1f} ms per 1k tokens ({sec / ph.wall:4.2f} cores)"
        )


def _print_profile(path: str, events: int, top: int) -> None:
    stats = pstats.Stats(path)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append((tt, ct, nc, f"{Path(file).name}:{line}({fn})"))
    total = sum(r[0] for r in rows)
    rows.sort(reverse=True)
    print(f"router profile (cProfile, {total:.2f} s own time in all; per event over {events} events):")
    print(f"    {'own µs/ev':>9} {'cum µs/ev':>9} {'calls/ev':>8}  function")
    for tt, ct, nc, name in rows[:top]:
        print(f"    {tt / events * 1e6:9.2f} {ct / events * 1e6:9.2f} {nc / events:8.3f}  {name}")


def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="router-throughput-"))
    pod_ports = [_free_port() for _ in range(args.pods)]
    pods = [
        subprocess.Popen(
            [sys.executable, __file__, "--pod-port", str(p), "--interval-ms", str(args.interval_ms)],
            cwd=work,
            stdin=subprocess.DEVNULL,
        )
        for p in pod_ports
    ]
    router = None
    try:
        pod_urls = [f"http://127.0.0.1:{p}" for p in pod_ports]
        for url, proc in zip(pod_urls, pods, strict=True):
            _wait_http(url + "/health", proc)
        port = _free_port()
        cfg = {
            "host": "127.0.0.1",
            "port": port,
            "backends": [
                {"name": f"p{i}", "model": "m", "url": u, "tokenizer": "/nonexistent"}
                for i, u in enumerate(pod_urls)
            ],
            "routing": {
                "maxInFlightPerEndpoint": max(32, args.streams),
                "retries": {"maxResumes": args.max_resumes},
            },
        }
        (work / "router.json").write_text(json.dumps(cfg))
        cmd = ["-m", "tokenfleet.runtime.cli", "route", "--config", str(work / "router.json")]
        if args.profile:
            cmd = ["-m", "cProfile", "-o", str(Path(args.profile).resolve()), *cmd]
        router = subprocess.Popen([sys.executable, *cmd, "--log-level", "WARNING"], cwd=work)
        router_url = f"http://127.0.0.1:{port}"
        _wait_http(router_url + "/ready", router)

        _use_uvloop()
        me = os.getpid()
        pod_pids = [p.pid for p in pods]
        print(
            f"{args.streams} concurrent streams x {args.tokens_per_stream} tokens, {args.pods} pod(s), "
            f"{args.seconds:.0f} s per phase, {args.interval_ms} ms between a stream's events, "
            f"router maxResumes {args.max_resumes}"
            f"{' (under cProfile)' if args.profile else ''}; cpus: {os.cpu_count()}"
        )
        warm = argparse.Namespace(**{**vars(args), "seconds": 0.5, "max_streams": args.streams})
        warmed = asyncio.run(_drive([router_url], warm, {}, {"router": [router.pid]}))
        via = asyncio.run(
            _drive([router_url], args, {}, {"router": [router.pid], "pods": pod_pids, "client": [me]})
        )
        direct = asyncio.run(
            _drive(
                pod_urls,
                args,
                {"x-tokenfleet-resume": "1"} if args.max_resumes > 0 else {},
                {"pods": pod_pids, "client": [me]},
            )
        )
        _report("through the router", via)
        _report(f"direct to the {args.pods} pod(s) (no router)", direct)
        print(
            f"router: {via.cpu['router'] / via.events * 1e6:.1f} µs CPU per event; "
            f"through-router rate / direct rate: {via.events / via.wall / (direct.events / direct.wall):.2f}"
        )
        _stop(router, signal.SIGINT)  # a clean exit: cProfile writes its file
        if args.profile:
            _print_profile(args.profile, via.events + warmed.events, args.top)
    finally:
        if router is not None:
            _stop(router, signal.SIGINT)
        for p in pods:
            _stop(p)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32, help="concurrent streaming clients")
    p.add_argument("--tokens-per-stream", type=int, default=256)
    p.add_argument("--pods", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0, help="per phase; streams in flight then finish")
    p.add_argument("--max-streams", type=int, default=100_000, help="bound on streams per phase")
    p.add_argument(
        "--max-resumes", type=int, default=2, help="the router's retries.maxResumes (0: bytes pass)"
    )
    p.add_argument("--profile", help="run the router under cProfile, write the stats here and print the top")
    p.add_argument("--top", type=int, default=20)
    p.add_argument(
        "--interval-ms", type=float, default=0.0, help="pod's pause between a stream's events (0: none)"
    )
    p.add_argument("--pod-port", type=int, help=argparse.SUPPRESS)  # internal: run one fake pod
    a = p.parse_args()
    if a.pod_port is not None:
        _run_pod(a.pod_port, a.interval_ms / 1000)
    else:
        main(a)
