"""Sleep mode over HTTP with the real engine: vLLM's /sleep, /wake_up, /is_sleeping behind the flag.

A sleeping pod answers requests with 503 `sleeping` (Retry-After: a router retries another pod), is not
ready but alive, reports its level on /metrics, and after waking generates exactly what it generated
before. A sleep waits for the requests in flight (a stream runs to its end) or, past its timeout, gives up
with 409 and keeps serving.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from tokenfleet.runtime.server.access import Access, access_of

BODY = {
    "prompt": "A short story about a lighthouse keeper who",
    "max_tokens": 16,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def sleepy_server(start_real_server):
    return start_real_server(server={"enable_sleep_mode": True})


async def _complete(session: aiohttp.ClientSession, url: str, **overrides) -> tuple[int, dict, dict]:
    async with session.post(url + "/v1/completions", json={**BODY, **overrides}) as resp:
        return resp.status, dict(resp.headers), await resp.json()


def _sleep_gauge(metrics_text: str) -> float:
    (line,) = [ln for ln in metrics_text.splitlines() if ln.startswith("tokenfleet:engine_sleep_state{")]
    return float(line.rsplit(" ", 1)[1])


async def test_endpoints_are_off_without_the_flag(real_server):
    async with aiohttp.ClientSession() as session:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            async with session.request(method, real_server.url + path) as resp:
                assert resp.status == 404
                error = (await resp.json())["error"]
                assert error["code"] == "sleep_mode_disabled" and "--enable-sleep-mode" in error["message"]


@pytest.mark.parametrize("level", ["0", "3", "deep", ""])
async def test_a_wrong_level_is_a_400_naming_it(sleepy_server, level):
    async with aiohttp.ClientSession() as session:
        async with session.post(sleepy_server.url + "/sleep", params={"level": level}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert error["param"] == "level" and "must be 1" in error["message"]
        async with session.post(sleepy_server.url + "/wake_up", params={"tags": "optimizer"}) as resp:
            assert resp.status == 400
            assert "unknown wake_up tags" in (await resp.json())["error"]["message"]
        async with session.get(sleepy_server.url + "/is_sleeping") as resp:
            assert await resp.json() == {"is_sleeping": False}


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_then_wake_serves_identical_tokens(sleepy_server, level):
    url = sleepy_server.url
    async with aiohttp.ClientSession() as session:
        status, _, before = await _complete(session, url)
        assert status == 200
        log = await (await session.get(url + "/v1/kv-events")).json()  # a router's first poll
        assert log["events"][1]["block_hashes"]  # the prompt's blocks are cached and announced

        async with session.post(url + "/sleep", params={"level": str(level)}) as resp:
            assert resp.status == 200, await resp.text()
            body = await resp.json()
            assert body["is_sleeping"] is True and body["level"] == level
            assert body["freed_bytes"]["kv_cache"] > 0
        # The router's next poll hears that every block is gone.
        poll = {"since": str(log["seq"]), "epoch": log["epoch"], "wait": "0"}
        update = await (await session.get(url + "/v1/kv-events", params=poll)).json()
        assert not update["reset"] and [e["type"] for e in update["events"]] == ["cleared"]
        assert await (await session.get(url + "/is_sleeping")).json() == {"is_sleeping": True}
        ready = await session.get(url + "/ready")
        assert ready.status == 503 and (await ready.json())["status"] == "sleeping"
        assert (await session.get(url + "/health")).status == 200  # alive: no restart
        assert _sleep_gauge(await (await session.get(url + "/metrics")).text()) == level

        status, headers, payload = await _complete(session, url)
        assert status == 503 and payload["error"]["code"] == "sleeping"
        assert int(headers["Retry-After"]) >= 1

        async with session.post(url + "/wake_up") as resp:
            assert resp.status == 200
            assert (await resp.json())["is_sleeping"] is False
        assert (await session.get(url + "/ready")).status == 200
        assert _sleep_gauge(await (await session.get(url + "/metrics")).text()) == 0

        status, _, after = await _complete(session, url)
        assert status == 200
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["completion_tokens"] == 16


async def _stream(session: aiohttp.ClientSession, url: str, first: asyncio.Event, max_tokens: int) -> list:
    chunks = []
    body = {**BODY, "max_tokens": max_tokens, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            first.set()
    return chunks


async def test_sleep_waits_for_a_stream_in_flight(sleepy_server):
    url = sleepy_server.url
    async with aiohttp.ClientSession() as session:
        first = asyncio.Event()
        stream = asyncio.create_task(_stream(session, url, first, max_tokens=48))
        await asyncio.wait_for(first.wait(), 60)
        async with session.post(url + "/sleep", params={"level": "1", "timeout": "120"}) as resp:
            # 200, not a 500 from an engine asked to sleep with a request unfinished: it waited.
            assert resp.status == 200, await resp.text()
        chunks = await asyncio.wait_for(stream, 30)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 40  # all of it arrived, not cut short
        assert (await session.post(url + "/wake_up")).status == 200


async def test_sleep_times_out_with_409_and_keeps_serving(sleepy_server):
    url = sleepy_server.url
    async with aiohttp.ClientSession() as session:
        first = asyncio.Event()
        stream = asyncio.create_task(_stream(session, url, first, max_tokens=200))
        await asyncio.wait_for(first.wait(), 60)
        async with session.post(url + "/sleep", params={"level": "1", "timeout": "0.1"}) as resp:
            assert resp.status == 409
            error = (await resp.json())["error"]
            assert error["code"] == "requests_in_flight" and "1 requests still in flight" in error["message"]
        assert await (await session.get(url + "/is_sleeping")).json() == {"is_sleeping": False}
        assert (await session.get(url + "/ready")).status == 200
        chunks = await stream
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        status, _, _ = await _complete(session, url)
        assert status == 200


def test_sleep_endpoints_need_the_internal_key_when_one_is_set():
    for path in ("/sleep", "/wake_up", "/is_sleeping"):
        assert access_of(path, internal_key_set=True) is Access.INTERNAL
        assert access_of(path, internal_key_set=False) is Access.CLIENT


def test_the_flag_turns_it_on():
    from tokenfleet.runtime.server.main import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["--enable-sleep-mode"])).server.enable_sleep_mode
    assert not config_from_args(build_parser().parse_args([])).server.enable_sleep_mode
