"""Live config reload for a serving pod: the server's share of a change, and GET /v1/config.

`runtime/config_watch.ConfigWatcher` polls the mounted config file and hands live changes (LIVE_FIELDS)
to `on_change`; here they reach the server (API keys, drain grace) and the engine (cache policy, queue
limit). Restart-only changes are reported by /v1/config so the operator can roll the pod. API keys are
redacted there: the endpoint sits behind the same keys, but a config dump must never echo secrets.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.server.auth import ApiKeys, InternalKey
from tokenfleet.runtime.server.state import STATE_KEY, ServerState


async def apply_to_engine(engine: Any, new: RuntimeConfig) -> None:
    """The engine's share of a live change: cache policy on the engine thread, queue limit on the engine.

    `engine` is an AsyncEngine; `core.apply_cache_policy` runs between steps (TTL, eviction, pins, host
    tier); `max_waiting` is read by `AsyncEngine.add_request` from its config.
    """
    await engine.call(lambda core: core.apply_cache_policy(new.cache))
    engine.config = new


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
