"""The router's HTTP face: an OpenAI-compatible aiohttp app in front of the fleet.

Per generation request: auth (API key -> tier) -> parse -> model targets (404 when nothing serves the model;
a split decided by the session's draw) -> priority (what the client asks, bounded by the key's tier -> the
one priority number, lower = sooner) -> tokenize the prompt as the pod will -> rate limit (429 +
Retry-After, x-ratelimit-* headers) -> the queue (the request waits in the router while no candidate
endpoint can take it: all loading, ejected or at their in-flight limit; ordered by priority, then the
tenant's fair share when on; a fallback instead when the primary is over its `maxQueued`; 503 +
Retry-After or 429 when its deadline passes) -> `proxy.forward`.
Also `/v1/models` (the union of the backends' lists plus route names), `/v1/config` (the config in effect,
what a file change would need a restart for, the generation applied, each endpoint's state: in rotation,
ejected, asleep, waking), `/v1/ratelimit/usage` (what this router admitted per key digest, for its peers
only: quota_peers.py), `/health` (the router itself is up), `/ready` (some endpoint takes traffic),
`/metrics`.

With a config file, the router watches it (a ConfigMap update swaps it in place) and applies the live
fields at once (`RouterConfig` LIVE_FIELDS): policy, backends, keys. Endpoints of unchanged backends keep
their prefix index; requests in flight keep the route they have.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from aiohttp import web
from tokenfleet.runtime.config_watch import ConfigWatcher
from tokenfleet.runtime.openai.translate import Tokenizer
from tokenfleet.runtime.router import disaggregation
from tokenfleet.runtime.router.api_keys import KeyTiers
from tokenfleet.runtime.router.config import LIVE_FIELDS, RESTART_FIELDS, Backend, RouterConfig
from tokenfleet.runtime.router.decision import AT_CAPACITY, NO_READY_ENDPOINT, refusal_status
from tokenfleet.runtime.router.endpoints import EndpointSliceWatch, static_urls
from tokenfleet.runtime.router.fleet import Fleet, PromptKey
from tokenfleet.runtime.router.metrics import RouterMetrics
from tokenfleet.runtime.router.model_routes import (
    RouteTarget,
    route_of,
    served_models,
    session_draw,
    split_draws,
)
from tokenfleet.runtime.router.pod_auth import PodAuth
from tokenfleet.runtime.router.pod_tokenizers import BackendTokenizer
from tokenfleet.runtime.router.priority import QueueFull, QueueTimeout
from tokenfleet.runtime.router.priority_classes import PriorityClasses, PriorityError
from tokenfleet.runtime.router.prompt_blocks import prompt_text, prompt_token_ids
from tokenfleet.runtime.router.quota_peers import USAGE_PATH, QuotaPeers
from tokenfleet.runtime.router.ratelimit import RateLimiter, retry_after_header
from tokenfleet.runtime.router.upstream import Outgoing, TokenMeter, error_body, request_headers

log = logging.getLogger(__name__)

PEERS_WATCH = "#peers"  # the key of the peers' EndpointSlice watch (never a backend name: those have no '#')

TokenizerLoader = Callable[[str], Tokenizer | None]


def _without_adapters(backend: Backend) -> Backend:
    return backend.model_copy(update={"adapters": ()})


class RouterApp:
    """State of one router process; started on app startup (it needs the running loop)."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer_loader: TokenizerLoader | None,
        config_path: str | Path | None = None,
    ) -> None:
        self.config = config
        self.config_path = Path(config_path) if config_path is not None else None
        self.metrics = RouterMetrics()
        self.limiter = RateLimiter(config.routing.rate_limits)
        self.keys = KeyTiers(config.api_keys, config.api_key_file)
        self._set_classes(config)
        self._tokenizer_loader = tokenizer_loader
        self.tokenizers: dict[str, Tokenizer | None] = {}  # by model
        # Requests in flight on a fallback because their primary had no ready endpoint, by the primary's model.
        self.displaced: collections.Counter[str] = collections.Counter()
        self._built_tokenizers: dict[str, Tokenizer] = {}  # by digest, fetched from pods
        self._backend_tokenizers: dict[str, tuple[BackendTokenizer, asyncio.Task]] = {}  # by backend
        self.pod_auth = PodAuth()
        self.quota_peers: QuotaPeers | None = None
        self._peer_task: asyncio.Task | None = None
        self.fleet: Fleet | None = None
        self.watcher: ConfigWatcher | None = None
        self._session: aiohttp.ClientSession | None = None
        self._watches: dict[str, EndpointSliceWatch] = {}
        self.metrics.config_generation.set(config.generation if config.generation is not None else -1)

    def _set_classes(self, config: RouterConfig) -> None:
        self.classes = PriorityClasses(config.routing.priority_classes)

    async def start(self) -> None:
        # No connection cap: the router's own in-flight limits bound the load; a pool cap would queue blindly.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=10)
        # Every call to a pod goes through `pod_auth`: it sends the backend's internal key, reports 401s.
        self.pod_auth.set_backends(list(self.config.backends))
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, middlewares=(self.pod_auth.middleware,)
        )
        self.fleet = Fleet(self.config, self.metrics, self._session, self.pod_auth)
        for backend in self.config.backends:
            self._start_backend(backend)
        self._start_peers()
        if self.config_path is not None:
            # The watcher compares against the file as read (command-line overrides are restart-only).
            self.watcher = ConfigWatcher(
                self.config_path,
                self.apply_config,
                schema=RouterConfig,
                live_fields=LIVE_FIELDS,
                what="router config",
            )
            self.watcher.start()

    def _start_peers(self) -> None:
        """Share rate-limit spending with the other replicas, when there are any to find."""
        peers = self.config.peers
        if not peers.urls and peers.service is None:
            return
        assert self._session is not None
        quota = self.quota_peers = QuotaPeers(self.limiter, self._session, peers.interval_seconds)
        quota.set_urls(peers.urls)
        if peers.service is not None and self.config.discovery.mode == "kubernetes":
            namespace = self.config.discovery.namespace or "default"
            service = Backend(
                name=peers.service, model="", url=f"http://{peers.service}.{namespace}.svc:{peers.port}"
            )
            # Ready peers only, unlike backends: the usage exchange has no probe of its own to tell a
            # peer that is not serving yet, and a router not ready yet has admitted nothing to share.
            watch = EndpointSliceWatch(
                service,
                namespace,
                lambda _, urls: quota.set_urls([*peers.urls, *urls]),
                asyncio.get_running_loop(),
                read_roles=False,
                ready_only=True,
            )
            watch.start()
            self._watches[PEERS_WATCH] = watch
        self._peer_task = asyncio.create_task(quota.run())

    def _start_backend(self, backend: Backend) -> None:
        assert self.fleet is not None and self._session is not None
        # Tokenizers arrive in the background (from the pods, or a local checkpoint's metadata): the router
        # serves at once with the approximate index and turns exact as each backend's tokenizer arrives.
        fleet = self.fleet

        def on_tokenizer(tok: Tokenizer | None, model: str = backend.model) -> None:
            if tok is not None or model not in self.tokenizers:
                self.tokenizers[model] = tok

        follower = BackendTokenizer(
            backend,
            self._session,
            lambda: fleet.endpoints.of_backends([backend.name]),
            self._built_tokenizers,
            on_tokenizer,
            self._tokenizer_loader,
            _in_daemon_thread,
        )
        self._backend_tokenizers[backend.name] = (follower, asyncio.create_task(follower.run()))
        if self.config.discovery.mode == "static":
            self.fleet.sync_backend(backend, static_urls(backend))
        else:
            watch = EndpointSliceWatch(
                backend, self.config.discovery.namespace, self.fleet.sync_backend, asyncio.get_running_loop()
            )
            watch.start()
            self._watches[backend.name] = watch

    def _stop_backend(self, backend: Backend) -> None:
        assert self.fleet is not None
        watch = self._watches.pop(backend.name, None)
        if watch is not None:
            watch.stop()
        follower = self._backend_tokenizers.pop(backend.name, None)
        if follower is not None:
            follower[1].cancel()
        self.fleet.remove_backend(backend)

    def apply_config(self, old: RouterConfig, new: RouterConfig) -> None:
        """A live config change (the watcher's callback): policy, backends and keys, without a restart.

        Raises (and changes nothing) when the new key file cannot be read: the watcher keeps the old config.
        """
        assert self.fleet is not None
        new = new.model_copy(update={f: getattr(self.config, f) for f in RESTART_FIELDS})
        self.keys.update(new.api_keys, new.api_key_file)
        self.pod_auth.set_backends(list(new.backends))
        previous, self.config = self.config, new
        self.limiter.set_limits(new.routing.rate_limits)
        self._set_classes(new)
        self.fleet.apply(new)
        # A backend whose adapter list alone changed keeps its endpoints, their health and its prefix state:
        # the list is read per request from the config, nothing its watch or tokenizer follows depends on it.
        before = {b.name: _without_adapters(b) for b in previous.backends}
        after = {b.name: _without_adapters(b) for b in new.backends}
        for name, backend in before.items():
            if after.get(name) != backend:
                self._stop_backend(backend)
        for name, backend in after.items():
            if before.get(name) != backend:
                self._start_backend(next(b for b in new.backends if b.name == name))
        served = {b.model for b in new.backends}
        for model in [m for m in self.tokenizers if m not in served]:
            del self.tokenizers[model]
        self.metrics.config_generation.set(new.generation if new.generation is not None else -1)
        self.metrics.config_reloads.inc()
        log.info("router config applied live (generation %s)", new.generation)

    async def tokenizers_loaded(self) -> None:
        """Wait until every backend's tokenizer has been tried once (loaded, or failed to)."""
        for follower, _ in list(self._backend_tokenizers.values()):
            await follower.first_attempt.wait()

    def tokenizer_states(self) -> dict[str, dict]:
        """Per backend: ok / fetching / error, where from, the digest, and why not."""
        return {name: f.status.to_json() for name, (f, _) in sorted(self._backend_tokenizers.items())}

    async def stop(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        tasks = [t for _, t in self._backend_tokenizers.values()]
        if self._peer_task is not None:
            tasks.append(self._peer_task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in self._watches.values():
            w.stop()
        if self.fleet is not None:
            await self.fleet.close()
        if self._session is not None:
            await self._session.close()

    # --- request admission -------------------------------------------------------------------------

    def identity(self, request: web.Request) -> tuple[str, str]:
        """(rate-limit key, tier); raises 401 when keys are configured and the request has no valid one."""
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if self.keys.enabled:
            tier = self.keys.tier_of(token)
            if token is None or tier is None:
                raise _json_error(
                    401, "invalid or missing API key", "authentication_error", "invalid_api_key"
                )
            return token, tier
        return (f"key:{token}" if token else f"addr:{request.remote}"), "default"

    def tenant(self, request: web.Request, key: str) -> str:
        """Whose share a request counts against: the configured tenant header's value, else the API key."""
        header = self.config.routing.fair_share.tenant_header
        named = request.headers.get(header) if header is not None else None
        return f"tenant:{named}" if named else key

    def priority(self, request: web.Request, tier: str, payload: dict) -> int:
        """The request's priority number (lower = sooner): the one place a class name becomes a number,
        bounded by the key's tier (priority_classes.py)."""
        header = request.headers.get(self.config.routing.priority_header)
        try:
            resolved = self.classes.resolve(tier, self.keys.enabled, header, payload)
        except PriorityError as e:
            raise _json_error(400, str(e), "invalid_request_error", "invalid_value", param=e.param) from e
        if resolved.lowered:
            self.metrics.priority_lowered.inc()
        return resolved.priority

    def config_snapshot(self) -> dict:
        """What `/v1/config` shows; API keys are counted, never shown."""
        if self.watcher is not None:
            snap = self.watcher.snapshot()
        else:
            snap = {"pending_restart": [], "restart_required": False, "reloads": 0, "last_error": None}
        effective = self.config.model_dump(mode="json")
        effective["api_keys"] = f"<{len(self.config.api_keys)} keys>"
        for change in snap["pending_restart"]:
            if change["path"] == "api_keys":
                change["running"] = change["file"] = "<redacted>"
        return {
            **snap,
            "effective": effective,
            "generation": self.config.generation,
            "config_file": str(self.config_path) if self.config_path is not None else None,
            "live_fields": sorted(LIVE_FIELDS),
            "tokenizers": self.tokenizer_states(),
            "pod_auth": self.pod_auth.state(),
            "quota_peers": self.quota_peers.state() if self.quota_peers is not None else None,
            "endpoints": self.fleet.endpoint_states() if self.fleet is not None else {},
            "restart_fields": list(RESTART_FIELDS),
        }


def _json_error(
    status: int, message: str, type_: str, code: str | None = None, headers=None, param: str | None = None
) -> web.HTTPException:
    exc_type = web.HTTPException
    for cls in (
        web.HTTPBadRequest,
        web.HTTPUnauthorized,
        web.HTTPForbidden,
        web.HTTPNotFound,
        web.HTTPTooManyRequests,
        web.HTTPServiceUnavailable,
    ):
        if cls.status_code == status:
            exc_type = cls
    return exc_type(
        text=json.dumps(error_body(message, type_, code, param)),
        content_type="application/json",
        headers=headers,
    )


ROUTER = web.AppKey("router", RouterApp)
RATE_HEADERS = web.RequestKey("rate_headers", tuple)


async def _add_rate_headers(request: web.Request, response: web.StreamResponse) -> None:
    """OpenAI's x-ratelimit-* headers on every reply to a rate-limited request: success, 429 and errors,
    streamed or not (the hook runs when any response's headers go out)."""
    for name, value in request.get(RATE_HEADERS, ()):
        response.headers[name] = value


def _in_daemon_thread(fn, *args) -> asyncio.Future:
    """Run a blocking call off the loop in a daemon thread.

    Not `asyncio.to_thread`: interpreter exit joins executor threads, so a SIGTERM during a slow tokenizer
    load (importing torch takes tens of seconds on a busy node) would hold the router's shutdown hostage.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="tokenizer-load", daemon=True).start()
    return fut


async def handle_generate(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    fleet = router.fleet
    assert fleet is not None
    key, tier = router.identity(request)
    body = await request.read()
    try:
        payload = json.loads(body)
        if not isinstance(payload, dict):
            raise ValueError("not an object")
    except ValueError as e:
        raise _json_error(400, f"request body must be a JSON object: {e}", "invalid_request_error") from e
    models = served_models(router.config.routing, router.config.backends)
    model = payload.get("model") or (models[0] if len(models) == 1 else None)
    if not isinstance(model, str):
        raise _json_error(400, "`model` is required", "invalid_request_error", "model")
    session_key = request.headers.get(router.config.routing.session_header) or _str_or_none(
        payload.get("user")
    )
    # One draw per request decides its route's splits, every time the targets are resolved again.
    draw = session_draw(session_key) if session_key is not None else random.random()
    targets = fleet.targets(model, draw)
    if not targets:
        raise _json_error(404, f"model {model!r} does not exist", "invalid_request_error", "model_not_found")
    payload["model"] = model
    priority = router.priority(request, tier, payload)
    if "priority" in payload:  # the pod prefers the body's over the header's: make it the router's number
        payload["priority"] = priority

    tokenizer = router.tokenizers.get(targets[0].model)
    token_ids = prompt_token_ids(request.path, body, tokenizer) if tokenizer is not None else None
    salt = payload.get("cache_salt") if isinstance(payload.get("cache_salt"), str) else None
    text = prompt_text(payload) if token_ids is None else ""
    # A LoRA adapter's blocks are hashed apart from its base model's (with the key its pods report).
    adapter = model if any(model in b.adapters for b in router.config.backends) else None
    prompt = PromptKey(tuple(token_ids) if token_ids is not None else None, text, salt, adapter)
    num_prompt_tokens = len(token_ids) if token_ids is not None else max(len(prompt_text(payload)) // 4, 1)

    rate = router.limiter.check(key, tier, num_prompt_tokens, time.monotonic())
    request[RATE_HEADERS] = rate.headers  # on the reply whatever it is (see _add_rate_headers)
    if not rate.allowed:
        router.metrics.rate_limited.labels(rate.kind or "unknown").inc()
        router.metrics.requests.labels(model, "429").inc()
        raise _json_error(
            429, f"rate limit exceeded ({rate.kind} per minute)", "rate_limit_error", "rate_limit_exceeded",
            headers={"Retry-After": retry_after_header(rate.retry_after)},
        )  # fmt: skip

    tenant = router.tenant(request, key)
    fleet.fair.join(tenant)  # waiting or in flight, it is an active tenant until it leaves
    try:
        routing = router.config.routing
        # Held requests count under the model the chosen backends serve, not the alias the client sent: that
        # is the deployment whose autoscaler must see the demand (an alias wakes a deployment at zero).
        pending_key = targets[0].model
        arrived = time.monotonic()
        spill = await _admit(router, model, draw, priority, tenant, pending_key)
        router.metrics.queue_wait_seconds.labels(model).observe(time.monotonic() - arrived)
        targets = spill if spill is not None else fleet.targets(model, draw)
        if not targets:
            raise _json_error(
                404, f"model {model!r} does not exist", "invalid_request_error", "model_not_found"
            )
        # Output is charged to fair share as it streams (the queue's next pick sees service in flight), and
        # settled to the exact count at the end.
        meter = TokenMeter(lambda n: fleet.fair.charge_output(tenant, n, tier))
        out = Outgoing(
            path=request.path,
            payload=payload,
            stream=bool(payload.get("stream")),
            headers=request_headers(request.headers, priority, tenant),
            targets=tuple(targets),
            prompt=prompt,
            session_key=session_key,
            adapter=adapter,
            meter=meter,
        )
        # Served by a fallback because the primary has no ready endpoint (scaled to zero, or all ejected):
        # the request still counts as the primary's demand while it runs, or the primary would never wake.
        primary = [t for t in fleet.targets(model, draw) if not t.fallback]
        displaced = bool(primary) and not fleet.healthy_endpoints(primary)
        if displaced:
            router.displaced[pending_key] += 1
        try:
            fleet.fair.charge_prompt(tenant, num_prompt_tokens, tier)
            # Disaggregated, or the plain proxy.
            resp, outcome = await disaggregation.forward(request, fleet, out, routing.retries)
        finally:
            if displaced:
                router.displaced[pending_key] -= 1
        router.limiter.charge_tokens(key, tier, outcome.completion_tokens, time.monotonic())
        meter.settle(outcome.completion_tokens)
        router.metrics.requests.labels(model, str(outcome.status)).inc()
        return resp
    finally:
        fleet.fair.leave(tenant)


async def _admit(
    router: RouterApp, model: str, draw: float, priority: int, tenant: str, pending_key: str
) -> list[RouteTarget] | None:
    """Wait in the queue until a target can take the request; the fallbacks to use instead when the primary
    is over its `maxQueued` or the queue is full and a fallback can take it now. Raises the 429 or 503."""
    fleet = router.fleet
    assert fleet is not None
    routing = router.config.routing
    spill = _spill_to_fallback(fleet, model, draw, pending_key)
    try:
        if spill is None:
            # Targets are resolved again on every wake-up: a live policy change applies to waiting requests.
            # While it waits, a sleeping pod is woken when no endpoint of its targets is available (wake.py).
            with fleet.waker.held(lambda: fleet.targets(model, draw)):
                await fleet.gate.wait_for(
                    lambda: fleet.has_capacity(fleet.targets(model, draw)),
                    priority,
                    routing.queue_timeout_seconds,
                    pending_key,
                    tenant,
                )
    except QueueFull as e:
        spill = _fallbacks_now(fleet, fleet.targets(model, draw))
        if spill is None:
            router.metrics.requests.labels(model, "429").inc()
            raise _json_error(
                429, str(e), "rate_limit_error", "overloaded",
                headers={"Retry-After": retry_after_header(e.retry_after)},
            ) from e  # fmt: skip
    except QueueTimeout as e:
        targets = fleet.targets(model, draw)
        # 429 when endpoints were up but all at their in-flight limit, 503 when none was ready.
        why = AT_CAPACITY if fleet.healthy_endpoints(targets) else NO_READY_ENDPOINT
        if refusal_status(why) == 429:
            router.metrics.requests.labels(model, "429").inc()
            raise _json_error(
                429, "all endpoints are at capacity; retry later", "rate_limit_error", "overloaded",
                headers={"Retry-After": retry_after_header(e.retry_after)},
            ) from e  # fmt: skip
        router.metrics.requests.labels(model, "503").inc()
        raise _json_error(
            503, f"no ready endpoint serves {model!r}", "service_unavailable", "no_healthy_endpoint",
            headers={"Retry-After": retry_after_header(fleet.retry_after(targets))},
        ) from e  # fmt: skip
    return spill


def _fallbacks_now(fleet: Fleet, targets: list[RouteTarget]) -> list[RouteTarget] | None:
    """The fallback targets when one of them can take a request now (the primary is passed over)."""
    fallbacks = [t for t in targets if t.fallback]
    return fallbacks if fallbacks and fleet.has_capacity(fallbacks) else None


def _spill_to_fallback(fleet: Fleet, model: str, draw: float, pending_key: str) -> list[RouteTarget] | None:
    """Fallbacks to use at once because the route's primary cannot take the request now and has
    `maxQueued` requests waiting already."""
    route = route_of(model, fleet.config.routing)
    if route is None or route.max_queued is None or fleet.gate.num_waiting(pending_key) < route.max_queued:
        return None
    targets = fleet.targets(model, draw)
    if fleet.has_capacity([t for t in targets if not t.fallback]):
        return None
    return _fallbacks_now(fleet, targets)


def _str_or_none(v) -> str | None:
    return v if isinstance(v, str) and v else None


async def handle_models(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    fleet = router.fleet
    assert fleet is not None
    router.identity(request)
    eps = [ep for ep in fleet.endpoints.by_id.values() if fleet.available(ep)]

    async def models_of(url: str) -> list[dict]:
        try:
            async with fleet.session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                return list((await r.json()).get("data", [])) if r.status == 200 else []
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return []

    merged: dict[str, dict] = {}
    for data in await asyncio.gather(*(models_of(ep.url) for ep in eps)):
        for m in data:
            if isinstance(m, dict) and "id" in m:
                merged.setdefault(m["id"], m)
    # An alias is listed while some request for it can be served: any side of a split, or a fallback.
    draws = split_draws(router.config.routing)
    for route in router.config.routing.model_routes:
        if any(fleet.healthy_endpoints(fleet.targets(route.model, draw)) for draw in draws):
            merged.setdefault(
                route.model, {"id": route.model, "object": "model", "created": 0, "owned_by": "tokenfleet"}
            )
    return web.json_response({"object": "list", "data": [merged[k] for k in sorted(merged)]})


async def handle_usage(request: web.Request) -> web.Response:
    """This router's rate-limit spending per key digest, for its peers only (quota_peers.py)."""
    router = request.app[ROUTER]
    peers = router.quota_peers
    if peers is None or not peers.may_read(request.remote):
        raise _json_error(403, "only this router's peers read its usage", "permission_error", "forbidden")
    return web.json_response(
        {"router": peers.router_id, "usage": router.limiter.usage_report(time.monotonic())}
    )


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def handle_ready(request: web.Request) -> web.Response:
    fleet = request.app[ROUTER].fleet
    eps = list(fleet.endpoints.by_id.values()) if fleet else []
    up = [ep.id for ep in eps if fleet is not None and fleet.available(ep)]
    pending = fleet.gate.waiting_by_key() if fleet is not None else {}
    return web.json_response(
        {"ready": bool(up), "endpoints": len(eps), "available": len(up), "pending": pending},
        status=200 if up else 503,
    )


async def handle_config(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    router.identity(request)
    return web.json_response(router.config_snapshot())


async def handle_metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    metrics = router.metrics
    if router.fleet is not None:  # gauges of the queue, read now (a model whose queue emptied shows 0)
        gate = router.fleet.gate
        models = {*served_models(router.config.routing, router.config.backends), *gate.waiting_by_key()}
        for model in models | {m for m, n in router.displaced.items() if n}:
            metrics.pending.labels(model).set(gate.num_waiting(model) + router.displaced[model])
        metrics.queue_waiting.set(gate.num_waiting())
        waiting = collections.Counter()
        for ep in router.fleet.endpoints.by_id.values():
            waiting[ep.model] += ep.num_waiting
        for model in models | set(waiting):
            metrics.pod_waiting.labels(model).set(waiting[model])
        asleep = collections.Counter(
            ep.backend for ep in router.fleet.endpoints.by_id.values() if ep.health.asleep
        )
        metrics.endpoints_asleep.clear()  # a backend removed since the last scrape shows no more
        for backend in router.config.backends:
            metrics.endpoints_asleep.labels(backend.name).set(asleep[backend.name])
    if router.watcher is not None:
        metrics.config_restart_pending.set(1 if router.watcher.pending_restart else 0)
    return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})


def build_app(
    config: RouterConfig,
    tokenizer_loader: TokenizerLoader | None = None,
    config_path: str | Path | None = None,
) -> web.Application:
    """The router app; with `config_path` it follows that file's changes live."""
    app = web.Application(client_max_size=config.max_body_bytes)
    router = RouterApp(config, tokenizer_loader, config_path)
    app[ROUTER] = router

    async def lifecycle(app: web.Application):
        await router.start()
        yield
        await router.stop()

    app.cleanup_ctx.append(lifecycle)
    app.on_response_prepare.append(_add_rate_headers)
    app.add_routes(
        [
            web.post("/v1/completions", handle_generate),
            web.post("/v1/chat/completions", handle_generate),
            web.get("/v1/models", handle_models),
            web.get("/v1/config", handle_config),
            web.get(USAGE_PATH, handle_usage),
            web.get("/health", handle_health),
            web.get("/ready", handle_ready),
            web.get("/metrics", handle_metrics),
        ]
    )
    return app
