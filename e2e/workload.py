"""Real HTTP clients for the e2e scenarios: one completion, and a small bounded streaming load that
classifies every request the way a user would see it.

- `ok`: the stream ended with `data: [DONE]` and no error event;
- `failed_before_start`: an HTTP error or a broken connection before the first byte (a request the
  router should have retried elsewhere — this must never happen);
- `failed_in_flight`: the stream started, then ended with an error event or broke (a pod died under it and
  the router could not continue the stream on another pod).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parent.parent / "manifests" / "examples"
# A CPU pod's KV cache is allocated up front (1 GiB by default, which the examples keep): the tests give
# each pod 128 MiB so that a few replicas and a rollout's surge pod fit beside other work on a small machine.
TEST_KV_CACHE_GIB = 0.125


def examples_manifest(cluster: Any) -> str:
    """manifests/examples as `kubectl apply -k` would send them, with the test-sized KV cache."""
    docs = [d for d in yaml.safe_load_all(cluster.kubectl("kustomize", str(EXAMPLES))) if d]
    for doc in docs:
        if doc["kind"] == "CachePolicy":
            doc["spec"]["cpuKVCacheGiB"] = TEST_KV_CACHE_GIB
    return yaml.safe_dump_all(docs)


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def get_json(url: str, timeout: float = 10, headers: dict[str, str] | None = None) -> dict[str, Any]:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
        return json.loads(resp.read())


def complete(base: str, model: str, prompt: str = "The capital of France is", max_tokens: int = 3) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return post_json(f"{base}/v1/completions", body)[0]


def stream_once(base: str, model: str, prompt: str, max_tokens: int, timeout: float = 120) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(
        f"{base}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = False
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                started = True
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    return "ok"
                if line.startswith("data:") and '"error"' in line:
                    return "failed_in_flight"
            return "failed_in_flight"
    except (urllib.error.URLError, OSError, ValueError):
        return "failed_in_flight" if started else "failed_before_start"


@dataclass
class StreamingLoad:
    """`workers` threads each sending streaming requests back to back until `stop()` (or `max_requests`)."""

    base: str
    model: str
    workers: int = 2
    max_tokens: int = 16
    max_requests: int = 200
    results: Counter = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _loop(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set() and sum(self.results.values()) < self.max_requests:
            outcome = stream_once(
                self.base, self.model, f"Request {worker}-{n}: tell me a story about", self.max_tokens
            )
            with self._lock:
                self.results[outcome] += 1
            n += 1

    def start(self) -> StreamingLoad:
        for i in range(self.workers):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def wait_for_requests(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while sum(self.results.values()) < count and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> Counter:
        self._stop.set()
        for t in self._threads:
            t.join(180)
        return self.results
