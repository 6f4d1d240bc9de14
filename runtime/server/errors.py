"""OpenAI-shaped JSON errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

One table maps each typed tokenfleet error onto a status, an OpenAI `type` and a `code`, so every handler
(and the middleware that catches what handlers let escape) answers the same way and clients such as the
official `openai` package raise the matching exception class (BadRequestError, RateLimitError, ...).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from aiohttp import web
from tokenfleet.runtime.errors import (
    AdaptersBusy,
    AdapterUnavailable,
    CapacityError,
    ContextLengthExceeded,
    EngineDeadError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    TokenfleetError,
)


@dataclass(frozen=True, slots=True)
class ApiError:
    """An error as the client will see it; `headers` carries e.g. Retry-After."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(name: str) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "Invalid or missing API key; send it as `Authorization: Bearer <key>`.",
        code="invalid_api_key",
    )


def unavailable(message: str, code: str, retry_after: float | None = None) -> ApiError:
    headers = (("Retry-After", _retry_after_header(retry_after)),) if retry_after is not None else ()
    return ApiError(503, message, type="service_unavailable", code=code, headers=headers)


def from_exception(exc: TokenfleetError) -> ApiError:
    """The client-facing form of an error the engine raised on purpose."""
    # Order matters: ContextLengthExceeded and CapacityError are InvalidRequest subclasses.
    if isinstance(exc, ContextLengthExceeded):
        return ApiError(400, str(exc), param=exc.param or "prompt", code="context_length_exceeded")
    if isinstance(exc, CapacityError):
        return ApiError(400, str(exc), param=exc.param, code="kv_capacity_exceeded")
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), param=exc.param)
    if isinstance(exc, Overloaded):
        return ApiError(
            429,
            str(exc) or "The server is overloaded; retry later.",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers=(("Retry-After", _retry_after_header(exc.retry_after)),),
        )
    if isinstance(exc, ModelNotFound):
        return model_not_found(exc.name)
    if isinstance(exc, AdaptersBusy):
        return unavailable(str(exc), code=AdaptersBusy.code, retry_after=exc.retry_after)
    if isinstance(exc, AdapterUnavailable):
        return unavailable(str(exc), code=AdapterUnavailable.code, retry_after=exc.retry_after)
    if isinstance(exc, EngineDeadError):
        return unavailable(f"The engine is not running: {exc}", code="engine_dead")
    return ApiError(500, f"{type(exc).__name__}: {exc}", type="internal_error", code="internal_error")


def _retry_after_header(seconds: float) -> str:
    # HTTP's Retry-After takes whole seconds; round up so a client never retries too early.
    return str(max(1, math.ceil(seconds)))


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    all_headers = dict(err.headers)
    if headers:
        all_headers.update(headers)
    return web.Response(
        status=err.status,
        text=json.dumps(err.body()),
        content_type="application/json",
        headers=all_headers,
    )


def sse_error_event(err: ApiError) -> bytes:
    """An error met after the stream started (status already sent): one SSE event, as vLLM and OpenAI do."""
    return b"data: " + json.dumps(err.body()).encode() + b"\n\n"
