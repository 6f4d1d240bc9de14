"""The clients of the chaos run (chaos.py): a steady mixed load as users send it, through whichever router
the router Service lists as ready, classified the way a user would see it.

Kinds: streamed and whole chat and completions (ignore_eos, so each answer must have exactly the tokens
asked for), structured outputs (a JSON schema; the answer must parse when it ends with `stop`), long
prompts (~900 tokens), and a tenth of all requests being streams that their client drops after three
events: each client's second stream and every sixth after it (streams are six tenths of the load), counted
rather than drawn so that a short run on a slow machine still has some. The clients retry like the OpenAI SDK: a request that fails before its first byte (connection
refused or reset, 408/409/429/5xx) is sent again twice, 0.5 s then 1 s later (or after Retry-After), to
another ready router when there is one (a gateway's previous-hosts retry rule); never after its first
byte. A request ends `ok`, `disconnected` (its client's choice) or `error` with the error's kind and detail.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from envtest import ControlPlane

MAX_RETRIES = 2  # the OpenAI SDK's default
REQUEST_TIMEOUT_S = 120
STORY = "The harbour town woke early; fishing boats went out past the lighthouse while the bakers "


# ------------------------------------------------------------------------------------------------ the API
class Api:
    """Plain GETs against the API server as the admin (cheaper than a kubectl process per poll)."""

    def __init__(self, plane: ControlPlane):
        self.server = plane.server
        self.token = plane.admin_token
        self.ssl = ssl.create_default_context(cafile=str(plane.ca_file))

    def get(self, path: str) -> dict[str, Any]:
        req = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=5, context=self.ssl) as resp:
            return json.loads(resp.read())

    def items(self, path: str) -> list[dict[str, Any]]:
        return self.get(path)["items"]


def ready(pod: dict[str, Any]) -> bool:
    conds = {c["type"]: c["status"] for c in (pod.get("status") or {}).get("conditions") or []}
    return conds.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp")


def metric(text: str, name: str, labels: str = "") -> float:
    """The sum of a Prometheus text family's samples whose labels contain `labels`."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def scrape(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as resp:
        return resp.read().decode()


# ---------------------------------------------------------------------------------------------- the routers
class RouterDirectory:
    """What the router Service lists as ready, refreshed every second (the last good list is kept while the
    API server is away, as kube-proxy keeps its rules), and the routers' resume counters, scraped every
    second and kept across a router's restarts (a new process counts from zero again)."""

    def __init__(self, api: Api, namespace: str, service: str):
        self.api = api
        self.ns = namespace
        self.service = service
        self.addresses: list[str] = []
        # router pod IP -> (counts of its earlier processes, its current process's counts)
        self._counts: dict[str, tuple[Counter, Counter]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._next = 0
        self._lock = threading.Lock()

    def start(self) -> RouterDirectory:
        self._refresh()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._scrape()

    def pick(self, avoid: str | None = None) -> str | None:
        """The next ready router, not `avoid` (the one that just failed) when there is another: the retry
        rule of a gateway in front (Envoy's previous-hosts predicate)."""
        with self._lock:
            choices = [a for a in self.addresses if a != avoid] or self.addresses
            if not choices:
                return None
            self._next += 1
            return choices[self._next % len(choices)]

    def counts(self) -> Counter:
        """`resumes` and `failure:<reason>` summed over every router process seen (a killed router's last
        second is lost: at least these)."""
        total = Counter()
        for banked, current in self._counts.values():
            total += banked + current
        return total

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self._refresh()
            self._scrape()

    def _refresh(self) -> None:
        path = (
            f"/apis/discovery.k8s.io/v1/namespaces/{self.ns}/endpointslices"
            f"?labelSelector=kubernetes.io/service-name={self.service}"
        )
        try:
            slices = self.api.items(path)
        except (OSError, ValueError):
            return
        found = sorted(
            addr
            for s in slices
            for ep in s.get("endpoints") or []
            if (ep.get("conditions") or {}).get("ready")
            for addr in ep["addresses"]
        )
        with self._lock:
            self.addresses = found

    def _scrape(self) -> None:
        for ip in list(self.addresses):
            try:
                text = scrape(f"http://{ip}:8080", timeout=2)
            except OSError:
                continue
            now = Counter({"resumes": int(metric(text, "tokenfleet:router_resumes_total"))})
            for m in re.finditer(
                r'^tokenfleet:router_resume_failures_total\{[^}]*reason="([^"]+)"[^}]*\} ([0-9.e+-]+)$',
                text,
                re.M,
            ):
                now[f"failure:{m.group(1)}"] += int(float(m.group(2)))
            banked, last = self._counts.get(ip, (Counter(), Counter()))
            if any(now[k] < v for k, v in last.items()):  # a new process: its counters started over
                banked = banked + last
            self._counts[ip] = (banked, now)


# ---------------------------------------------------------------------------------------------- the clients
@dataclass
class Record:
    kind: str
    started: float
    router: str | None = None
    ended: float | None = None
    outcome: str | None = None  # ok | disconnected | error
    error: str | None = None  # the error's kind
    detail: str = ""
    retries: int = 0


class Failed(Exception):
    def __init__(self, kind: str, detail: str, retryable: bool, retry_after: float | None = None):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.retryable, self.retry_after = kind, detail, retryable, retry_after


def _body(kind: str, rng: random.Random, n: int) -> tuple[str, dict[str, Any], int | None]:
    """(path, body, completion tokens the answer must have or None) for one request of `kind`."""
    topic = rng.choice(["harbour", "lighthouse", "bakery", "market", "school", "river"])
    if kind == "long":
        prompt = f"Request {n}. " + STORY * 36 + f"Tell me about the {topic}."  # ~900 tokens
        return "/v1/completions", {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}, 6
    if kind == "structured":
        schema = {
            "type": "object",
            "properties": {"place": {"type": "string"}, "rating": {"type": "integer"}},
            "required": ["place", "rating"],
        }
        body = {
            "messages": [{"role": "user", "content": f"Rate the {topic} as JSON."}],
            "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "rating", "schema": schema}},
        }
        return "/v1/chat/completions", body, None
    tokens = rng.randint(12, 32)
    if kind.startswith("chat"):
        msgs = [{"role": "user", "content": f"Request {n}: tell me a story about the {topic}."}]
        return "/v1/chat/completions", {"messages": msgs, "max_tokens": tokens, "ignore_eos": True}, tokens
    prompt = f"Request {n}: a story about the {topic}. Once upon a time"
    return "/v1/completions", {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True}, tokens


KINDS = {  # kind -> weight
    "chat_stream": 3,
    "completion_stream": 3,
    "chat": 1,
    "completion": 1,
    "structured": 1,
    "long": 1,
}


def _http_error(e: urllib.error.HTTPError) -> Failed:
    try:
        message = json.loads(e.read() or b"{}").get("error", {}).get("message", "")
    except (ValueError, AttributeError, OSError):
        message = ""
    retry_after = e.headers.get("retry-after")
    return Failed(
        f"http_{e.code}",
        message[:160],
        e.code in (408, 409, 429) or e.code >= 500,
        float(retry_after) if retry_after and retry_after.replace(".", "", 1).isdigit() else None,
    )


def _send(url: str, body: dict[str, Any], stream: bool, disconnect: bool) -> tuple[str, dict]:
    """One attempt. Returns ("ok" | "disconnected", the final JSON or the stream's usage). Raises Failed:
    retryable only before the response's status line came (the SDK's rule)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    answered = False
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            answered = True
            if not stream:
                return "ok", json.loads(resp.read())
            usage: dict = {}
            events = 0
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                if line == "data: [DONE]":
                    return "ok", usage
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise Failed("error_event", str(chunk["error"].get("message", ""))[:160], False)
                usage = chunk.get("usage") or usage
                events += 1
                if disconnect and events >= 3:
                    return "disconnected", {}
            raise Failed("broken_stream", f"ended after {events} events without [DONE]", False)
    except urllib.error.HTTPError as e:
        raise _http_error(e) from None
    # Refused, reset, timed out, a cut chunked body (http.client's IncompleteRead is no OSError).
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise Failed("broken_stream" if answered else "connect", repr(e)[:160], not answered) from None


@dataclass
class ChaosLoad:
    """`workers` client threads sending requests back to back, each from its own seeded generator."""

    routers: RouterDirectory
    model: str
    workers: int = 4
    seed: int = 0
    disconnect_every: int = 6  # streams per abandoned stream: 6/10 of requests are streams, so a tenth
    records: list[Record] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> ChaosLoad:
        for w in range(self.workers):
            t = threading.Thread(target=self._loop, args=(w,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = REQUEST_TIMEOUT_S * 2) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            raise TimeoutError(f"requests still running {timeout}s after stop(): {self.outcomes()}")

    def outcomes(self) -> Counter:
        with self._lock:
            return Counter(r.error or r.outcome for r in self.records if r.outcome)

    def served_since(self, moment: float) -> bool:
        with self._lock:
            return any(r.outcome == "ok" and r.started >= moment for r in self.records)

    def _loop(self, worker: int) -> None:
        rng = random.Random(self.seed * 1000 + worker)
        kinds, weights = zip(*KINDS.items(), strict=True)
        n = streams = 0
        while not self._stop.is_set():
            kind = rng.choices(kinds, weights)[0]
            disconnect = False
            if kind.endswith("_stream"):
                disconnect = streams % self.disconnect_every == 1
                streams += 1
            record = Record(kind, time.monotonic())
            with self._lock:
                self.records.append(record)
            try:
                self._one(record, rng, f"{worker}-{n}", disconnect)
            except Exception as e:  # a client bug must show in the table, not end this client silently
                with self._lock:
                    record.ended, record.outcome, record.error = time.monotonic(), "error", "client_bug"
                    record.detail = repr(e)[:160]
            n += 1

    def _one(self, record: Record, rng: random.Random, n: str, disconnect: bool) -> None:
        path, body, expected = _body(record.kind, rng, n)
        stream = record.kind.endswith("_stream")
        body = {"model": self.model, "temperature": 0, **body}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        attempt = 0
        while True:
            router = self.routers.pick(avoid=record.router)
            record.router = router
            try:
                if router is None:
                    raise Failed("no_router", "the router Service lists no ready router", True)
                outcome, out = _send(f"http://{router}:8080{path}", body, stream, disconnect)
                self._check(record, out, expected, outcome)
                break
            except Failed as f:
                if f.retryable and attempt < MAX_RETRIES and not self._stop.is_set():
                    attempt += 1
                    record.retries = attempt
                    # The SDK's back-off: 0.5 s doubling, with jitter, or the server's Retry-After.
                    time.sleep(
                        f.retry_after
                        if f.retry_after is not None
                        else 0.5 * 2 ** (attempt - 1) * rng.uniform(0.75, 1)
                    )
                    continue
                with self._lock:
                    record.ended, record.outcome, record.error, record.detail = (
                        time.monotonic(),
                        "error",
                        f.kind,
                        f.detail,
                    )
                return

    def _check(self, record: Record, out: dict, expected: int | None, outcome: str) -> None:
        """Whole and correct: as many tokens as asked for (ignore_eos), a structured answer that parses."""
        error = detail = None
        if outcome == "ok":
            usage = out.get("usage") or out
            if expected is not None and usage.get("completion_tokens") != expected:
                error, detail = "wrong_length", f"{usage.get('completion_tokens')} tokens, asked {expected}"
            if record.kind == "structured":
                choice = out["choices"][0]
                if choice.get("finish_reason") == "stop":
                    try:
                        json.loads(choice["message"]["content"])
                    except ValueError:
                        error, detail = "invalid_json", choice["message"]["content"][:160]
        with self._lock:
            record.ended = time.monotonic()
            record.outcome = "error" if error else outcome
            record.error, record.detail = error, detail or ""
