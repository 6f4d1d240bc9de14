"""API keys (flags, config, a re-read key file) and client disconnects aborting engine requests."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.server.auth import ApiKeys, bearer_token

BODY = {"prompt": "abc", "max_tokens": 2}


async def test_keys_guard_v1_but_not_probes(make_client, fake_engine):
    config = RuntimeConfig.model_validate({"server": {"api_keys": ["k1", "k2"]}})
    client = await make_client(fake_engine, config)
    assert (await client.post("/v1/completions", json=BODY)).status == 401
    bad = await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"})
    assert bad.status == 401
    assert (await bad.json())["error"]["code"] == "invalid_api_key"
    for key in ("k1", "k2"):
        ok = await client.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
        assert ok.status == 200
    for probe in ("/health", "/ready", "/metrics", "/version"):
        assert (await client.get(probe)).status == 200


async def test_key_file_is_reread_when_it_changes(tmp_path, make_client, fake_engine):
    path = tmp_path / "keys"
    path.write_text("# mounted secret\nold-key\n")
    now = [0.0]
    keys = ApiKeys(key_file=str(path), recheck_seconds=5.0, clock=lambda: now[0])
    client = await make_client(fake_engine, api_keys=keys)

    async def status(key: str) -> int:
        resp = await client.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
        return resp.status

    assert await status("old-key") == 200
    path.write_text("new-key\n")
    os.utime(path, (1, 1))  # a different mtime even on coarse filesystems
    assert await status("new-key") == 401  # not re-checked yet (at most once per recheck_seconds)
    now[0] = 10.0
    assert await status("new-key") == 200
    assert await status("old-key") == 401
    path.unlink()  # a Secret being swapped: the last good keys stay in force
    now[0] = 20.0
    assert await status("new-key") == 200


def test_bearer_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


async def _wait_for(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_non_streaming_disconnect_aborts(client, fake_engine):
    fake_engine.step_s = 0.05
    url = str(client.make_url("/v1/completions"))
    async with aiohttp.ClientSession() as session:
        task = asyncio.ensure_future(session.post(url, json={"prompt": "abc", "max_tokens": 50}))
        await _wait_for(lambda: fake_engine.active)
        task.cancel()  # closes the connection mid-request
    await _wait_for(lambda: not fake_engine.active)
    assert len(fake_engine.aborted) == 1


@pytest.mark.parametrize("handler_cancellation", [True, False], ids=["cancelled", "write-fails"])
async def test_streaming_disconnect_aborts(make_client, fake_engine, handler_cancellation):
    # Without handler cancellation the handler only learns of the disconnect when a write fails.
    client = await make_client(fake_engine, handler_cancellation=handler_cancellation)
    fake_engine.step_s = 0.02
    url = str(client.make_url("/v1/chat/completions"))
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 60, "stream": True, "n": 2}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url, json=body)
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        resp.close()
    await _wait_for(lambda: not fake_engine.active)
    assert len(fake_engine.aborted) == 2
    metrics = await (await client.get("/metrics")).text()
    assert (
        'tokenfleet:http_requests_total{model_name="smollm2-135m-instruct",route="/v1/chat/completions",status="499"} 1.0'
        in metrics
    )
