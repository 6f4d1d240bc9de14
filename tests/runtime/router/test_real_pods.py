"""The router in front of three real `tokenfleet serve` processes with the default model, on loopback.

Checked from the pods' own metrics, not the router's: a shared-prefix workload lands on the pod holding the
prefix (its prefix-cache hit counter moves, the others' do not); a pod killed mid-run fails only the stream
it was serving (with an error event), later requests succeed elsewhere and nothing hangs; a rate limit
answers 429. Slow: three model loads on a loaded 2-core machine take a minute or more.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import aiohttp
import pytest
from tokenfleet.runtime.router.app import ROUTER, build_app
from tokenfleet.runtime.router.config import RouterConfig

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TIMEOUT = aiohttp.ClientTimeout(total=300)
# ~120-token system prompts: several full blocks each, distinct from the first token.
SYSTEMS = [
    f"You are assistant number {k}. "
    + " ".join(f"Rule {k}.{i}: answer briefly and politely." for i in range(14))
    for k in range(3)
]


@pytest.fixture(scope="module")
def pods(tmp_path_factory, real_pods):
    with real_pods(tmp_path_factory.mktemp("pods"), 3, timeout=400.0) as running:
        yield running


@pytest.fixture(scope="module")
def real_tokenizer():
    from tokenfleet.runtime.router.main import load_tokenizer

    return load_tokenizer(MODEL)


def _router_app(urls, real_tokenizer, **routing):

    cfg = RouterConfig.model_validate(
        {
            "backends": [{"name": f"pod{i}", "model": MODEL, "url": u} for i, u in enumerate(urls)],
            "routing": routing,
            "discovery": {"probeIntervalSeconds": 0.2, "failureThreshold": 1},
        }
    )
    return build_app(cfg, lambda source: real_tokenizer)


async def _prefix_hits(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    m = re.search(r"^tokenfleet:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def _chat(s: aiohttp.ClientSession, url: str, system: str, user: str, **kw):
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
        "temperature": 0,
        **kw,
    }
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        raw = await r.read()
        return r.status, r.headers.get("x-tokenfleet-endpoint"), raw


async def test_shared_prefixes_land_on_the_pod_holding_them(pods, real_tokenizer, serve_app):
    urls = [u for u, _ in pods]
    before = {u: await _prefix_hits(u) for u in urls}
    app = _router_app(urls, real_tokenizer, strategy="prefix-affinity")
    async with serve_app(app) as router_url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
        await app[ROUTER].tokenizers_loaded()
        home = {}
        for k, system in enumerate(SYSTEMS):
            status, ep, raw = await _chat(s, router_url, system, "Hello!")
            assert status == 200, raw
            home[k] = ep
            await asyncio.sleep(0.5)  # let the pod's KV events (or the router's own record) arrive
        hits_after_first = {u: await _prefix_hits(u) for u in urls}
        # The exact index follows every pod's KV-event stream and holds what each pod cached.
        fleet = app[ROUTER].fleet
        assert all(fleet.kv_events_live().values())
        assert all(fleet.exact.num_blocks(ep) > 0 for ep in home.values())
        for turn in range(2):
            for k, system in enumerate(SYSTEMS):
                status, ep, raw = await _chat(s, router_url, system, f"Question {turn}?")
                assert (status, ep) == (200, home[k]), raw
    after = {u: await _prefix_hits(u) for u in urls}
    prompt_blocks = len(real_tokenizer.encode(SYSTEMS[0], add_special_tokens=False)) // 16
    for u in urls:
        gained = after[u] - hits_after_first[u]
        n_homed = sum(1 for ep in home.values() if ep == u)
        # Each follow-up reused at least its system prompt's full blocks, on the pod that held them.
        assert gained >= n_homed * 2 * prompt_blocks * 16, (u, before[u], hits_after_first[u], after[u])


async def test_rate_limit_answers_429(pods, real_tokenizer, serve_app):
    urls = [u for u, _ in pods]
    app = _router_app(urls, real_tokenizer, rateLimits={"requestsPerMinute": 1})
    async with serve_app(app) as router_url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
        assert (await _chat(s, router_url, SYSTEMS[0], "hi"))[0] == 200
        status, _, raw = await _chat(s, router_url, SYSTEMS[0], "hi")
        assert status == 429 and json.loads(raw)["error"]["code"] == "rate_limit_exceeded"


async def test_a_pod_killed_mid_run(pods, real_tokenizer, serve_app):
    """Last in this module: it kills a pod."""
    urls = [u for u, _ in pods]
    procs = {u: p for u, p in pods}
    # Resuming off: the stream on the killed pod ends with the error event (test_resume_real_pods.py
    # checks that, by default, it is continued on another pod instead).
    app = _router_app(urls, real_tokenizer, strategy="round-robin", retries={"maxResumes": 0})
    async with serve_app(app) as router_url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
        body = {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 48,
            "stream": True,
            "ignore_eos": True,
        }

        async def stream(started: asyncio.Event, record: dict):
            async with s.post(router_url + "/v1/completions", json=body) as r:
                record["endpoint"] = r.headers["x-tokenfleet-endpoint"]
                chunks = []
                async for chunk in r.content.iter_any():
                    chunks.append(chunk)
                    started.set()
                record["raw"] = b"".join(chunks)

        records = [{} for _ in urls]
        events = [asyncio.Event() for _ in urls]
        tasks = [asyncio.create_task(stream(e, r)) for e, r in zip(events, records, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        victim = records[0]["endpoint"]
        os.kill(procs[victim].pid, signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), 300)  # no client hangs

        for rec in records:
            tail = rec["raw"].rstrip().split(b"\n\n")
            if rec["endpoint"] == victim:
                err = json.loads(tail[-2].removeprefix(b"data: "))
                assert err["error"]["code"] == "stream_interrupted"
            assert tail[-1] == b"data: [DONE]"

        # Requests not yet started go elsewhere and succeed.
        for i in range(4):
            status, ep, raw = await asyncio.wait_for(_chat(s, router_url, SYSTEMS[i % 3], "again"), 120)
            assert status == 200 and ep != victim, raw
