"""`tokenfleet serve`: load the model, serve the OpenAI API, drain gracefully on SIGTERM.

The HTTP listener comes up first, so Kubernetes probes get answers while the model loads (/health 200,
/ready 503); the model loads on a worker thread, then the engine starts and /ready turns 200. On SIGTERM
the server stops admitting (/ready and new /v1 requests answer 503), lets in-flight requests finish for up
to `server.drain_seconds`, then closes the listener (cancelling what is left, which aborts it in the
engine) and stops the engine. A second signal skips the rest of the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Callable

from aiohttp import web
from tokenfleet.runtime import startup_timing
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.long_lived_heap import settle_heap
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.server.app import STATE_KEY, build_app
from tokenfleet.runtime.server.auth import ApiKeys
from tokenfleet.runtime.server.kv_events import KVEventPump
from tokenfleet.runtime.server.resume import HANDOFF_KEY
from tokenfleet.runtime.server.tokenizer_endpoint import served_tokenizer

logger = logging.getLogger("tokenfleet.server")

HANDOFF_WAIT_S = 2.0  # at the drain deadline: how long handed-back streams get to write their marker


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenfleet serve", description="Serve a model over the OpenAI API.")
    p.add_argument("--config", help="RuntimeConfig YAML (as the operator mounts it); flags override it")
    p.add_argument("--model", help="built-in name, a .gguf file or a HF checkpoint directory")
    p.add_argument("--served-name", help="the name clients pass as `model`")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 = any free port)")
    p.add_argument("--api-key", action="append", default=[], help="accepted Bearer key (repeatable)")
    p.add_argument("--api-key-file", help="file of keys, one per line, re-read when it changes")
    p.add_argument("--max-model-len", type=int)
    p.add_argument(
        "--weight-cache-dir", help="keep converted weights here; the next start of the same model maps them"
    )
    p.add_argument("--max-waiting", type=int, help="bounded waiting queue; beyond it 429")
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        help="priority: a waiting request preempts running ones of a lower priority when the batch is full",
    )
    p.add_argument(
        "--fair-share",
        action="store_true",
        default=None,
        help="within a priority, admit the waiting request of the least-served tenant first",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        help="send a stream's tokens once this many are held (first and last at once; default 1)",
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, help="shard the model over this many worker processes / devices"
    )
    p.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        default=None,
        help="expose POST /sleep, POST /wake_up and GET /is_sleeping (as vLLM does with this flag)",
    )
    p.add_argument(
        "--enable-lora", action="store_true", default=None, help="serve PEFT LoRA adapters (as vLLM's flag)"
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        help='adapters loaded at start: name=path, or JSON {"name", "path", "base_model_name"}',
    )
    p.add_argument("--max-loras", type=int, help="distinct adapters in one batch (device slots; default 1)")
    p.add_argument("--max-lora-rank", type=int, help="largest adapter rank served (default 16)")
    p.add_argument("--max-cpu-loras", type=int, help="adapters loaded at once (default --max-loras)")
    p.add_argument("--log-level", default="INFO")
    return p


def lora_module(text: str) -> dict[str, str]:
    """One `--lora-modules` entry in either of vLLM's forms: `name=path` or a JSON object."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError("a JSON entry must be an object with name and path")
        return value
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return {"name": name, "path": path}


def config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    """The config file (or defaults) with the flags laid over it, validated once more as a whole."""
    base = RuntimeConfig.load(args.config) if args.config else RuntimeConfig()
    data = base.model_dump()
    overrides = {
        ("model", "model"): args.model,
        ("model", "served_name"): args.served_name,
        ("model", "max_model_len"): args.max_model_len,
        ("model", "weight_cache_dir"): args.weight_cache_dir,
        ("server", "host"): args.host,
        ("server", "port"): args.port,
        ("server", "stream_interval"): args.stream_interval,
        ("server", "api_key_file"): args.api_key_file,
        ("scheduler", "max_waiting"): args.max_waiting,
        ("scheduler", "policy"): args.scheduling_policy,
        ("scheduler", "fair_share"): args.fair_share,
        ("parallel", "tensor_parallel_size"): args.tensor_parallel_size,
        ("server", "enable_sleep_mode"): args.enable_sleep_mode,
        ("lora", "enable"): args.enable_lora,
        ("lora", "modules"): args.lora_modules,
        ("lora", "max_loras"): args.max_loras,
        ("lora", "max_lora_rank"): args.max_lora_rank,
        ("lora", "max_cpu_loras"): args.max_cpu_loras,
    }
    for (section, key), value in overrides.items():
        if value is not None:
            data[section][key] = value
    if args.api_key:
        data["server"]["api_keys"] = (*data["server"]["api_keys"], *args.api_key)
    try:
        return RuntimeConfig.model_validate(data)
    except ValueError as e:
        raise ConfigError(f"invalid options: {e}") from e


def curl_example(url: str, model: str, with_key: bool) -> str:
    auth = ' -H "Authorization: Bearer $API_KEY"' if with_key else ""
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
    return f"curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d '{body}'"


async def serve(
    config: RuntimeConfig,
    engine_factory: Callable[[RuntimeConfig], object] | None = None,
    stop: asyncio.Event | None = None,
    announce: Callable[[str], None] = print,
    started: Callable[[str, web.Application], None] | None = None,
    config_path: str | None = None,
    freeze_heap: bool = False,
) -> int:
    """Run until `stop` is set (SIGTERM/SIGINT set it too); returns the exit status.

    `started(url, app)` is called once the engine serves (in-process tests use it to find the port).
    With `config_path`, the file is watched and its live fields applied without a restart.
    `freeze_heap` (the process serves nothing else): once the engine is loaded, everything built so far
    — the model, every KV block object — is moved out of the cyclic garbage collector's reach, and young
    collections run rarely (long_lived_heap.py). Otherwise each full collection walks all of it, a pause
    of the engine thread that lands in some step's inter-token latency, and a large batch's step runs
    young collections of its own short-lived entries; cyclic garbage is still collected.
    """
    if engine_factory is None:
        from tokenfleet.runtime.engine.async_engine import AsyncEngine  # torch: imported only to serve

        engine_factory = AsyncEngine.from_config
    startup_timing.mark("imports")
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        stop.set()
        if signals > 1:
            drain_now.set()

    drain_now = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Off the main thread (in-process tests) signals cannot be handled there: `stop` drives us.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, on_signal)

    keys = ApiKeys(config.server.api_keys, config.server.api_key_file)
    app = build_app(config, keys)
    state = app[STATE_KEY]
    # handler_cancellation: a non-streaming handler is cancelled when its client disconnects, which is
    # what aborts its engine request; access_log=None: the app writes its own structured line.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    announce(f"tokenfleet: listening on {url}; loading model {config.model.model!r} ...")
    startup_timing.mark("listen")
    engine = None
    try:
        try:
            engine = await loop.run_in_executor(None, engine_factory, config)
            startup_timing.mark("engine_build")
            await engine.start()
        except Exception as e:
            state.load_error = f"{type(e).__name__}: {e}"
            logger.exception("model failed to load")
            return 1
        if freeze_heap:
            settle_heap()
        state.engine = engine
        startup_timing.mark("engine_start")
        # Serialising a large vocabulary takes a while: once, off the loop, before routers ask for it.
        state.tokenizer = await loop.run_in_executor(None, served_tokenizer, state)
        startup_timing.mark("tokenizer_json")
        state.kv_events = KVEventPump(engine)
        await state.kv_events.start()
        if config_path is not None:
            from tokenfleet.runtime.config_watch import ConfigWatcher
            from tokenfleet.runtime.server.live_config import on_change_for

            state.watcher = ConfigWatcher(config_path, on_change_for(state), initial=config)
            state.watcher.start()
        startup_timing.mark("ready")
        startup_timing.report()
        announce(f"tokenfleet: serving {state.model_name!r} at {url}  (max_model_len {engine.max_model_len})")
        announce("try:\n  " + curl_example(url, state.model_name, keys.enabled))
        if started is not None:
            started(url, app)
        await stop.wait()
        state.draining = True
        grace = state.config.server.drain_seconds  # live: a reload may have changed it
        logger.info("draining: %d request(s) in flight, up to %.0fs", state.in_flight, grace)
        waiter = asyncio.ensure_future(state.wait_idle(grace))
        skip = asyncio.ensure_future(drain_now.wait())
        await asyncio.wait({waiter, skip}, return_when=asyncio.FIRST_COMPLETED)
        skip.cancel()
        if not (waiter.done() and waiter.result()):
            waiter.cancel()
            # Streams the router can resume are handed back (it continues them on another pod); the rest
            # are aborted when the listener closes.
            handed = await app[HANDOFF_KEY].hand_off(HANDOFF_WAIT_S)
            logger.warning(
                "drain ended with %d request(s) still in flight: %d stream(s) handed back, aborting the rest",
                state.in_flight,
                handed,
            )
        return 0
    finally:
        if state.watcher is not None:
            await state.watcher.stop()
        if state.kv_events is not None:
            await state.kv_events.stop()
        await runner.cleanup()  # cancels leftover handlers; their `finally` aborts them in the engine
        if engine is not None:
            await engine.shutdown()
        announce("tokenfleet: stopped")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The access log is already one JSON object per line: no prefix, so log shippers can parse it.
    access = logging.getLogger("tokenfleet.access")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.propagate = False


def main(argv: list[str] | None = None) -> int:
    startup_timing.mark("imports")
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"tokenfleet serve: {e}", file=sys.stderr)
        return 2
    startup_timing.mark("config")

    import uvloop

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        return uvloop.run(serve(config, announce=say, config_path=args.config, freeze_heap=True))
    except ConfigError as e:
        print(f"tokenfleet serve: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the port is taken
        print(
            f"tokenfleet serve: cannot listen on {config.server.host}:{config.server.port}: {e}",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
