"""A config file change reaches the running server: live fields apply, restart-only ones show in /v1/config."""

from __future__ import annotations

import os

from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.config_watch import ConfigWatcher
from tokenfleet.runtime.server.live_config import on_change_for
from tokenfleet.runtime.server.state import STATE_KEY


class _Core:
    def __init__(self):
        self.cache_policies = []

    def apply_cache_policy(self, cache):
        self.cache_policies.append(cache)

    def set_stream_interval(self, interval):
        self.stream_interval = interval


async def test_reload_applies_keys_and_queue_limit_and_reports_restart_fields(
    tmp_path, make_client, fake_engine
):
    path = tmp_path / "runtime.yaml"
    path.write_text("server:\n  api_keys: [old]\n")
    config = RuntimeConfig.load(path)
    fake_engine.core = _Core()
    fake_engine.config = config

    async def call(fn):  # AsyncEngine.call runs fn(core) on the engine thread
        return fn(fake_engine.core)

    fake_engine.call = call
    client = await make_client(fake_engine, config)
    state = client.server.app[STATE_KEY]
    state.watcher = ConfigWatcher(path, on_change_for(state), initial=config)

    path.write_text(
        "server:\n  api_keys: [new]\n  drain_seconds: 5\n  stream_interval: 4\nscheduler:\n  max_waiting: 3\n"
        "cache:\n  block_size: 32\n"
    )
    os.utime(path, (1, 1))
    assert await state.watcher.check_once()

    old = {"Authorization": "Bearer old"}
    new = {"Authorization": "Bearer new"}
    assert (await client.get("/v1/models", headers=old)).status == 401
    assert (await client.get("/v1/models", headers=new)).status == 200
    assert state.config.server.drain_seconds == 5
    assert fake_engine.config.scheduler.max_waiting == 3
    assert len(fake_engine.core.cache_policies) == 1
    assert fake_engine.core.stream_interval == 4
    snapshot = await (await client.get("/v1/config", headers=new)).json()
    assert snapshot["restart_required"] is True
    assert [c["path"] for c in snapshot["pending_restart"]] == ["cache.block_size"]
    assert snapshot["effective"]["cache"]["block_size"] == 16  # what runs, not what the file asks
    assert snapshot["effective"]["server"]["api_keys"] == ["<redacted>"]
    assert (await client.get("/v1/config")).status == 401


async def test_config_endpoint_without_a_watcher(client):
    snapshot = await (await client.get("/v1/config")).json()
    assert snapshot["restart_required"] is False
    assert snapshot["effective"]["model"]["model"] == "smollm2-135m-instruct"
