"""Fixtures for the server tests.

`FakeEngine` implements the AsyncEngine contract (eager validation, per-request delta streams, abort,
health, stats) over a character-level tokenizer, so protocol-level tests run in milliseconds. Tests that
need the real model use `real_server` (tests/runtime/server/test_openai_real.py and friends).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.outputs import EngineStats, RequestDelta, RequestMetrics, TokenLogprobs
from tokenfleet.runtime.errors import ContextLengthExceeded, EngineDeadError, InvalidRequest, Overloaded
from tokenfleet.runtime.server.app import STATE_KEY, build_app
from tokenfleet.runtime.server.main import serve


class CharTokenizer:
    """One token per character (id = code point): easy to predict in assertions."""

    eos_token_ids = (0,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise InvalidRequest(f"unknown role {m['role']}", param="messages")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """Generates the prompt's characters back, one per step of `step_s` seconds."""

    def __init__(self, max_model_len: int = 64, step_s: float = 0.0, max_waiting: int = 100):
        self.tokenizer = CharTokenizer()
        self.model_name = RuntimeConfig().model.name
        self.max_model_len = max_model_len
        self.step_s = step_s
        self.max_waiting = max_waiting
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.submitted: list[tuple[str, list[int], object]] = []
        self.priorities: dict[str, int] = {}
        self.tenants: dict[str, str | None] = {}
        self.dead: str | None = None

    def add_request(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None, tenant=None):
        if self.dead:
            raise EngineDeadError(self.dead)
        if len(self.active) >= self.max_waiting:
            raise Overloaded("queue full", retry_after=2.5)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ContextLengthExceeded("prompt too long", param="prompt")
        self.active.add(request_id)
        self.priorities[request_id] = priority
        self.tenants[request_id] = tenant
        self.submitted.append((request_id, list(prompt_token_ids), params))
        return self._stream(request_id, list(prompt_token_ids), params)

    async def _stream(self, rid: str, prompt: list[int], params) -> AsyncIterator[RequestDelta]:
        arrival = asyncio.get_running_loop().time()
        limit = min(params.max_tokens or self.max_model_len - len(prompt), self.max_model_len - len(prompt))
        finished = False
        try:
            for i in range(limit):
                await asyncio.sleep(self.step_s)
                tok = prompt[i % len(prompt)]
                last = i == limit - 1
                lps = (
                    [TokenLogprobs(tok, -0.25, ((tok, -0.25), (ord("?"), -2.0)))]
                    if params.logprobs is not None
                    else None
                )
                now = asyncio.get_running_loop().time()
                metrics = RequestMetrics(arrival, arrival, arrival + 0.001, now) if last else None
                finished = last
                yield RequestDelta(
                    rid,
                    [tok],
                    chr(tok),
                    lps,
                    last,
                    "length" if last else None,
                    len(prompt),
                    i + 1,
                    0,
                    metrics=metrics,
                )
        finally:
            self.active.discard(rid)
            if not finished:
                self.aborted.append(rid)

    async def abort(self, request_id: str) -> None:
        if request_id in self.active:
            self.aborted.append(request_id)
        self.active.discard(request_id)

    def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.active), num_total_blocks=10, num_free_blocks=10)


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def make_client():
    clients: list[TestClient] = []

    async def make(
        engine=None, config: RuntimeConfig | None = None, handler_cancellation: bool = True, **app_kwargs
    ) -> TestClient:
        app = build_app(config or RuntimeConfig(), engine=engine, **app_kwargs)
        client = TestClient(TestServer(app, handler_cancellation=handler_cancellation))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.close()


@pytest.fixture
async def client(make_client, fake_engine) -> TestClient:
    return await make_client(fake_engine)


# --- the real default model, served in-process --------------------------------------------------------


class ServerThread:
    """`serve()` on its own thread and event loop, so blocking clients (openai) can call it from tests."""

    def __init__(self, config: RuntimeConfig, engine_factory):
        self.config = config
        self.engine_factory = engine_factory
        self.lines: list[str] = []
        self.url = ""
        self.app = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenfleet-test-server", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.exit_code: int | None = None

    def _run(self) -> None:
        self.exit_code = asyncio.run(self._main())
        self._ready.set()  # unblock start() if serving failed

    async def _main(self) -> int:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        return await serve(
            self.config,
            self.engine_factory,
            stop=self._stop,
            announce=self.lines.append,
            started=self._started,
        )

    def _started(self, url: str, app) -> None:
        self.url, self.app = url, app
        self._ready.set()

    def start(self, timeout: float = 300) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(timeout), "server did not start"
        assert self.app is not None, f"server failed: {self.lines}"
        return self

    @property
    def state(self):
        return self.app[STATE_KEY]

    @property
    def engine(self):
        return self.state.engine

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


def real_config(**sections) -> RuntimeConfig:
    """The default model on CPU with a small fixed KV cache (tests are about behaviour, not capacity)."""
    data = {"server": {"port": 0}, "cache": {"num_blocks": 256}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return RuntimeConfig.model_validate(data)


@pytest.fixture(scope="session")
def loaded_model():
    """The default model's weights, loaded once and shared by every real server of the session."""
    import torch
    from tokenfleet.runtime.model.loader import load_model

    return load_model(RuntimeConfig().model, torch.device("cpu"))


@pytest.fixture(scope="session")
def start_real_server(loaded_model):
    from tokenfleet.runtime.engine.async_engine import AsyncEngine
    from tokenfleet.runtime.engine.engine_core import EngineCore

    servers: list[ServerThread] = []

    def start(**sections: dict) -> ServerThread:
        server = ServerThread(
            real_config(**sections), lambda cfg: AsyncEngine(EngineCore(cfg, loaded=loaded_model))
        ).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def real_server(start_real_server) -> ServerThread:
    return start_real_server()
