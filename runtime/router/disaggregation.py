"""Prefill/decode disaggregation in the router: a prompt is computed on a prefill pod, its KV moves to a
decode pod by block hash (runtime/openai/kv_transfer.py), and the decode pod generates.

Roles come from the backends and the pods: a backend with `role: prefill` or `role: decode` holds the pods
of that role (on Kubernetes, the role's own Service and so its EndpointSlices; statically, the pod URLs);
in a backend of role `both` each endpoint has the role its pod's label gives it (endpoints.py), so one
Service over both roles works too. A model with prefill and decode endpoints is disaggregated; any other
model is proxied as before.

The flow for one request:
1. prefill: the pod is chosen like any request (queue and prefix-cache affinity, `Fleet.pick`) among the
   prefill backends; it gets the request with `max_tokens: 1`, not streamed, and `kv_transfer_params`
   asking it to hold the prompt's KV. Its answer names the held blocks, the pod's address and a hold id.
2. decode: the pod is chosen among the decode backends by load and KV-cache usage only (the strategy's
   queue and kvUsage terms; no prefix term: the prompt's KV arrives with the request);
   it gets the client's request unchanged plus the transfer parameters, and its answer goes to the client
   through the ordinary proxy path (retries before the first byte, bounded waits).
A streamed request instead gets the prefill pod's first token at once and the rest from the decode pod,
which continues that very stream (disaggregation_stream.py).
If no prefill pod answers, the request goes to the decode pods as an ordinary request; if the transfer
fails, the decode pod recomputes the prompt itself; if no decode pod is in rotation, the prefill pods serve
the request alone, and a stream whose last decode pod died is continued on a prefill pod. Either way the
client gets the same completion.

A client cannot send `kv_transfer_params` itself: the member is dropped from every request the router
forwards (it names a URL a pod would fetch from).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace

import aiohttp
from aiohttp import web
from tokenfleet.runtime.openai import kv_transfer as wire
from tokenfleet.runtime.router import disaggregation_stream
from tokenfleet.runtime.router.config import Backend, Retries
from tokenfleet.runtime.router.endpoints import Endpoint, role_ref
from tokenfleet.runtime.router.fleet import Fleet, PromptKey
from tokenfleet.runtime.router.model_routes import RouteTarget
from tokenfleet.runtime.router.proxy import forward as proxy_forward
from tokenfleet.runtime.router.upstream import Outcome, Outgoing

log = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
# How long a prefill pod holds the KV for the decode pod: the decode pod fetches at once, so this only
# bounds what an abandoned request (client gone between the phases) keeps pinned.
HOLD_SECONDS = 30.0
_releases: set[asyncio.Task] = set()  # hold releases sent for clients that left (kept until they finish)


def role_targets(
    backends: Sequence[Backend],
    targets: Sequence[RouteTarget],
    role: str,
    endpoints: Iterable[Endpoint] = (),
) -> tuple[RouteTarget, ...]:
    """The targets narrowed to the endpoints of one role (targets left with none are dropped).

    A backend configured with that role counts whole; a backend of role `both` (one Service over pods of
    both roles) counts with those of its `endpoints` whose label gives them that role (`backend#role`).
    """
    roles = {b.name: b.role for b in backends}
    labelled = {(e.backend, e.role) for e in endpoints}
    out = []
    for t in targets:
        names = []
        for n in t.backends:
            if roles.get(n) == role:
                names.append(n)
            elif roles.get(n) == "both" and (n, role) in labelled:
                names.append(role_ref(n, role))
        if names:
            out.append(replace(t, backends=tuple(names)))
    return tuple(out)


def prefill_payload(payload: dict) -> dict:
    """The client's request as the prefill pod gets it: one token, one choice, not streamed, KV held."""
    body = {k: v for k, v in payload.items() if k not in ("stream", "stream_options", "n", "best_of")}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body[wire.FIELD] = wire.PrefillParams(hold_seconds=HOLD_SECONDS).model_dump()
    return body


def decode_payload(payload: dict, done: wire.PrefillDone) -> dict:
    params = wire.DecodeParams(
        remote_url=done.remote_url, hold_id=done.hold_id, block_hashes=done.block_hashes
    )
    return {**payload, wire.FIELD: params.model_dump()}


async def forward(
    request: web.Request, fleet: Fleet, out: Outgoing, retries: Retries
) -> tuple[web.StreamResponse, Outcome]:
    """Forward one admitted request, disaggregated when its model has prefill and decode backends."""
    if wire.FIELD in out.payload:
        out = replace(out, payload={k: v for k, v in out.payload.items() if k != wire.FIELD})
    endpoints = fleet.endpoints.by_id.values()
    prefill_t = role_targets(fleet.config.backends, out.targets, PREFILL, endpoints)
    decode_t = role_targets(fleet.config.backends, out.targets, DECODE, endpoints)
    if not prefill_t or not decode_t or not fleet.healthy_endpoints(prefill_t):
        # Discovery knows pods out of rotation too (loading, asleep): with no prefill pod in rotation the
        # request is proxied whole, with its prefix affinity, as when no prefill pod exists.
        return await proxy_forward(request, fleet, out, retries)
    if not fleet.healthy_endpoints(decode_t):
        # No decode pod in rotation (lost with its node, ejected, draining): prefill pods are whole engines,
        # so they serve the request alone rather than the client waiting for a replacement decode pod.
        return await proxy_forward(request, fleet, replace(out, targets=prefill_t), retries)
    if out.stream:  # the first token goes to the client from the prefill pod, the rest from a decode pod
        streamed = await disaggregation_stream.stream(
            request, fleet, out, prefill_payload(out.payload), prefill_t, decode_t, retries
        )
        if streamed is not None:
            return streamed
    done = await _prefill(fleet, out, prefill_t, retries)
    # Decode pods are chosen by load and KV-cache usage alone: the prompt's KV comes with the request.
    decode_out = replace(out, targets=decode_t, prompt=PromptKey(None, "", None), session_key=None)
    if done is not None:
        decode_out = replace(decode_out, payload=decode_payload(out.payload, done))
    try:
        resp, outcome = await proxy_forward(request, fleet, decode_out, retries)
    except asyncio.CancelledError:  # the client left: a hold the decode pod has not fetched yet goes now
        if done is not None:
            task = asyncio.get_running_loop().create_task(release_quietly(fleet.session, done, out.headers))
            _releases.add(task)
            task.add_done_callback(_releases.discard)
        raise
    if done is not None and outcome.status != 200:
        await release_quietly(
            fleet.session, done, out.headers
        )  # refused before it fetched: do not wait for expiry
    return resp, outcome


async def _prefill(
    fleet: Fleet, out: Outgoing, targets: tuple[RouteTarget, ...], retries: Retries
) -> wire.PrefillDone | None:
    """Run the prompt on a prefill pod; where its KV is held, or None when no prefill pod managed."""
    tried: set[str] = set()
    body = prefill_payload(out.payload)
    timeout = aiohttp.ClientTimeout(
        total=retries.first_byte_timeout_seconds, connect=retries.connect_timeout_seconds
    )
    for _ in range(retries.max_attempts):
        pick = fleet.pick(targets, out.prompt, out.session_key, frozenset(tried))
        if pick is None:
            return None
        ep = pick.endpoint
        tried.add(ep.id)
        fleet.acquire(ep)
        try:
            payload = {**body, "model": ep.model}
            async with fleet.session.post(
                ep.url + out.path, json=payload, headers=out.headers, timeout=timeout
            ) as r:
                if r.status != 200:
                    log.warning("prefill pod %s answered %d", ep.url, r.status)
                    if r.status >= 500:
                        fleet.report(ep, False)
                    if r.status < 500 and r.status != 429:
                        return None  # the request itself is refused: the decode pod will say why
                    continue
                answer = await r.json()
            fleet.report(ep, True)
            fleet.record_route(pick)
            if not isinstance(answer, dict) or wire.FIELD not in answer:
                return (
                    None  # the pod holds nothing (e.g. tensor parallel): the decode pod computes the prompt
                )
            return wire.PrefillDone.model_validate(answer[wire.FIELD])
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("prefill on %s failed: %s", ep.url, type(e).__name__)
            fleet.report(ep, False)
        finally:
            fleet.release(ep)
    return None


async def release_quietly(
    session: aiohttp.ClientSession, done: wire.PrefillDone, headers: dict[str, str]
) -> None:
    """Tell a prefill pod its hold will not be fetched (the client went away between the phases)."""
    auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
    url = f"{done.remote_url}{wire.HOLDS_PATH}/{done.hold_id}"
    try:
        async with session.delete(url, headers=auth, timeout=aiohttp.ClientTimeout(total=5)) as r:
            await r.read()
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass  # the hold expires on its own
