"""Resumed streams, end to end: the router in front of real `tokenfleet serve` processes (default model).

- A pod SIGKILLed while several streams run on it: no client sees an error; every stream (greedy and
  seeded sampling at temperature 1, completions and chat) has exactly the text, usage and single `[DONE]`
  of the same request answered by an unbroken run, under one response id.
- A pod given SIGTERM with a short drain time while its long streams run: at the drain deadline it hands
  them back and they finish on the other pod, none cut.

Three pods load at once (one is killed, one drained); slow on a shared 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import pytest
from tokenfleet.runtime.router.app import ROUTER, build_app
from tokenfleet.runtime.router.config import RouterConfig

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TIMEOUT = aiohttp.ClientTimeout(total=600)
DRAIN_SECONDS = 1.0


@pytest.fixture(scope="module")
def pods(tmp_path_factory, real_pods):
    with real_pods(tmp_path_factory.mktemp("pods"), 3, drain_seconds=DRAIN_SECONDS) as running:
        yield running


@pytest.fixture(scope="module")
def real_tokenizer():
    from tokenfleet.runtime.router.main import load_tokenizer

    return load_tokenizer(MODEL)


def _router_app(urls, real_tokenizer):
    cfg = RouterConfig.model_validate(
        {
            "backends": [{"name": f"pod{i}", "model": MODEL, "url": u} for i, u in enumerate(urls)],
            "routing": {"strategy": "round-robin", "retries": {"maxResumes": 2}},
            "discovery": {"probeIntervalSeconds": 0.2, "failureThreshold": 1},
        }
    )
    return build_app(cfg, lambda source: real_tokenizer)


def _requests() -> list[tuple[str, dict]]:
    """Greedy and seeded (temperature 1) requests, completions and chat: (path, body without `stream`)."""
    chat = "/v1/chat/completions"
    out = []
    for k, topic in enumerate(["a lighthouse", "a lost key", "the first snow"]):
        out.append(
            (
                "/v1/completions",
                {"prompt": f"A short story about {topic}:", "max_tokens": 40, "ignore_eos": True},
            )
        )
        messages = [{"role": "user", "content": f"Write a few sentences about {topic}."}]
        out.append((chat, {"messages": messages, "max_tokens": 40, "temperature": 1.0, "seed": 100 + k}))
    out[0][1]["temperature"] = 0
    out[2][1].update(temperature=1.0, seed=7)  # seeded completions too
    out[4][1]["temperature"] = 0
    for _, body in out:
        body.setdefault("temperature", 0)
        body["model"] = MODEL
    return out


def _total(counter) -> float:
    """A counter's value summed over its labels."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def _parse_stream(raw: bytes, chat: bool) -> dict:
    ids, text, usage, errors, done = set(), [], None, [], 0
    for block in raw.decode().split("\n\n"):
        block = block.strip()
        if block == "data: [DONE]":
            done += 1
        elif block.startswith("data: "):
            event = json.loads(block[len("data: ") :])
            if "error" in event:
                errors.append(event)
                continue
            ids.add(event["id"])
            usage = event.get("usage") or usage
            for c in event["choices"]:
                text.append((c["delta"].get("content") or "") if chat else c["text"])
        elif block:
            errors.append(block)  # anything else (e.g. a leaked annotation) is not for the client
    return {"ids": ids, "text": "".join(text), "usage": usage, "errors": errors, "done": done}


async def _reference(s: aiohttp.ClientSession, url: str, path: str, body: dict) -> dict:
    """The same request answered whole by one pod, directly (no router, nothing broken)."""
    async with s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    choice = data["choices"][0]
    text = choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    return {"text": text, "completion_tokens": data["usage"]["completion_tokens"]}


async def _stream(s, router_url, path, body, progressed: asyncio.Event, record: dict) -> None:
    """Stream through the router; `progressed` is set once a few events have arrived."""
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with s.post(router_url + path, json=payload) as r:
        assert r.status == 200, await r.text()
        record["endpoint"] = r.headers["x-tokenfleet-endpoint"]
        chunks = []
        async for chunk in r.content.iter_any():
            chunks.append(chunk)
            if b"".join(chunks).count(b"data: ") >= 4:
                progressed.set()
        record["raw"] = b"".join(chunks)
    progressed.set()


def _check_unbroken(records: list[dict], refs: list[dict], reqs: list[tuple[str, dict]]) -> None:
    for rec, ref, (path, _) in zip(records, refs, reqs, strict=True):
        got = _parse_stream(rec["raw"], path.endswith("chat/completions"))
        assert got["errors"] == [], got["errors"]
        assert got["done"] == 1 and rec["raw"].rstrip().endswith(b"data: [DONE]")
        assert len(got["ids"]) == 1
        assert got["text"] == ref["text"], (rec["endpoint"], got["text"], ref["text"])
        assert got["usage"]["completion_tokens"] == ref["completion_tokens"]


async def test_a_pod_killed_mid_stream_is_invisible_to_clients(pods, real_tokenizer, serve_app, in_rotation):
    (url_a, proc_a), (url_b, _), (url_ref, _) = pods
    reqs = _requests()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        refs = await asyncio.gather(*(_reference(s, url_ref, p, b) for p, b in reqs))
        app = _router_app([url_a, url_b], real_tokenizer)
        async with serve_app(app) as router_url:
            await in_rotation(app, 2)
            records = [{} for _ in reqs]
            progressed = [asyncio.Event() for _ in reqs]
            tasks = [
                asyncio.create_task(_stream(s, router_url, p, b, e, r))
                for (p, b), e, r in zip(reqs, progressed, records, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in progressed)), 300)
            on_victim = sum(1 for r in records if r.get("endpoint") == url_a)
            os.kill(proc_a.pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 400)  # no client hangs
            metrics = app[ROUTER].metrics
    assert on_victim >= 2, "round-robin put several of the streams on the killed pod"
    _check_unbroken(records, refs, reqs)
    # The streams running on the killed pod were continued on the other one, each prefilling its prompt
    # and generated tokens there (the other pod had none of them cached).
    assert _total(metrics.resumes) >= 1 and _total(metrics.resume_failures) == 0
    assert _total(metrics.resume_recomputed_tokens) > 0


async def test_a_draining_pod_hands_its_streams_back(pods, real_tokenizer, serve_app, in_rotation):
    (_, _), (url_b, _), (url_c, proc_c) = pods
    # Long enough to outlive the drain deadline: two greedy completions, two seeded chats.
    reqs = [(p, {**b, "max_tokens": 64}) for p, b in _requests()[:4]]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        refs = await asyncio.gather(*(_reference(s, url_b, p, b) for p, b in reqs))
        app = _router_app([url_b, url_c], real_tokenizer)
        async with serve_app(app) as router_url:
            await in_rotation(app, 2)
            records = [{} for _ in reqs]
            progressed = [asyncio.Event() for _ in reqs]
            tasks = [
                asyncio.create_task(_stream(s, router_url, p, b, e, r))
                for (p, b), e, r in zip(reqs, progressed, records, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in progressed)), 300)
            on_drained = sum(1 for r in records if r.get("endpoint") == url_c)
            proc_c.send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*tasks), 400)
            metrics = app[ROUTER].metrics
    assert on_drained >= 1
    _check_unbroken(records, refs, reqs)
    assert _total(metrics.resumes) >= 1 and _total(metrics.resume_failures) == 0  # handed back, continued
    assert proc_c.wait(timeout=60) == 0  # it drained and exited cleanly
