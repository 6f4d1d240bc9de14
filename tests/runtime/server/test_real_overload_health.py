"""Admission control and liveness with the real engine: a bounded queue answers 429, a dead loop fails /health.

One server for the module; the fault-injection test runs last because it kills that server's engine.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest


@pytest.fixture(scope="module")
def small_server(start_real_server):
    # Two running at a time and four waiting: the other 14 of 20 concurrent requests must be refused.
    return start_real_server(scheduler={"max_waiting": 4, "max_num_seqs": 2})


async def test_queue_limit_gives_429_with_retry_after_and_nothing_hangs(small_server):
    url = small_server.url + "/v1/completions"
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def one(session: aiohttp.ClientSession) -> tuple[int, str | None, dict]:
        async with session.post(url, json=body) as resp:
            return resp.status, resp.headers.get("Retry-After"), await resp.json()

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = await asyncio.wait_for(asyncio.gather(*(one(session) for _ in range(20))), 150)
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}
    assert statuses.count(429) >= 1 and statuses.count(200) >= 2
    for status, retry_after, payload in results:
        if status == 429:
            assert retry_after is not None and int(retry_after) >= 1
            assert payload["error"]["type"] == "rate_limit_error"
        else:
            assert payload["usage"]["completion_tokens"] == 4
            assert payload["choices"][0]["finish_reason"] == "length"


async def test_health_fails_when_the_model_runner_raises(small_server):
    async with aiohttp.ClientSession() as session:
        assert (await session.get(small_server.url + "/health")).status == 200

        def broken(*args, **kwargs):
            raise RuntimeError("injected fault: device lost")

        # Fault injection: every model step from now on raises inside the engine loop.
        small_server.engine.core.runner.execute = broken
        resp = await session.post(
            small_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}
        )
        assert resp.status in (500, 503)
        assert "error" in await resp.json()
        deadline = time.monotonic() + 10
        while True:
            health = await session.get(small_server.url + "/health")
            if health.status == 503:
                break
            assert time.monotonic() < deadline, "/health still 200 with a dead engine"
            await asyncio.sleep(0.05)
        assert "injected fault" in (await health.json())["reason"]
        resp = await session.post(
            small_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}
        )
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "engine_dead"
