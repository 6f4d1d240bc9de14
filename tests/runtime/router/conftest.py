"""Real HTTP on loopback: run aiohttp apps on free ports for the router's tests."""

from __future__ import annotations

import contextlib
import socket

import pytest
from aiohttp import web


@contextlib.asynccontextmanager
async def serve(app: web.Application, port: int = 0, handler_cancellation: bool = False):
    """Run `app` on 127.0.0.1; yields its base URL. Routers run with `handler_cancellation`, as
    `tokenfleet route` runs them."""
    runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=handler_cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    real_port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{real_port}"
    finally:
        await runner.cleanup()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve_app():
    return serve


# --- a small real tokenizer and a fake runtime pod speaking the pod's HTTP contract ----------------------------

import asyncio  # noqa: E402
import json  # noqa: E402

import tokenizers  # noqa: E402
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra, with_adapter  # noqa: E402
from tokenfleet.runtime.engine.kv_cache.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockStored,
    PrefillScheduled,
)
from tokenfleet.runtime.kv_wire import LoadReport  # noqa: E402
from tokenfleet.runtime.model.tokenizer import Tokenizer  # noqa: E402
from tokenfleet.runtime.router.app import ROUTER  # noqa: E402
from tokenfleet.runtime.router.prompt_blocks import prompt_token_ids  # noqa: E402
from tokenfleet.runtime.server.kv_event_log import KVEventLog, kv_event_routes  # noqa: E402
from tokenizers import models, pre_tokenizers  # noqa: E402

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> Tokenizer:
    """Word-level: `w0 .. w1999` and a few words, one token each; ChatML specials."""
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for word in ["system", "user", "assistant", *(f"w{i}" for i in range(2000))]:
        vocab[word] = len(vocab)
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer(backend, eos_token_ids=[2], eos_token="<|im_end|>", chat_template=CHATML)


class FakePod:
    """A runtime pod's HTTP surface with a real prefix cache model: it caches every prompt's full blocks,
    publishes them on /v1/kv-events, and counts its own prefix-cache hits (as the real pod's metrics do)."""

    def __init__(self, model: str, tokenizer: Tokenizer, block_size: int = 16, tokens: int = 3):
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.tokens = tokens
        self.extra = hash_extra(model)
        self.log = KVEventLog(block_size, self.extra)
        self.cached: set[bytes] = set()
        self.hit_blocks = 0
        self.requests: list[dict] = []
        self.fail_status: int | None = None
        self.healthy = True
        self.die_after_events: int | None = None
        self.hang_after_events: int | None = None
        self.gate: asyncio.Event | None = None  # stream waits on it after the first event
        self.delay = 0.0
        self.running = 0
        self.waiting = 0  # what its /load reports as queued (the router's demand gauge sums them)
        self.loading = False
        self.query_blocks = 0
        self.prefill_seconds = 0.0  # > 0: blocks are stored only after this "prefill"
        self.announce_prefills = True  # ... and announced as `scheduled` when it starts
        self._prefilling: dict[bytes, asyncio.Event] = {}
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> its block-hash key (on /load, as a pod)
        self.loadable: set[str] = set()  # adapters it loads when a request names one (as listed ones are)
        # The most adapters it holds: a loadable one beyond that is refused with a real pod's 503
        # `lora_slots_busy` (as if every held one had requests in flight). None: no limit.
        self.max_adapters: int | None = None
        self.report_room = True  # whether /load says how many more it could load (older pods do not)
        # Device slots (distinct adapters per step) and the adapters it reports in flight; None: not said.
        self.lora_slots: int | None = None
        self.lora_active: tuple[str, ...] = ()
        # Loadable adapters whose source it cannot download now (an hf:// adapter while the Hub fails): a
        # real pod's 503 `lora_source_unavailable`.
        self.source_down: set[str] = set()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._loading_gate])
        app.add_routes(
            [
                web.post("/v1/completions", self.generate),
                web.post("/v1/chat/completions", self.generate),
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                *kv_event_routes(
                    self.log,
                    lambda: LoadReport(
                        self.running,
                        self.waiting,
                        len(self.cached) / 10_000,
                        lora_adapters=dict(self.adapters) if self.adapters else None,
                        lora_room=self.lora_room,
                        lora_active=self.lora_active if self.lora_slots is not None else None,
                        lora_slots=self.lora_slots,
                    ),
                ),
            ]
        )
        return app

    @property
    def lora_room(self) -> int | None:
        if self.max_adapters is None or not self.report_room:
            return None
        return max(self.max_adapters - len(self.adapters), 0)

    @web.middleware
    async def _loading_gate(self, request, handler):
        """While `loading`, the pod answers as a real one does before its model is in: /load and /ready 503."""
        if self.loading and request.path in ("/load", "/ready", "/v1/kv-events"):
            return web.json_response({"status": "loading"}, status=503)
        return await handler(request)

    async def health(self, request):
        return web.json_response({"ok": self.healthy}, status=200 if self.healthy else 503)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    def evict_all(self) -> None:
        self.cached.clear()
        self.log.publish([AllBlocksCleared()])

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        payload = json.loads(body)
        self.requests.append({"payload": payload, "headers": dict(request.headers), "path": request.path})
        if self.fail_status is not None:
            return web.json_response({"error": {"message": "boom"}}, status=self.fail_status)
        model = payload.get("model")
        if model in self.loadable and model not in self.adapters:
            if model in self.source_down:
                error = {
                    "message": f"the adapter source hf://org/{model} cannot be downloaded now",
                    "type": "service_unavailable",
                    "code": "lora_source_unavailable",
                }
                return web.json_response({"error": error}, status=503, headers={"Retry-After": "5"})
            if self.max_adapters is not None and len(self.adapters) >= self.max_adapters:
                error = {
                    "message": "no adapter place",
                    "type": "service_unavailable",
                    "code": "lora_slots_busy",
                }
                return web.json_response({"error": error}, status=503, headers={"Retry-After": "1"})
            self.adapters[model] = f"{model}@1"
        if model != self.model and model not in self.adapters:
            return web.json_response({"error": {"message": "wrong model"}}, status=404)
        ids = prompt_token_ids(request.path, body, self.tokenizer) or []
        # An adapter's blocks are hashed with its key, as the engine does.
        extra = with_adapter(self.extra, None, self.adapters.get(model))
        hashes = block_hashes_for(ids, self.block_size, extra)
        self.query_blocks += len(hashes)
        # A prefix this pod is computing right now is reused once that computation is done (as chunked
        # prefill caches blocks chunk by chunk), so following a prefill to its pod pays off.
        pending = [self._prefilling[h] for h in hashes if h not in self.cached and h in self._prefilling]
        if pending:
            await pending[-1].wait()
        for h in hashes:
            if h not in self.cached:
                break
            self.hit_blocks += 1
        self.running += 1
        try:
            new = [h for h in hashes if h not in self.cached]
            # A real pod announces the prefill, computes it, then stores the blocks.
            if self.announce_prefills and hashes:
                self.log.publish([PrefillScheduled(tuple(hashes))])
            if self.prefill_seconds:
                done = asyncio.Event()
                self._prefilling.update(dict.fromkeys(new, done))
                await asyncio.sleep(self.prefill_seconds)
                for h in new:
                    self._prefilling.pop(h, None)
                done.set()
            if new:
                self.cached.update(new)
                self.log.publish([BlockStored(tuple(new), None, (), self.block_size)])
            if self.delay:
                await asyncio.sleep(self.delay)
            if not payload.get("stream"):
                return web.json_response(
                    {"object": "text_completion", "model": self.model, "choices": [{"text": "ok"}],
                     "usage": {"prompt_tokens": len(ids), "completion_tokens": self.tokens}}
                )  # fmt: skip
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(self.tokens):
                if self.die_after_events == i:
                    await asyncio.sleep(0.2)  # let the events reach the router, as on a real network
                    request.transport.close()  # the pod dies mid-stream
                    return resp
                if self.hang_after_events == i:
                    await asyncio.sleep(3600)
                await resp.write(b"data: " + json.dumps({"choices": [{"text": f"t{i}"}]}).encode() + b"\n\n")
                if i == 0 and self.gate is not None:
                    await self.gate.wait()
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.running -= 1


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return make_tokenizer()


@pytest.fixture
def make_pod(tokenizer):
    return lambda model="m", **kw: FakePod(model, tokenizer, **kw)


@pytest.fixture
def start_router(serve_app, tokenizer):
    """`async with start_router(backends, routing=..., discovery=...) as (url, router_state)`; by default
    waits (up to 2 s) until every endpoint has answered a probe as serving."""
    from tokenfleet.runtime.router.app import ROUTER, build_app
    from tokenfleet.runtime.router.config import RouterConfig

    @contextlib.asynccontextmanager
    async def start(backends, routing=None, discovery=None, config_path=None, wait_ready=True, **extra):
        cfg = RouterConfig.model_validate(
            {
                "backends": backends,
                "routing": routing or {},
                "discovery": {"probeIntervalSeconds": 0.05, "healthEvery": 1, **(discovery or {})},
                **extra,
            }
        )
        app = build_app(cfg, lambda source: tokenizer, config_path=config_path)
        async with serve_app(app, handler_cancellation=True) as url:
            router = app[ROUTER]
            await router.tokenizers_loaded()
            if wait_ready:  # the first probes: endpoints take traffic only once one says they serve
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 2.0
                while loop.time() < deadline and not all(
                    router.fleet.available(ep) for ep in router.fleet.endpoints.by_id.values()
                ):
                    await asyncio.sleep(0.01)
            yield url, router

    return start


async def until(cond, timeout: float = 5.0, step: float = 0.02) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(step)


@pytest.fixture
def wait_until():
    return until


async def until_in_rotation(app: web.Application, count: int, timeout: float = 60.0) -> None:
    """Wait until the router `app` has `count` endpoints, all taking requests (`Fleet.in_rotation`): a
    test spreading requests over several pods must not race the first probes."""
    fleet = app[ROUTER].fleet
    await until(lambda: fleet.in_rotation(count), timeout, 0.05)


@pytest.fixture
def in_rotation():
    return until_in_rotation


@pytest.fixture
def closed_port_url() -> str:
    """A URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def free_ports():
    """n distinct free ports with the same number of digits, ascending (URLs then sort like the ports)."""

    def pick(n: int) -> list[int]:
        ports: set[int] = set()
        while len(ports) < n:
            p = free_port()
            if p >= 10000:
                ports.add(p)
        return sorted(ports)

    return pick


class KubeletMount:
    """A mounted ConfigMap/Secret as the kubelet lays it out: NAME -> ..data/NAME, ..data -> ..<version>/,
    and an update swaps `..data` atomically (the file's own path never changes)."""

    def __init__(self, root, files: dict[str, str]):
        from pathlib import Path

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.version = 0
        self._write(files)
        for name in files:
            (self.root / name).symlink_to(f"..data/{name}")

    def path(self, name: str):
        return self.root / name

    def _write(self, files: dict[str, str]) -> None:
        import os

        self.version += 1
        version_dir = self.root / f"..2024_01_01_00_00_{self.version:02d}"
        version_dir.mkdir()
        for name, text in files.items():
            (version_dir / name).write_text(text)
            os.utime(version_dir / name, ns=(10**18, 10**18))  # same mtime every time
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(version_dir.name)
        os.replace(tmp, self.root / "..data")

    def swap(self, files: dict[str, str]) -> None:
        self._write(files)


@pytest.fixture
def kubelet_mount(tmp_path):
    return lambda files, name="mount": KubeletMount(tmp_path / name, files)
