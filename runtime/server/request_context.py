"""RequestContext: per-HTTP-request facts shared by the middleware (ids, access log) and the handlers."""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web
from tokenfleet.runtime.openai.protocol import PromptTokensDetails, Usage
from tokenfleet.runtime.server.auth import bearer_token
from tokenfleet.runtime.server.generation import ChoiceState
from tokenfleet.runtime.server.state import ServerState

# A client-supplied x-request-id is echoed and logged, so keep it to a safe, bounded alphabet.
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


def client_request_id(header: str | None) -> str:
    if header and _CLIENT_ID.match(header):
        return header
    return uuid.uuid4().hex


@dataclass(eq=False)
class RequestContext:
    state: ServerState
    request_id: str  # echoed in x-request-id; the client's own if it sent a valid one
    start: float = field(default_factory=time.monotonic)
    # Engine request ids must be unique even when clients reuse an x-request-id, so they get their own.
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    prefix: str = "cmpl"
    disconnected: bool = False
    trusted: bool = True  # may router-set headers be believed (the auth middleware decides)
    log_fields: dict = field(default_factory=dict)

    @staticmethod
    def of(request: web.Request) -> RequestContext:
        return request[CONTEXT_KEY]

    @property
    def response_id(self) -> str:
        return f"{self.prefix}-{self.uid}"

    @property
    def engine_base_id(self) -> str:
        return self.response_id

    def record(self, choices: list[ChoiceState]) -> None:
        """Token counts and finish reasons for the access log line."""
        usage = usage_of(choices)
        self.log_fields.update(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0,
            finish_reasons=sorted({c.finish_reason or "none" for c in choices}),
        )


def usage_of(choices: list[ChoiceState]) -> Usage:
    """Prompt tokens count once per prompt (not once per choice), as OpenAI bills them."""
    per_prompt: dict[int, ChoiceState] = {}
    for c in choices:
        per_prompt.setdefault(c.prompt_index, c)
    prompt = sum(c.num_prompt_tokens for c in per_prompt.values())
    cached = sum(c.num_cached_tokens for c in per_prompt.values())
    completion = sum(c.num_output_tokens for c in choices)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


CONTEXT_KEY = web.RequestKey("tokenfleet.context", RequestContext)


PRIORITY_HEADER = "x-tokenfleet-priority"  # set by the router from its priority classes
TENANT_HEADER = "x-tokenfleet-tenant"  # names the tenant a trusted router or gateway serves


def request_priority(request: web.Request, body_priority: int, body_sets_it: bool) -> int:
    """The engine priority (lower = sooner): the body's `priority` when the client set it, else the
    router's header, else 0. An unparsable header is ignored rather than failing the request, and so is
    the header of a caller without the internal key where one is configured (see access.py)."""
    if body_sets_it:
        return body_priority
    ctx = request.get(CONTEXT_KEY)
    if ctx is not None and not ctx.trusted:
        return body_priority
    try:
        return int(request.headers.get(PRIORITY_HEADER, body_priority))
    except ValueError:
        return body_priority


def request_tenant(request: web.Request) -> str | None:
    """Whose fair share (`scheduler.fair_share`) the request counts against: the tenant header from a
    trusted caller (the same rule as the priority header: a client must not pose as another tenant),
    else the digest of the client's API key when this pod checks keys (never the key itself: tenants are
    kept in memory and may be logged), else None, the one anonymous tenant."""
    ctx = request.get(CONTEXT_KEY)
    trusted = ctx is None or ctx.trusted
    if trusted:
        named = request.headers.get(TENANT_HEADER)
        if named:
            return named
    state = ctx.state if ctx is not None else None
    if state is None or not state.api_keys.enabled:
        return None
    authorization = request.headers.get("Authorization")
    token = bearer_token(authorization)
    if token is None or state.internal_key.check(authorization):
        return None  # the internal key is a router's or a pod's, not a tenant's
    return hashlib.blake2b(token.encode(), digest_size=16).hexdigest()
