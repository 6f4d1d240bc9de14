"""The router in front of a prefill pod and a decode pod (real `tokenfleet serve` processes, default model).

A model served by a `role: prefill` and a `role: decode` backend is disaggregated: the prompt is computed on
the prefill pod, its KV moves to the decode pod, which generates. Checked from the pods' own metrics: the
completion (JSON and stream, completions and chat) is the one a plain pod gives; the KV really moved;
a client cannot smuggle transfer parameters; with the prefill pod gone the decode pod serves alone.
Slow: two model loads.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import time

import aiohttp
import pytest
from tokenfleet.runtime.router.app import ROUTER, build_app
from tokenfleet.runtime.router.config import RouterConfig

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TIMEOUT = aiohttp.ClientTimeout(total=300)
SYSTEM = "You are a museum guide. " + " ".join(
    f"Fact {i}: the east wing holds the maps of year {1700 + i}." for i in range(10)
)


@pytest.fixture(scope="module")
def pods(tmp_path_factory, real_pods):
    with real_pods(tmp_path_factory.mktemp("disagg-router"), 2, num_blocks=128, timeout=400.0) as running:
        yield running


@pytest.fixture(scope="module")
def real_tokenizer():
    from tokenfleet.runtime.router.main import load_tokenizer

    return load_tokenizer(MODEL)


def _router_app(prefill_url: str, decode_url: str, real_tokenizer):
    cfg = RouterConfig.model_validate(
        {
            "backends": [
                {"name": "prefill", "model": MODEL, "url": prefill_url, "role": "prefill"},
                {"name": "decode", "model": MODEL, "url": decode_url, "role": "decode"},
            ],
            "discovery": {"probeIntervalSeconds": 0.2, "failureThreshold": 1},
        }
    )
    return build_app(cfg, lambda source: real_tokenizer)


async def _metric(s, url: str, name: str, labels: str = "") -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.e+-]+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def _chat(question: str, **extra) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, **extra}


async def _sse(r: aiohttp.ClientResponse) -> dict:
    """The stream as a client sees it: its text, ids, finish reasons in order, [DONE] count, usage."""
    seen = {"text": [], "ids": set(), "finishes": [], "done": 0, "usage": None}
    async for line in r.content:
        if line.strip() == b"data: [DONE]":
            seen["done"] += 1
        elif line.startswith(b"data: "):
            event = json.loads(line[6:])
            seen["ids"].add(event["id"])
            seen["usage"] = event.get("usage") or seen["usage"]
            for c in event["choices"]:
                seen["text"].append(c.get("delta", {}).get("content") or c.get("text") or "")
                seen["finishes"].append(c.get("finish_reason"))
    seen["text"] = "".join(seen["text"])
    return seen


async def _sse_text(r: aiohttp.ClientResponse) -> str:
    return (await _sse(r))["text"]


async def test_disaggregated_completions_equal_a_plain_pod_json_and_stream(pods, real_tokenizer, serve_app):
    (p_url, _), (d_url, _) = pods
    app = _router_app(p_url, d_url, real_tokenizer)
    async with serve_app(app) as router_url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
        await app[ROUTER].tokenizers_loaded()
        sent0 = await _metric(s, p_url, "tokenfleet:kv_transfer_blocks_total", 'direction="sent"')
        assert sent0 == 0
        for question in ("Where are the maps of 1705?", "What is in the east wing?"):
            async with s.post(d_url + "/v1/chat/completions", json=_chat(question + " ")) as r:
                plain = (await r.json())["choices"][0]["message"]["content"]
            async with s.post(router_url + "/v1/chat/completions", json=_chat(question + " ")) as r:
                assert r.status == 200 and r.headers["x-tokenfleet-endpoint"] == d_url
                assert (await r.json())["choices"][0]["message"]["content"] == plain
            async with s.post(
                router_url + "/v1/chat/completions", json=_chat(question + "  ", stream=True)
            ) as r:
                streamed = await _sse_text(r)
            async with s.post(d_url + "/v1/chat/completions", json=_chat(question + "  ")) as r:
                assert streamed == (await r.json())["choices"][0]["message"]["content"]
        prompt = {"model": MODEL, "prompt": SYSTEM + " Summary:", "max_tokens": 8, "temperature": 0}
        async with s.post(router_url + "/v1/completions", json=prompt) as r:
            via_router = (await r.json())["choices"][0]["text"]
        async with s.post(p_url + "/v1/completions", json=prompt) as r:
            assert via_router == (await r.json())["choices"][0]["text"]
        # A stream: the first token from the prefill pod, the rest from the decode pod, as one stream.
        body = {**prompt, "prompt": "The harbor master keeps a log of every ship that enters. " * 6, "max_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        received0 = await _metric(s, d_url, "tokenfleet:kv_transfer_blocks_total", 'direction="received"')
        async with s.post(router_url + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["x-tokenfleet-endpoint"] == p_url
            seen = await _sse(r)
        async with s.post(d_url + "/v1/completions", json={**body, "stream": False}) as r:
            assert seen["text"] == (await r.json())["choices"][0]["text"]
        assert len(seen["ids"]) == 1 and seen["done"] == 1
        assert [f for f in seen["finishes"] if f] == ["length"] and seen["finishes"][-1] == "length"
        assert seen["usage"]["completion_tokens"] == 12
        assert (
            await _metric(s, d_url, "tokenfleet:kv_transfer_blocks_total", 'direction="received"') > received0
        )
        sent = await _metric(s, p_url, "tokenfleet:kv_transfer_blocks_total", 'direction="sent"')
        received = await _metric(s, d_url, "tokenfleet:kv_transfer_blocks_total", 'direction="received"')
        # The decode pod already held the shared system prompt (the plain requests): only the rest moved.
        assert sent - sent0 > 0 and received == sent
        assert await _metric(s, d_url, "tokenfleet:kv_transfer_fallbacks_total") == 0
        # A client cannot name a pod to fetch from: the member is dropped before forwarding.
        forged = _chat("Hi", kv_transfer_params={"do_remote_prefill": True, "remote_url": "http://10.1.2.3:1",
                                                 "hold_id": "x", "block_hashes": []})  # fmt: skip
        async with s.post(router_url + "/v1/chat/completions", json=forged) as r:
            assert r.status == 200
        assert await _metric(s, d_url, "tokenfleet:kv_transfer_fallbacks_total") == 0


async def _used(s, url: str) -> float:
    async with s.get(url + "/load") as r:
        return (await r.json())["kv_cache_usage"]


async def test_clients_leaving_in_either_phase_leave_no_used_kv_blocks_on_either_pod(
    pods, real_tokenizer, serve_app
):
    (p_url, _), (d_url, _) = pods
    app = _router_app(p_url, d_url, real_tokenizer)
    rng = random.Random(3)
    async with serve_app(app) as router_url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
        await app[ROUTER].tokenizers_loaded()

        async def one(i: int) -> None:
            body = _chat(f"Question {i}: what is kept in room {i}?", max_tokens=32, stream=True)
            try:
                async with asyncio.timeout(rng.uniform(0.05, 3.0)):  # then the client hangs up
                    async with s.post(router_url + "/v1/chat/completions", json=body) as r:
                        await r.read()
            except TimeoutError:
                pass

        for batch in range(3):
            await asyncio.gather(*(one(4 * batch + k) for k in range(4)))
        # Aborts free at once and an unfetched hold is released by the router: well before any expiry.
        deadline = time.monotonic() + 45
        while (used := [await _used(s, p_url), await _used(s, d_url)]) != [0.0, 0.0]:
            assert time.monotonic() < deadline, used
            await asyncio.sleep(0.2)


async def test_one_service_over_both_roles_is_run_disaggregated_by_the_pods_labels(
    pods, real_tokenizer, serve_app
):
    """One backend of role `both` (a Service selecting both roles' pods): the router learns each endpoint's
    role from its label, as the EndpointSlice watch reports it, and runs the model disaggregated."""
    (p_url, _), (d_url, _) = pods
    cfg = RouterConfig.model_validate(
        {
            "backends": [{"name": "chat", "model": MODEL, "url": p_url}],
            "discovery": {"probeIntervalSeconds": 0.2, "failureThreshold": 1},
        }
    )
    app = build_app(cfg, lambda source: real_tokenizer)
    async with serve_app(app) as router_url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
        router = app[ROUTER]
        await router.tokenizers_loaded()
        # What the watch publishes for the Service: each ready address with its pod's role label.
        router.fleet.sync_backend(cfg.backends[0], {p_url: "prefill", d_url: "decode"})
        roles = {e.url: e.role for e in router.fleet.endpoints.of_backends(["chat"])}
        assert roles == {p_url: "prefill", d_url: "decode"}
        deadline = time.monotonic() + 30
        while not all(router.fleet.available(e) for e in router.fleet.endpoints.of_backends(["chat"])):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        received0 = await _metric(s, d_url, "tokenfleet:kv_transfer_blocks_total", 'direction="received"')
        prompt = {"model": MODEL, "prompt": "A lighthouse keeper counts the ships at night. " * 5,
                  "max_tokens": 8, "temperature": 0}  # fmt: skip
        async with s.post(router_url + "/v1/completions", json=prompt) as r:
            assert r.status == 200 and r.headers["x-tokenfleet-endpoint"] == d_url  # decode answers
            via_router = (await r.json())["choices"][0]["text"]
        received = await _metric(s, d_url, "tokenfleet:kv_transfer_blocks_total", 'direction="received"')
        assert received > received0  # the prompt's KV came from the prefill pod
        async with s.post(p_url + "/v1/completions", json=prompt) as r:
            assert via_router == (await r.json())["choices"][0]["text"]
        # Without role labels the same Service is an ordinary backend: whole requests, no transfer.
        router.fleet.sync_backend(cfg.backends[0], [p_url, d_url])
        assert {e.role for e in router.fleet.endpoints.of_backends(["chat"])} == {"both"}
        async with s.post(router_url + "/v1/completions", json={**prompt, "prompt": "Tides. " * 20}) as r:
            assert r.status == 200
        assert (
            await _metric(s, d_url, "tokenfleet:kv_transfer_blocks_total", 'direction="received"') == received
        )


async def test_with_the_prefill_pod_gone_the_decode_pod_serves_alone(pods, real_tokenizer, serve_app):
    """Last in this module: it kills the prefill pod."""
    (p_url, p_proc), (d_url, _) = pods
    p_proc.send_signal(signal.SIGKILL)
    p_proc.wait(timeout=30)
    app = _router_app(p_url, d_url, real_tokenizer)
    async with serve_app(app) as router_url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
        await app[ROUTER].tokenizers_loaded()
        async with s.post(router_url + "/v1/chat/completions", json=_chat("Which wing holds maps?")) as r:
            assert r.status == 200
            via_router = (await r.json())["choices"][0]["message"]["content"]
        async with s.post(d_url + "/v1/chat/completions", json=_chat("Which wing holds maps?")) as r:
            assert via_router == (await r.json())["choices"][0]["message"]["content"]
