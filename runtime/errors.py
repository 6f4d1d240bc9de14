"""Typed errors shared by the engine, the server and the router.

The HTTP layer maps each to an OpenAI-style JSON error: InvalidRequest -> 400, ContextLengthExceeded -> 400
(param "messages"/"prompt"), CapacityError -> 400 (can never fit), Overloaded -> 429, AdaptersBusy and AdapterUnavailable -> 503
with Retry-After, ConfigError -> startup failure or a refused reload.
"""

from __future__ import annotations


class TokenfleetError(Exception):
    """Base class of every error tokenfleet raises on purpose."""


class ConfigError(TokenfleetError):
    """A configuration file or value is invalid."""


class InvalidRequest(TokenfleetError):
    """A request parameter is invalid; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(InvalidRequest):
    """Prompt (+ max_tokens) does not fit in the model's context window."""


class CapacityError(InvalidRequest):
    """The request could never fit in the KV cache, whatever else is running."""


class Overloaded(TokenfleetError):
    """The bounded waiting queue is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(TokenfleetError):
    """The engine loop has stopped; requests can no longer be served."""


class ModelNotFound(TokenfleetError):
    """The request names a model (or LoRA adapter) this server does not serve (404 `model_not_found`)."""

    def __init__(self, name: str):
        super().__init__(f"The model `{name}` does not exist.")
        self.name = name


class AdaptersBusy(TokenfleetError):
    """No adapter can be loaded now: every loaded one has requests in flight (503, retry after)."""

    code = "lora_slots_busy"  # the 503's error code: routers read it as "no room here", not ill health

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class AdapterUnavailable(TokenfleetError):
    """An adapter's files cannot be fetched now (its Hub unreachable or failing): 503, retry after."""

    code = "lora_source_unavailable"  # routers read it as this request's trouble, not the pod's health

    def __init__(self, message: str, retry_after: float = 5.0):
        super().__init__(message)
        self.retry_after = retry_after
