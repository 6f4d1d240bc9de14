"""One upstream attempt's types, shared by the plain forward (proxy.py), resumed streams (resume.py) and the
disaggregated paths: the request as the router forwards it (`Outgoing`), how an attempt ended (`Outcome`,
`Retry`), the body and headers sent to a pod and passed back to the client, and OpenAI-style error bodies.
"""

from __future__ import annotations

import json
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
