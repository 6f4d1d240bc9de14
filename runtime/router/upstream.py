"""One upstream attempt's types, shared by the plain forward (proxy.py), resumed streams (resume.py) and the
disaggregated paths: the request as the router forwards it (`Outgoing`), how an attempt ended (`Outcome`,
`Retry`), the output tokens charged as a stream passes (`TokenMeter`), the body and headers sent to a pod
and passed back to the client, and OpenAI-style error bodies.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from tokenfleet.runtime.openai.resume import CONTINUATION_FIELD
from tokenfleet.runtime.router.fleet import Pick, PromptKey
from tokenfleet.runtime.router.model_routes import RouteTarget
from tokenfleet.runtime.router.ratelimit import key_digest

# Hop-by-hop headers (RFC 9110 §7.6.1) and those aiohttp sets itself on the way out.
_DROP_RESPONSE = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "content-encoding",
    "date",
    "server",
}
_FORWARD_REQUEST = (
    "authorization",
    "content-type",
    "accept",
    "x-request-id",
    "openai-organization",
    "user-agent",
)


@dataclass(frozen=True, slots=True)
class Outgoing:
    path: str
    payload: dict
    stream: bool
    headers: dict[str, str]
    targets: tuple[RouteTarget, ...]
    prompt: PromptKey
    session_key: str | None
    adapter: str | None = None  # a LoRA adapter of the backends: the pods are asked for it by its name
    meter: TokenMeter | None = None  # charged with each streamed event, whichever path relays it


@dataclass(frozen=True, slots=True)
class Retry:
    """An attempt failed before anything reached the client: try elsewhere, or answer with this."""

    status: int
    body: bytes
    reason: str  # connect | timeout | 5xx | overloaded | broken | lora_busy


@dataclass(slots=True)
class Outcome:
    """What the app needs after forwarding: for metrics and the token rate limit."""

    status: int
    completion_tokens: int = 0
    endpoint: str | None = None


class TokenMeter:
    """Output tokens charged as a stream passes through the router, one per event, then settled to the exact
    count when the request ends.

    Fair share's counters order the router's queue while streams are still running: a tenant whose long
    streams are in flight has received that service already, and charging it only when each stream ends
    would let it keep jumping ahead of a tenant whose requests are short. An event is one generated token
    on our pods (and vLLM's); the few that are not (a usage-only chunk) are corrected by `settle`.
    """

    __slots__ = ("_charge", "charged")

    def __init__(self, charge: Callable[[int], None]):
        self._charge = charge
        self.charged = 0

    def add(self, n: int) -> None:
        if n:
            self.charged += n
            self._charge(n)

    def settle(self, total: int) -> None:
        """The request's whole completion tokens are `total`: charge (or refund) the difference."""
        self.add(total - self.charged)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse_error(message: str) -> bytes:
    body = error_body(message, "upstream_error", "stream_interrupted")
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


def request_headers(incoming, priority: int, tenant: str | None = None) -> dict[str, str]:
    """Headers for the pod. `x-tokenfleet-priority` carries the request's priority number unchanged: it
    means on the pod what it means here (lower = sooner, preempted later), and the pod uses it when the
    body sets no `priority` of its own (the router rewrites a body's `priority` to the same number).
    `x-tokenfleet-tenant` names whose share the request counts against, as a digest (never the API key
    itself): the pod's own fair share ranks tenants as the router's queue does. Pods trust both headers
    only from a caller with the internal key."""
    headers = {k: incoming[k] for k in _FORWARD_REQUEST if k in incoming}
    headers["x-tokenfleet-priority"] = str(priority)
    if tenant is not None:
        headers["x-tokenfleet-tenant"] = key_digest(tenant)
    return headers


def body_for(out: Outgoing, pick: Pick) -> bytes:
    payload = out.payload
    if CONTINUATION_FIELD in payload:  # only the router continues streams; a client cannot claim to
        payload = {k: v for k, v in payload.items() if k != CONTINUATION_FIELD}
    model = payload.get("model")
    if model != pick.endpoint.model and model != out.adapter:
        payload = {**payload, "model": pick.endpoint.model}  # a fallback or an alias: name the pod's model
    return json.dumps(payload).encode()


def response_headers(upstream: aiohttp.ClientResponse, pick: Pick) -> dict[str, str]:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE}
    headers["x-tokenfleet-endpoint"] = pick.endpoint.url
    headers["x-tokenfleet-route"] = pick.decision.reason
    return headers
