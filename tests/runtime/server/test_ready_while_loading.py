"""While the model loads, /ready answers 503 "loading" with how far start-up is (phases, weights' percent),
and the pod log shows the weights coming in: a slow load is seen moving, not only waited on."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request

from tokenfleet.runtime import startup_timing
from tokenfleet.runtime.engine.async_engine import AsyncEngine
from tokenfleet.runtime.engine.engine_core import EngineCore

from .conftest import ServerThread, real_config


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_ready_reports_the_load_progress_until_the_engine_serves(loaded_model, caplog):
    startup_timing.reset()
    halfway, release = threading.Event(), threading.Event()

    def factory(cfg):
        for done in range(1, 5):  # what the loader reports as each tensor is copied in
            startup_timing.weights(done, 10)
        halfway.set()
        assert release.wait(60)
        return AsyncEngine(EngineCore(cfg, loaded=loaded_model))

    with caplog.at_level(logging.INFO, logger="tokenfleet.startup"):
        server = ServerThread(real_config(), factory)
        threading.Thread(target=server.start, daemon=True).start()
        assert halfway.wait(60)
        deadline = time.monotonic() + 30
        while not any("listening on" in line for line in server.lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        url = re.search(r"http://\S+?(?=;)", next(x for x in server.lines if "listening on" in x)).group(0)
        try:
            status, body = _get(url + "/ready")
            assert status == 503 and body["status"] == "loading"
            assert body["progress"]["weights"] == {"done": 4, "total": 10, "percent": 40}
            assert "listen" in body["progress"]["phases_done"] and body["progress"]["seconds"] >= 0
            release.set()
            deadline = time.monotonic() + 60
            while _get(url + "/ready")[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            status, body = _get(url + "/ready")
            assert status == 200 and body["status"] == "ready" and "progress" not in body
        finally:
            release.set()
            server.stop()
    logged = [r.getMessage() for r in caplog.records if r.name == "tokenfleet.startup"]
    assert "loading weights: 1/10 tensors (10%)" in logged and "loading weights: 4/10 tensors (40%)" in logged
