"""Live config reload for a serving pod: the server's share of a change, and GET /v1/config.

`runtime/config_watch.ConfigWatcher` polls the mounted config file and hands live changes (LIVE_FIELDS)
to `on_change`; here they reach the server (API keys, drain grace) and the engine (cache policy, queue
limit, stream interval, the LoRA adapters of `lora.modules` — removed ones unloaded, new ones loaded — and their host
limit `lora.max_cpu_loras`: no restart). Restart-only changes are reported by /v1/config so the operator can roll the pod. API keys are
redacted there: the endpoint sits behind the same keys, but a config dump must never echo secrets.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from tokenfleet.runtime.config import LoRAConfig, RuntimeConfig
from tokenfleet.runtime.server.auth import ApiKeys, InternalKey
from tokenfleet.runtime.server.state import STATE_KEY, ServerState

logger = logging.getLogger(__name__)


async def apply_to_engine(engine: Any, new: RuntimeConfig) -> None:
    """The engine's share of a live change: cache policy and stream interval on the engine thread, queue
    limit on the engine.

    `engine` is an AsyncEngine; `core.apply_cache_policy` runs between steps (TTL, eviction, pins, host
    tier), and so does `core.set_stream_interval`; `max_waiting` is read by `AsyncEngine.add_request` from
    its config.
    """
    await engine.call(lambda core: core.apply_cache_policy(new.cache))
    if new.server.stream_interval != engine.config.server.stream_interval:
        await engine.call(lambda core: core.set_stream_interval(new.server.stream_interval))
    await sync_adapters(engine, engine.config.lora, new.lora)
    engine.config = new


async def sync_adapters(engine: Any, old: LoRAConfig, new: LoRAConfig) -> None:
    """Make the known adapters follow an edited `lora.modules`: an adapter the old list named and the new
    one drops (or points elsewhere) is forgotten — its requests in flight finish with it — and new entries
    become known, loaded now while host memory has room (read and checked off the event loop), else on
    first use. Adapters loaded through the API are left alone. A refused adapter is logged and skipped."""
    manager = getattr(getattr(engine, "core", None), "lora", None)
    if manager is None:
        return
    manager.config = new  # max_cpu_loras applies from the next load (nothing is evicted by lowering it)
    if old.modules == new.modules:
        return
    manager.set_listed(old.modules, new.modules)
    logger.info("LoRA adapters listed now: %s", [m.name for m in new.modules])
    for name, exc in await asyncio.to_thread(manager.preload):
        logger.warning("LoRA adapter %s from lora.modules not loaded: %s", name, exc)


def on_change_for(state: ServerState):
    """The callback a ConfigWatcher calls with (old, new) effective configs."""

    async def on_change(old: RuntimeConfig, new: RuntimeConfig) -> None:
        if state.engine is not None:
            await apply_to_engine(state.engine, new)
        # Both key sets are read before either is swapped in: an unreadable file changes nothing.
        api_keys, internal_key = state.api_keys, state.internal_key
        if (old.server.api_keys, old.server.api_key_file) != (new.server.api_keys, new.server.api_key_file):
            api_keys = ApiKeys(new.server.api_keys, new.server.api_key_file)
        if old.server.internal_api_key_file != new.server.internal_api_key_file:
            internal_key = InternalKey(new.server.internal_api_key_file)
        state.api_keys, state.internal_key = api_keys, internal_key
        state.config = new

    return on_change


def redact(snapshot: dict[str, Any]) -> dict[str, Any]:
    server = snapshot.get("effective", {}).get("server")
    if server and server.get("api_keys"):
        server["api_keys"] = ["<redacted>"] * len(server["api_keys"])
    for change in snapshot.get("pending_restart", ()):
        if change.get("path") == "server.api_keys":
            change["running"] = change["file"] = "<redacted>"
    return snapshot


async def config_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.watcher is not None:
        snapshot = state.watcher.snapshot()
    else:  # started without --config: nothing to reload, nothing pending
        snapshot = {
            "effective": state.config.model_dump(mode="json"),
            "pending_restart": [],
            "restart_required": False,
            "reloads": 0,
            "last_error": None,
        }
    return web.json_response(redact(snapshot))
