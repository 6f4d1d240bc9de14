"""What resumable streams cost the router per event: annotated and spliced vs passed through.

A loopback pod streams events as fast as it can (token ids in the annotations when the router asks, as a
real pod sends them); the router runs in this process with `retries.maxResumes` 2 (annotate, parse each
event block, strip the annotation) and 0 (the byte pass-through), measured in the same run, alternating.
Prints events per second through the router for both and their ratio.

    python bench/resume_overhead.py [--streams 8] [--events 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
from aiohttp import web
from tokenfleet.runtime.openai.resume import RESUME_HEADER, Progress, StreamStart
from tokenfleet.runtime.router.app import build_app
from tokenfleet.runtime.router.config import RouterConfig


class _Tokenizer:
    """The router tokenizes prompts for prefix routing; a word-per-token stand-in is enough here."""

    eos_token_ids = (0,)
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]


def _events(n: int, annotate: bool) -> list[bytes]:
    head = StreamStart("cmpl-x", 1, list(range(200)), True).encode() if annotate else b""
    out, chars = [], 0
    for i in range(n):
        text = f" w{i}"
        chars += len(text)
        event = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m"}
        event["choices"] = [{"index": 0, "text": text, "finish_reason": None}]
        ann = Progress([i], chars).encode() if annotate else b""
        out.append(head + ann + b"data: " + json.dumps(event).encode() + b"\n\n")
        head = b""
    return out


_EVENTS: dict[tuple[int, bool], list[bytes]] = {}


async def pod(request: web.Request) -> web.StreamResponse:
    """Writes prepared events: the pod's own cost is the same in both modes, what differs is the router's."""
    payload = await request.json()
    key = (payload["max_tokens"], RESUME_HEADER in request.headers)
    events = _EVENTS.get(key) or _EVENTS.setdefault(key, _events(*key))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for event in events:
        await resp.write(event)
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})


async def healthy(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def run(router_url: str, streams: int, events: int) -> float:
    body = {"model": "m", "prompt": "w1 w2 w3", "max_tokens": events, "stream": True}
    async with aiohttp.ClientSession() as s:

        async def one() -> None:
            async with s.post(router_url + "/v1/completions", json=body) as r:
                raw = await r.read()
                assert r.status == 200, raw[:300]
                assert raw.count(b"data: ") == events + 1 and b": tokenfleet" not in raw, raw[:300]

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(streams)))
        return streams * events / (time.perf_counter() - t0)


async def main(args: argparse.Namespace) -> None:
    pod_app = web.Application()
    pod_app.add_routes(
        [web.post("/v1/completions", pod), web.get("/v1/models", models), web.get("/health", healthy)]
    )
    pod_runner, pod_url = await serve(pod_app)
    routers = {}
    for max_resumes in (0, 2):
        cfg = RouterConfig.model_validate(
            {
                "backends": [{"name": "p", "model": "m", "url": pod_url}],
                "routing": {"retries": {"maxResumes": max_resumes}},
                "discovery": {"probeIntervalSeconds": 0.05},
            }
        )
        routers[max_resumes] = await serve(build_app(cfg, lambda source: _Tokenizer()))
    await asyncio.sleep(0.5)  # first probes
    rates: dict[int, list[float]] = {0: [], 2: []}
    for _ in range(args.rounds):
        for max_resumes, (_, url) in routers.items():
            rates[max_resumes].append(await run(url, args.streams, args.events))
    best = {k: max(v) for k, v in rates.items()}
    print(f"{args.streams} streams x {args.events} events, best of {args.rounds} rounds")
    print(f"pass-through (maxResumes 0): {best[0]:9.0f} events/s through the router")
    print(f"resumable    (maxResumes 2): {best[2]:9.0f} events/s through the router")
    print(f"ratio resumable / pass-through: {best[2] / best[0]:.2f}")
    for runner, _ in routers.values():
        await runner.cleanup()
    await pod_runner.cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--events", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(p.parse_args()))
