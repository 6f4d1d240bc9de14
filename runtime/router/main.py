"""`tokenfleet route --config PATH`: run the cache-aware router."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from aiohttp import web
from tokenfleet.runtime.config_file import with_overrides
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.openai.translate import Tokenizer
from tokenfleet.runtime.router.app import build_app
from tokenfleet.runtime.router.config import RouterConfig


def load_tokenizer(source: str) -> Tokenizer:
    """The model's tokenizer, exactly as the pods build it: the same source resolution and checkpoint reader.

    Checkpoint weights are read lazily, so this touches only metadata; the loader module imports torch,
    which costs the router memory but guarantees identical tokenization (exact prefix matching needs it).
    """
    source_mod = importlib.import_module("tokenfleet.runtime.model.source")
    src = source_mod.resolve_source(source)  # before importing torch: a bad source fails fast
    loader = importlib.import_module("tokenfleet.runtime.model.loader")
    return loader.CHECKPOINT_LOADERS[src.kind](src.path).tokenizer


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenfleet route", description="Run the cache-aware router.")
    p.add_argument("--config", required=True, help="RouterConfig YAML (the operator's ConfigMap).")
    p.add_argument("--host", help="Override the config's host.")
    p.add_argument("--port", type=int, help="Override the config's port.")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = with_overrides(
            RouterConfig.load(args.config), {"host": args.host, "port": args.port}, "router config"
        )
    except ConfigError as e:
        print(f"tokenfleet route: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    app = build_app(config, load_tokenizer, config_path=args.config)
    # handler_cancellation: a client that hangs up cancels its request here at once, which closes the
    # upstream request (the pod aborts it and frees its KV) and frees its in-flight slot and queue place;
    # without it the router would notice only when it next wrote to that client — after the pod's first
    # token, or never for a request still queued or not streamed.
    web.run_app(app, host=config.host, port=config.port, print=None, handler_cancellation=True)
    return 0
