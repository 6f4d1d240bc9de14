"""ServerState: what one running server knows about itself (engine, readiness, drain, in-flight count).

The HTTP server starts before the model is loaded so probes can reach it: `/ready` answers 503 until
`engine` is set and started, and again once `draining` is set by SIGTERM. Handlers of /v1/* get the
engine through `require_engine()`, which turns both situations into a 503 the client can act on.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.server.auth import ApiKeys, InternalKey
from tokenfleet.runtime.server.errors import ApiError, model_not_found, unavailable
from tokenfleet.runtime.server.metrics import ServerMetrics


class HttpError(Exception):
    """Raised by handlers for errors that are not engine errors (unknown model, not ready, ...)."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


@dataclass(eq=False)
class ServerState:
    config: RuntimeConfig
    api_keys: ApiKeys
    internal_key: InternalKey = field(default_factory=lambda: InternalKey(None))
    engine: object | None = None  # an AsyncEngine once loaded and started
    watcher: object | None = None  # a config_watch.ConfigWatcher when serving from a config file
    kv_events: object | None = None  # a kv_events.KVEventPump once the engine runs
    tokenizer: object | None = None  # the served tokenizer's TokenizerPayload, built once on first use
    draining: bool = False
    load_error: str | None = None
    in_flight: int = 0
    # Sleep mode (sleep.py): the level the engine sleeps at (0 awake), and whether a sleep is draining
    # the requests in flight; either way new requests get 503 `sleeping`.
    sleep_level: int = 0
    sleep_pending: bool = False
    started_at: float = field(default_factory=time.time)
    _idle: asyncio.Event | None = None
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        # Engine gauges are read at scrape time; before the model is loaded there is nothing to report.
        self.metrics = ServerMetrics.from_config(
            self.config, lambda: self.engine.stats() if self.engine else None
        )

    @property
    def model_name(self) -> str:
        return self.config.model.name

    def require_engine(self):
        if self.draining:
            raise HttpError(unavailable("The server is shutting down.", code="draining", retry_after=1))
        if self.engine is None:
            reason = f"model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise HttpError(unavailable(f"Not ready: {reason}.", code="not_ready", retry_after=5))
        if self.sleep_level or self.sleep_pending:
            raise HttpError(
                unavailable("The server is asleep (sleep mode); retry on another replica.", "sleeping", 1)
            )
        return self.engine

    @property
    def lora(self):
        """The engine's LoRAManager, or None (LoRA off, or no engine yet)."""
        return getattr(getattr(self.engine, "core", None), "lora", None)

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` selects, None for the base model; 404 for anything else."""
        # A missing `model` means the one model this pod serves (vLLM does the same).
        if name is None or name == self.model_name:
            return None
        lora = self.lora
        if lora is not None and lora.is_known(name):
            return name
        raise HttpError(model_not_found(name))

    # In-flight accounting for the SIGTERM drain.
    def enter(self) -> None:
        self.in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when every in-flight request finished within `timeout` seconds."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False


STATE_KEY = web.AppKey("tokenfleet.state", ServerState)
