"""A decode pod that dies mid-stream, disaggregated: the router in front of one prefill pod and two decode
pods (real `tokenfleet serve` processes, default model). One decode pod is SIGKILLed while streams run on
it; each of those streams already holds the prefill pod's first token and some of the decode pod's, and
is continued on the other decode pod; then the last decode pod is killed too, and the prefill pod serves
alone. No client sees an error: every stream has the greedy text and usage of the same request answered
by one plain pod, one response id and one `[DONE]`. Slow: three model loads.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal

import aiohttp
import pytest
from tokenfleet.runtime.router.app import ROUTER, build_app
from tokenfleet.runtime.router.config import RouterConfig

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TIMEOUT = aiohttp.ClientTimeout(total=600)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def pods(tmp_path_factory, real_pods):
    with real_pods(tmp_path_factory.mktemp("disagg-resume"), 3, num_blocks=256, timeout=400.0) as running:
        yield running


def _router_app(prefill_url: str, decode_urls: list[str]):
    from tokenfleet.runtime.router.main import load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    backends = [{"name": "prefill", "model": MODEL, "url": prefill_url, "role": "prefill"}]
    backends += [
        {"name": f"decode{i}", "model": MODEL, "url": url, "role": "decode"}
        for i, url in enumerate(decode_urls)
    ]
    cfg = RouterConfig.model_validate(
        {
            "backends": backends,
            "routing": {"retries": {"maxResumes": 2}},
            "discovery": {"probeIntervalSeconds": 0.2, "failureThreshold": 1},
        }
    )
    return build_app(cfg, lambda source: tokenizer)


def _requests() -> list[tuple[str, dict]]:
    out = []
    for k, topic in enumerate(["a lighthouse", "a lost key", "the first snow", "a river town"]):
        if k % 2:
            body = {"messages": [{"role": "user", "content": f"Tell me a long story about {topic}."}]}
            out.append(("/v1/chat/completions", body))
        else:
            out.append(("/v1/completions", {"prompt": f"Here is a long story about {topic}. It begins"}))
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return [(path, {**body, **common}) for path, body in out]


def _text(event: dict, chat: bool) -> str:
    return "".join((c["delta"].get("content") or "") if chat else c["text"] for c in event["choices"])


async def _plain(s: aiohttp.ClientSession, url: str, path: str, body: dict) -> tuple[str, int]:
    async with s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    choice = data["choices"][0]
    text = choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    return text, data["usage"]["completion_tokens"]


async def _stream(s, router_url: str, path: str, body: dict, progressed: asyncio.Event) -> bytes:
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks: list[bytes] = []
    async with s.post(router_url + path, json=payload) as r:
        assert r.status == 200, await r.text()
        async for chunk in r.content.iter_any():
            chunks.append(chunk)
            if b"".join(chunks).count(b"data: ") >= 6:  # the prefill pod's token and some of the decode's
                progressed.set()
    progressed.set()
    return b"".join(chunks)


async def _running(s, url: str) -> float:
    async with s.get(url + "/metrics") as r:
        m = re.search(r"^tokenfleet:num_requests_running(?:\{[^}]*\})? ([0-9.e+-]+)$", await r.text(), re.M)
    return float(m.group(1)) if m else 0.0


def _total(counter) -> float:
    return sum(x.value for m in counter.collect() for x in m.samples if x.name.endswith("_total"))


def _assert_one_whole_stream(raw: bytes, text: str, tokens: int, chat: bool) -> None:
    """One id, the plain pod's greedy text and usage, a single `[DONE]`, no error, no annotation."""
    events = [b[len("data: ") :] for b in raw.decode().split("\n\n") if b.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    parsed = [json.loads(e) for e in events[:-1]]
    assert not [e for e in parsed if "error" in e], raw
    assert len({e["id"] for e in parsed}) == 1
    assert "".join(_text(e, chat) for e in parsed if e.get("choices")) == text
    assert parsed[-1]["usage"]["completion_tokens"] == tokens == MAX_TOKENS
    blocks = [b.strip() for b in raw.decode().split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks), raw


async def _kill_under_streams(s, router_url: str, reqs, url: str, proc) -> list[bytes]:
    """Start `reqs` as streams, SIGKILL the pod at `url` once each has progressed and one decodes there."""
    progressed = [asyncio.Event() for _ in reqs]
    tasks = [
        asyncio.create_task(_stream(s, router_url, path, body, e))
        for (path, body), e in zip(reqs, progressed, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in progressed)), 300)
    assert await _running(s, url) >= 1, "no stream was decoding on the pod to be killed"
    proc.send_signal(signal.SIGKILL)
    return await asyncio.wait_for(asyncio.gather(*tasks), 400)  # no client hangs


async def test_a_decode_pod_killed_mid_stream_is_invisible_to_clients(pods, serve_app, in_rotation):
    (p_url, _), (d1_url, _), (d2_url, d2_proc) = pods
    reqs = _requests()
    app = _router_app(p_url, [d1_url, d2_url])
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        plain = await asyncio.gather(*(_plain(s, p_url, path, body) for path, body in reqs))
        async with serve_app(app) as router_url:
            await app[ROUTER].tokenizers_loaded()
            await in_rotation(app, 3)
            # Decode pods are picked by load: four streams at once spread over both.
            raws = await _kill_under_streams(s, router_url, reqs, d2_url, d2_proc)
            metrics = app[ROUTER].metrics
    for raw, (text, tokens), (path, _) in zip(raws, plain, reqs, strict=True):
        _assert_one_whole_stream(raw, text, tokens, path.endswith("chat/completions"))
    assert _total(metrics.resumes) >= 1 and _total(metrics.resume_failures) == 0


async def test_with_the_last_decode_pod_gone_prefill_pods_serve_alone(pods, serve_app, in_rotation):
    """A node lost with the decode role's only pod: its streams continue on the prefill pod (a whole engine)
    and new requests, streamed or not, are served there alone instead of failing until a replacement."""
    (p_url, _), (d1_url, d1_proc), _ = pods
    reqs = _requests()[:2]
    app = _router_app(p_url, [d1_url])
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        plain = await asyncio.gather(*(_plain(s, p_url, path, body) for path, body in reqs))
        async with serve_app(app) as router_url:
            await app[ROUTER].tokenizers_loaded()
            await in_rotation(app, 2)
            raws = await _kill_under_streams(s, router_url, reqs, d1_url, d1_proc)
            # Afterwards the decode role is empty: whole and streamed requests go to the prefill pod alone.
            path, body = reqs[0]
            async with s.post(router_url + path, json=body) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-tokenfleet-endpoint"] == p_url
                whole = (await r.json())["choices"][0]["text"]
            after = await _stream(s, router_url, path, body, asyncio.Event())
            metrics = app[ROUTER].metrics
    assert whole == plain[0][0]
    cases = zip([*raws, after], [*plain, plain[0]], [*reqs, reqs[0]], strict=True)
    for raw, (text, tokens), (path, _) in cases:
        _assert_one_whole_stream(raw, text, tokens, path.endswith("chat/completions"))
    assert _total(metrics.resumes) >= 1 and _total(metrics.resume_failures) == 0
