"""The aiohttp application: routes, and the middleware every request goes through.

Middleware (outermost first): request context + x-request-id + one JSON access-log line + errors mapped
to OpenAI's JSON shape; then the key check the endpoint's access class asks for (access.py: open probes,
client-or-internal OpenAI endpoints, internal-only router endpoints) and, on /v1/*, the in-flight count
the SIGTERM drain waits on.
"""

from __future__ import annotations

import json
import logging
import time

from aiohttp import web
from tokenfleet.runtime import startup_timing
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.errors import EngineDeadError, TokenfleetError
from tokenfleet.runtime.openai.protocol import ModelCard, ModelList
from tokenfleet.runtime.openai.tokenizer_wire import TOKENIZER_PATH
from tokenfleet.runtime.server import chat, completions, kv_transfer, sleep
from tokenfleet.runtime.server.access import WHY, Access, access_of
from tokenfleet.runtime.server.auth import ApiKeys, InternalKey
from tokenfleet.runtime.server.errors import ApiError, error_response, from_exception, unauthorized
from tokenfleet.runtime.server.kv_events import kv_events_endpoint, load_endpoint
from tokenfleet.runtime.server.live_config import config_endpoint
from tokenfleet.runtime.server.lora_endpoints import add_lora_routes
from tokenfleet.runtime.server.metrics import CONTENT_TYPE
from tokenfleet.runtime.server.request_context import CONTEXT_KEY, RequestContext, client_request_id
from tokenfleet.runtime.server.resume import HANDOFF_KEY, Handoff
from tokenfleet.runtime.server.state import STATE_KEY, HttpError, ServerState
from tokenfleet.runtime.server.tokenizer_endpoint import tokenizer_endpoint

from tokenfleet import __version__

access_logger = logging.getLogger("tokenfleet.access")
logger = logging.getLogger(__name__)

# What a client that hung up gets logged as (nginx's convention); it never sees a status.
CLIENT_CLOSED = 499
# Router long polls (up to 10 s, forever) are not work to drain: the drain waits on generation requests only.
# Sleep mode's endpoints are not counted either: a sleep waits for the count to reach zero.
_NOT_COUNTED = frozenset({"/v1/kv-events", "/v1/config", "/v1/models", TOKENIZER_PATH, *sleep.PATHS})


def _route_name(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def context_middleware(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    ctx = RequestContext(state=state, request_id=client_request_id(request.headers.get("x-request-id")))
    request[CONTEXT_KEY] = ctx
    status = 500
    try:
        resp = await _handle_errors(request, handler, ctx)
        status = CLIENT_CLOSED if ctx.disconnected else resp.status
        return resp
    except BaseException:  # cancelled: with handler_cancellation the client hung up
        status = CLIENT_CLOSED
        raise
    finally:
        route = _route_name(request)
        state.metrics.observe_http(route, status)
        entry = {
            "ts": round(time.time(), 3),
            "request_id": ctx.request_id,
            "method": request.method,
            "path": request.path,
            "route": route,
            "status": status,
            "duration_ms": round((time.monotonic() - ctx.start) * 1000, 2),
            "remote": request.remote,
            "user_agent": request.headers.get("User-Agent"),
            **ctx.log_fields,
        }
        access_logger.info(json.dumps(entry))


async def _handle_errors(request: web.Request, handler, ctx: RequestContext) -> web.StreamResponse:
    max_body = ctx.state.config.server.max_body_bytes
    try:
        if request.content_length is not None and request.content_length > max_body:
            raise web.HTTPRequestEntityTooLarge(max_size=max_body, actual_size=request.content_length)
        return await handler(request)
    except HttpError as e:
        err = e.error
    except TokenfleetError as e:
        err = from_exception(e)
    except web.HTTPRequestEntityTooLarge:
        err = ApiError(413, f"Request body larger than {max_body} bytes.", code="request_too_large")
    except web.HTTPException as e:  # unknown route, wrong method, ...
        if e.status < 400:
            raise
        err = ApiError(
            e.status, e.reason or "error", code=e.reason.lower().replace(" ", "_") if e.reason else None
        )
    except Exception as e:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        err = ApiError(500, f"Internal server error: {type(e).__name__}", type="internal_error")
    ctx.log_fields["error"] = err.message
    return error_response(err)


@web.middleware
async def v1_middleware(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    access = access_of(request.path, state.internal_key.enabled)
    if access is Access.OPEN:
        return await handler(request)
    header = request.headers.get("Authorization")
    internal = state.internal_key.check(header)
    # With an internal key configured, the headers a router sets (priority) are believed only from a
    # caller holding it: a client key must not buy a tenant a better priority.
    request[CONTEXT_KEY].trusted = internal or not state.internal_key.enabled
    if access is Access.INTERNAL and not internal:
        raise HttpError(
            ApiError(
                401,
                f"{request.path} needs the deployment's internal key: {WHY[access]}.",
                type="authentication_error",
                code="internal_key_required",
            )
        )
    if access is Access.CLIENT and not internal and not state.api_keys.check(header):
        raise HttpError(unauthorized())
    if request.path in _NOT_COUNTED:
        return await handler(request)
    state.enter()
    try:
        return await handler(request)
    finally:
        state.leave()


async def _set_request_id(request: web.Request, response: web.StreamResponse) -> None:
    ctx = request.get(CONTEXT_KEY)
    if ctx is not None:
        response.headers["x-request-id"] = ctx.request_id


async def health(request: web.Request) -> web.Response:
    """Liveness: 503 when the engine loop died or stopped making progress with work queued."""
    state = request.app[STATE_KEY]
    if state.engine is None:
        return web.json_response(
            {"status": "starting" if state.load_error is None else "failed", "reason": state.load_error},
            status=200 if state.load_error is None else 503,
        )
    try:
        state.engine.check_health()
    except EngineDeadError as e:
        return web.json_response({"status": "unhealthy", "reason": str(e)}, status=503)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    if state.engine is None:
        body = {"status": "loading", "reason": state.load_error, "progress": startup_timing.progress()}
        return web.json_response(body, status=503)
    if state.sleep_level or state.sleep_pending:  # alive (/health 200) but serving nothing: no traffic
        return web.json_response({"status": "sleeping", "level": state.sleep_level}, status=503)
    try:  # a dead engine must also stop receiving traffic, before liveness restarts the pod
        state.engine.check_health()
    except EngineDeadError as e:
        return web.json_response({"status": "unhealthy", "reason": str(e)}, status=503)
    return web.json_response({"status": "ready", "model": state.model_name})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__, "model": request.app[STATE_KEY].model_name})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    engine = state.require_engine()
    created, max_len = int(state.started_at), engine.max_model_len
    cards = [
        ModelCard(id=state.model_name, created=created, max_model_len=max_len, root=state.config.model.model)
    ]
    if state.lora is not None:  # each adapter is a model of its own, as vLLM lists them (loaded or not)
        cards += [
            ModelCard(id=name, created=created, max_model_len=max_len, root=path, parent=parent)
            for name, path, parent in state.lora.known()
        ]
    return web.Response(text=ModelList(data=cards).model_dump_json(), content_type="application/json")


def build_app(config: RuntimeConfig, api_keys: ApiKeys | None = None, engine=None) -> web.Application:
    """The app for one served model. `engine` may be set later (state.engine) once the model is loaded."""
    keys = api_keys or ApiKeys(config.server.api_keys, config.server.api_key_file)
    internal = InternalKey(config.server.internal_api_key_file)
    state = ServerState(config=config, api_keys=keys, internal_key=internal, engine=engine)
    app = web.Application(
        middlewares=[context_middleware, v1_middleware],
        client_max_size=config.server.max_body_bytes,
    )
    app[STATE_KEY] = state
    app[HANDOFF_KEY] = Handoff()  # ends resumable streams with a handoff at the drain deadline
    app.on_response_prepare.append(_set_request_id)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/config", config_endpoint)
    app.router.add_get("/v1/kv-events", kv_events_endpoint)
    app.router.add_get(TOKENIZER_PATH, tokenizer_endpoint)
    app.router.add_get("/load", load_endpoint)
    app.router.add_post("/v1/completions", completions.handle)
    app.router.add_post("/v1/chat/completions", chat.handle)
    add_lora_routes(app)
    kv_transfer.install(app)  # prefill/decode disaggregation: KV blocks fetched by hash
    sleep.install(app)  # sleep mode: answers 404 unless server.enable_sleep_mode
    return app
