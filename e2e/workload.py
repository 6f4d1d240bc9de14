"""Real HTTP clients for the e2e scenarios: one completion, and a small bounded streaming load that
classifies every request the way a user would see it.

- `ok`: the stream ended with `data: [DONE]` and no error event;
- `failed_before_start`: an HTTP error or a broken connection before the first byte (a request the
  router should have retried elsewhere — this must never happen);
- `failed_in_flight`: the stream started, then ended with an error event or broke (a pod died under it and
  the router could not continue the stream on another pod).

Each stream is also recorded (`Stream`: the pod the router sent it to, when it started and ended), so a test
can show that a pod it removed was holding streams at that moment — a lossless removal proved, not assumed.
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
# A stream's client gives up after this long without a byte (urllib's socket timeout).
STREAM_TIMEOUT_S = 120
# stop() lets the streams in flight finish (tens to a few hundred tokens here: seconds to a minute on a busy
# CPU) and fails when one still runs after this.
STOP_TIMEOUT_S = 180


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


@dataclass
class Stream:
    """One streaming request as the client saw it. Written by its worker thread only."""

    prompt: str
    started: float  # time.monotonic() before the request was sent
    endpoint: str | None = None  # the pod the router chose (x-tokenfleet-endpoint), once the headers came
    events: int = 0  # data events received so far (one per token, as pods send them)
    first_event: float | None = None  # time.monotonic() when the first data event came
    ended: float | None = None  # None while in flight
    outcome: str | None = None


def stream_once(
    base: str,
    model: str,
    prompt: str,
    max_tokens: int,
    timeout: float = STREAM_TIMEOUT_S,
    record: Stream | None = None,
) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(
        f"{base}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = False
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if record is not None:
                record.endpoint = resp.headers.get("x-tokenfleet-endpoint")
            for raw in resp:
                started = True
                line = raw.decode().strip()
                if record is not None and line.startswith("data:"):
                    record.events += 1
                    if record.first_event is None:
                        record.first_event = time.monotonic()
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
    streams: list[Stream] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _loop(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set() and self.count() < self.max_requests:
            record = Stream(f"Request {worker}-{n}: tell me a story about", time.monotonic())
            with self._lock:
                self.streams.append(record)
            outcome = stream_once(self.base, self.model, record.prompt, self.max_tokens, record=record)
            with self._lock:
                record.ended, record.outcome = time.monotonic(), outcome
                self.results[outcome] += 1
            n += 1

    def start(self) -> StreamingLoad:
        for _ in range(self.workers):
            self._spawn()
        return self

    def add_worker(self) -> None:
        """One more worker, started now (a test can let the router see the load so far first)."""
        self.workers += 1
        self._spawn()

    def _spawn(self) -> None:
        t = threading.Thread(target=self._loop, args=(len(self._threads),), daemon=True)
        t.start()
        self._threads.append(t)

    def count(self) -> int:
        """Requests finished so far, whatever their outcome."""
        with self._lock:
            return sum(self.results.values())

    def wait_for_requests(self, count: int, timeout: float = 120) -> None:
        """Until `count` requests have finished; raises TimeoutError (with the outcomes) if they do not."""
        deadline = time.monotonic() + timeout
        while self.count() < count:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{count} requests not finished after {timeout}s: {dict(self.results)}")
            time.sleep(0.2)

    def in_flight(self) -> list[Stream]:
        """Streams sent and not finished, whose pod is known."""
        with self._lock:
            return [s for s in self.streams if s.ended is None and s.endpoint is not None]

    def served_after(self, endpoint: str, moment: float) -> list[Stream]:
        """The streams `endpoint` still served after `moment`: those in flight then, and any sent later."""
        with self._lock:
            return [
                s for s in self.streams if s.endpoint == endpoint and (s.ended is None or s.ended > moment)
            ]

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> Counter:
        """Ends the load: the streams in flight run to their end. Raises TimeoutError when one is still
        running after `timeout` seconds (a hung stream is a failure, not something to step over)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            raise TimeoutError(f"streams still running {timeout}s after stop(): {dict(self.results)}")
        return self.results
