"""The router and one real `tokenfleet serve` process (the default model), started together.

1. Requests sent the moment both start are held by the router while the pod loads its model, and all are
   served once it is ready: none refused (the pod's 503s while loading mean "not ready", not "failing").
2. Priority has one meaning end to end: under KV-cache contention on the pod (a cache too small for every
   running request), the class the policy puts first (a lower number) finishes first; the pod preempts
   the other class to make room.
3. The pod announces the prefills it schedules on its KV-event stream (`scheduled`), before it stores them.
Slow: one model load on a loaded 2-core machine takes tens of seconds.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time

import aiohttp
import pytest
from tokenfleet.runtime.router.app import ROUTER, build_app
from tokenfleet.runtime.router.config import RouterConfig

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TIMEOUT = aiohttp.ClientTimeout(total=600)
NUM_BLOCKS = 12  # 16-token blocks: four 80-token requests need 20 at the end, so the pod must preempt


async def _metric(s: aiohttp.ClientSession, url: str, name: str) -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    m = re.search(rf"^tokenfleet:{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def _complete(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, headers=None):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with s.post(url + "/v1/completions", json=body, headers=headers or {}) as r:
        raw = await r.read()
        return r.status, raw, time.monotonic()


async def test_started_together_then_priority_under_contention(
    tmp_path, serve_app, free_ports, spawn_real_pod
):
    (port,) = free_ports(1)
    pod_url = f"http://127.0.0.1:{port}"
    proc = spawn_real_pod(tmp_path, port, NUM_BLOCKS, {})
    cfg = RouterConfig.model_validate(
        {
            "backends": [{"name": "pod", "model": MODEL, "url": pod_url}],
            "routing": {
                "queueTimeoutSeconds": 500,  # longer than a model load here
                "priorityClasses": [
                    {"name": "interactive", "priority": -10},
                    {"name": "batch", "priority": 10},
                ],
            },
            "discovery": {"probeIntervalSeconds": 0.2, "kvEvents": True},
        }
    )
    from tokenfleet.runtime.router.main import load_tokenizer

    app = build_app(cfg, load_tokenizer)
    try:
        async with serve_app(app) as url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
            router = app[ROUTER]
            # 1. A burst sent at once, while the pod process is still starting.
            burst = [_complete(s, url, f"Request number {i} says", 2) for i in range(6)]
            results = await asyncio.wait_for(asyncio.gather(*burst), 550)
            assert proc.poll() is None, (tmp_path / f"pod-{port}.log").read_text()[-2000:]
            assert [status for status, _, _ in results] == [200] * 6, [r[1][:200] for r in results]
            assert router.metrics.requests.labels(MODEL, "503")._value.get() == 0
            assert router.metrics.ejections.labels(pod_url)._value.get() == 0

            # 2. Contention: two requests of each class at once; the cache holds only part of their KV.
            await router.tokenizers_loaded()
            preempted_before = await _metric(s, pod_url, "num_preemptions_total")
            async with s.get(pod_url + "/v1/kv-events") as r:
                position = await r.json()
            jobs = []
            for i in range(2):
                for cls in ("batch", "interactive"):
                    prompt = f"Story {i} for the {cls} class. Once upon a time, in a land far away,"
                    jobs.append((cls, _complete(s, url, prompt, 64, {"x-priority-class": cls})))
            done = await asyncio.wait_for(asyncio.gather(*(job for _, job in jobs)), 500)
            assert [status for status, _, _ in done] == [200] * 4, [d[1][:200] for d in done]
            finished = {cls: sorted(t for (c, _), (_, _, t) in zip(jobs, done, strict=True) if c == cls)
                        for cls in ("interactive", "batch")}  # fmt: skip
            preempted = await _metric(s, pod_url, "num_preemptions_total") - preempted_before
            assert preempted >= 1, "no contention: the test would show nothing"
            # The first class finished first: both of its requests before either of the other class.
            assert finished["interactive"][-1] < finished["batch"][0], finished

            # 3. The pod announced what it scheduled, with hashes it later stored.
            params = {"since": str(position["seq"]), "epoch": position["epoch"]}
            async with s.get(pod_url + "/v1/kv-events", params=params) as r:
                events = (await r.json())["events"]
            scheduled = {h for e in events if e["type"] == "scheduled" for h in e["block_hashes"]}
            stored = {h for e in events if e["type"] == "stored" for h in e["block_hashes"]}
            assert scheduled and scheduled <= stored
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
