"""Both pod halves of prefill/decode disaggregation over HTTP (wire: runtime/openai/kv_transfer.py).

Prefill pod: a request with `kv_transfer_params.do_remote_decode` runs as usual (the router sends
`max_tokens: 1`); then the pod holds the prompt's full blocks (engine/kv_cache/kv_holds.py) and adds
`kv_transfer_params` (hashes, its address, a hold id) to the JSON answer. `POST /v1/kv/fetch` streams the
held blocks' KV, a few blocks per engine call (copies run between steps), and releases the hold when the
stream ends or breaks; a timer releases holds nobody fetched. `DELETE /v1/kv/holds/{id}` releases one.

Decode pod: a request with `kv_transfer_params.do_remote_prefill` first asks the engine which leading
blocks it already holds, fetches the rest through a `KVTransport`, checks and inserts them as prefix-cache
blocks (engine/kv_cache/kv_connector.py), then runs the request unchanged: the prefix cache turns the
transfer into a full prefix hit. A transport failure or timeout, or blocks that do not check, fall back to
recomputing the prompt (`tokenfleet:kv_transfer_fallbacks_total{reason}`) — the answer is the same.

`KVTransport` is the seam: `HttpKVTransport` moves bytes over the pod's HTTP port; an RDMA/NIXL transport
would implement the same two calls and read the same held blocks.

Tensor-parallel pods move every rank's shard of a block (engine/parallel/kv_shards.py: rank 0 gathers and
scatters over the workers' pipes), so both roles must have the same `tensor_parallel_size`: the decode pod
names its size in the fetch, and the prefill pod refuses another one (409, code `tp_size_mismatch`, naming
both sizes); a sender that names none is caught by the layout check. Either way the decode pod logs the
error, counts the fallback under `tp_size_mismatch` and computes the prompt itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple, Protocol

import aiohttp
import torch
from aiohttp import web
from prometheus_client import Counter, Histogram
from pydantic import ValidationError
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, with_adapter
from tokenfleet.runtime.engine.kv_cache.kv_connector import (
    KVTransferError,
    cached_prefix_len,
    check_chain,
    check_layout,
    insert_prefix_blocks,
)
from tokenfleet.runtime.engine.kv_cache.kv_holds import KVHolds
from tokenfleet.runtime.engine.parallel.kv_shards import PodKV
from tokenfleet.runtime.openai import kv_transfer as wire
from tokenfleet.runtime.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenfleet.runtime.openai.resume import CONTINUATION_FIELD
from tokenfleet.runtime.openai.translate import chat_params, completion_params, parse_request
from tokenfleet.runtime.server.errors import ApiError, invalid
from tokenfleet.runtime.server.prompts import chat_prompt, completion_prompt_list, generation_defaults
from tokenfleet.runtime.server.state import STATE_KEY, HttpError

logger = logging.getLogger(__name__)

_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_BLOCKS_PER_CALL = 16  # blocks copied per engine call while streaming: keeps each pause between steps short
_SWEEP_SECONDS = 1.0
FETCH_TIMEOUT_SECONDS = 10.0


class KVFetchError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


TP_MISMATCH = "tp_size_mismatch"  # the fallback reason, and the prefill pod's error code


class KVTransport(Protocol):
    async def fetch(
        self, remote_url: str, hold_id: str, start: int, auth: str | None, tp_size: int = 1
    ) -> tuple[wire.FetchHeader, list[bytes]]:
        """The held blocks from `start` on (header + one payload per block) for a pod of `tp_size` ranks;
        raises KVFetchError."""
        ...

    async def release(self, remote_url: str, hold_id: str, auth: str | None) -> None: ...


def _bytes_per_block(layout: dict) -> int:
    itemsize = torch.empty(0, dtype=getattr(torch, layout["dtype"])).element_size()
    shard = 2 * layout["num_layers"] * math.prod(layout["block_shape"]) * itemsize
    return int(layout.get("tp_size", 1)) * shard


async def _error_of(resp: aiohttp.ClientResponse) -> tuple[str | None, str]:
    """The (code, message) of a pod's OpenAI-style error answer, as far as it is one."""
    with contextlib.suppress(Exception):
        error = (await resp.json())["error"]
        return error.get("code"), str(error.get("message"))
    return None, ""


class HttpKVTransport:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def fetch(self, remote_url, hold_id, start, auth, tp_size=1):
        headers = {"Authorization": auth} if auth else {}
        body = wire.FetchRequest(hold_id=hold_id, start=start, tp_size=tp_size).model_dump()
        async with self._client().post(remote_url + wire.FETCH_PATH, json=body, headers=headers) as resp:
            if resp.status != 200:
                code, message = await _error_of(resp)
                reason = TP_MISMATCH if code == TP_MISMATCH else f"http_{resp.status}"
                raise KVFetchError(reason, f"{remote_url} answered {resp.status}: {message}")
            n = wire.header_length(await resp.content.readexactly(wire.HEADER_PREFIX_BYTES))
            header = wire.decode_header(await resp.content.readexactly(n))
            size = _bytes_per_block(header.layout)
            payloads = [await resp.content.readexactly(size) for _ in header.block_hashes]
            return header, payloads

    async def release(self, remote_url, hold_id, auth):
        headers = {"Authorization": auth} if auth else {}
        async with self._client().delete(f"{remote_url}{wire.HOLDS_PATH}/{hold_id}", headers=headers):
            pass


class KVTransferMetrics:
    def __init__(self, registry) -> None:
        self.blocks = Counter(
            "tokenfleet:kv_transfer_blocks", "KV blocks moved between pods", ["direction"], registry=registry
        )
        self.bytes = Counter(
            "tokenfleet:kv_transfer_bytes", "KV bytes moved between pods", ["direction"], registry=registry
        )
        self.seconds = Histogram(
            "tokenfleet:kv_transfer_seconds",
            "Decode pod: time to fetch and insert a prompt's KV blocks",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        )
        self.fallbacks = Counter(
            "tokenfleet:kv_transfer_fallbacks",
            "Decode pod: requests that recomputed their prompt because the KV transfer failed",
            ["reason"],
            registry=registry,
        )
        self.expired = Counter(
            "tokenfleet:kv_holds_expired",
            "Prefill pod: holds released unfetched at their deadline",
            registry=registry,
        )


class KVTransferState:
    def __init__(self, registry, transport: KVTransport | None = None) -> None:
        self.metrics = KVTransferMetrics(registry)
        self.transport: KVTransport = transport or HttpKVTransport()
        self.holds: KVHolds | None = None  # created on the engine thread at first use
        self.pending: dict[str, asyncio.Event] = {}  # holds of prefills still running (event loop only)
        self.timeout = FETCH_TIMEOUT_SECONDS

    def holds_of(self, core) -> KVHolds:
        if self.holds is None:
            self.holds = KVHolds(core.kv_manager)
            core.finish_listeners.append(self.holds.requests_finished)
        return self.holds


KV_TRANSFER_KEY = web.AppKey("kv_transfer", KVTransferState)
_HOLD_ID_KEY = "tokenfleet_kv_hold_id"


# ---- prefill pod --------------------------------------------------------------------------------------------


class PromptOf(NamedTuple):
    """What a prompt's blocks are hashed from: its token ids, cache salt and LoRA adapter (None: base)."""

    token_ids: list[int]
    salt: str | None
    lora: str | None


def _prompt(path: str, state, engine, raw: bytes) -> PromptOf:
    """The prompt token ids exactly as the handler builds them (same helpers), the cache salt and the
    adapter the request's `model` selects (a 404 for a model this pod does not serve, as the handler's)."""
    defaults = generation_defaults(state, engine)
    if path == "/v1/completions":
        req = parse_request(CompletionRequest, raw)
        lora = state.check_model(req.model)
        params = completion_params(req, defaults)
        prompts, _ = completion_prompt_list(state, engine, req, params.max_tokens)
        if len(prompts) != 1:
            raise HttpError(invalid("a disaggregated prefill takes one prompt", param=wire.FIELD))
        return PromptOf(list(prompts[0].token_ids), req.cache_salt, lora)
    from tokenfleet.runtime.server.chat import tool_plan  # the chat handler's own tool rules

    req = parse_request(ChatCompletionRequest, raw)
    lora = state.check_model(req.model)
    plan = tool_plan(req, engine.tokenizer)
    params = chat_params(req, defaults, plan.constraint)
    prompt, _ = chat_prompt(state, engine, req, plan.tools, params.max_tokens)
    return PromptOf(list(prompt.token_ids), req.cache_salt, lora)


async def _adapter_key(state, lora: str | None) -> str | None:
    """The key this pod hashes an adapter's blocks with (name and weights digest), its files read first when
    they are not in host memory (off the loop, as the handler reads them). Both pods hash with their own key:
    a prefill pod that holds other weights under the same name gets its blocks refused, not used."""
    if lora is None:
        return None
    return (await asyncio.to_thread(state.lora.ensure_loaded, lora)).cache_key


async def _prefill(
    request: web.Request, handler, params: wire.PrefillParams, raw: bytes
) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    kvs = request.app[KV_TRANSFER_KEY]
    engine = state.require_engine()
    token_ids, salt, lora = _prompt(request.path, state, engine, raw)
    adapter_key = await _adapter_key(state, lora)
    hold_id = uuid.uuid4().hex
    # The hold is announced before the request runs and taken by the engine in the very step the request
    # finishes, while all of its prompt blocks are still cached (kv_holds.py); taken after the answer, the
    # blocks could already be evicted by then.

    def expect(core):
        km = core.kv_manager
        hashes = block_hashes_for(token_ids, km.block_size, with_adapter(km.hash_extra, salt, adapter_key))
        return kvs.holds_of(core).expect(hold_id, hashes, token_ids, salt, params.hold_seconds), km.block_size

    try:
        pending, block_size = await engine.call(expect)
    except asyncio.CancelledError:  # the client left: `expect` still runs, this cancel runs after it
        with contextlib.suppress(Exception):
            await asyncio.shield(engine.call(lambda core: kvs.holds_of(core).cancel(hold_id)))
        raise
    # A streamed prefill names its hold in a response header (sent before the body); a fetch that arrives
    # before the stream has ended waits for it (`pending`).
    request[_HOLD_ID_KEY] = hold_id
    kvs.pending[hold_id] = asyncio.Event()
    keep = False
    try:
        resp = await handler(request)
        keep = resp.status == 200
        if not keep:
            return resp
        held = pending.held
        if held is None:  # finished some other way than through an engine step (never expected): hold now
            deadline = time.monotonic() + params.hold_seconds
            # Unless a release came first (a streamed prefill's hold id is out before it finishes): then
            # there is no hold and `held` stays None.
            held = await engine.call(lambda core: kvs.holds_of(core).hold_pending(pending, deadline))
    finally:
        kvs.pending.pop(hold_id).set()
        if not keep:  # refused, failed or the client left: nothing will fetch it
            with contextlib.suppress(Exception):
                await asyncio.shield(engine.call(lambda core: kvs.holds_of(core).cancel(hold_id)))
    if not isinstance(resp, web.Response) or resp.body is None:
        return resp  # a stream: the header named the hold
    if held is None:
        return resp  # released before it was taken: the answer names no hold (the decode pod computes)
    done = wire.PrefillDone(
        remote_url=f"{request.scheme}://{request.host}",
        hold_id=hold_id,
        block_hashes=[h.hex() for h in held.block_hashes],
        block_size=block_size,
    )
    body = json.loads(resp.body)
    body[wire.FIELD] = done.model_dump()
    out = web.json_response(body, status=resp.status)
    for key, value in resp.headers.items():  # e.g. how many prompt tokens truncation dropped
        if key.lower() not in ("content-length", "content-type"):
            out.headers[key] = value
    return out


async def _name_hold(request: web.Request, response: web.StreamResponse) -> None:
    hold_id = request.get(_HOLD_ID_KEY)
    if hold_id is not None:
        response.headers[wire.HOLD_HEADER] = hold_id


async def fetch_endpoint(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    kvs = request.app[KV_TRANSFER_KEY]
    engine = state.require_engine()
    try:
        req = wire.FetchRequest.model_validate_json(await request.read())
    except ValidationError as e:
        raise HttpError(invalid(f"bad KV fetch request: {e.errors(include_url=False)[0]['msg']}")) from None

    pending = kvs.pending.get(req.hold_id)
    if pending is not None:  # its prefill stream is still ending
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(pending.wait(), FETCH_TIMEOUT_SECONDS)

    taken = []  # the hold once `begin` took it (engine thread)

    def begin(core):
        holds = kvs.holds_of(core)
        held = holds.num_blocks(req.hold_id)
        layout = PodKV(core.runner.kv_caches, core.workers).layout
        if held is None or req.start > held:
            return held, None, layout
        if req.tp_size is not None and req.tp_size != layout.tp_size:
            holds.release(req.hold_id)  # the fetch ends the hold, used or not (no other pod will come)
            return held, None, layout
        taken.append(holds.take(req.hold_id))
        return held, taken[-1], layout

    try:
        held, hold, layout = await engine.call(begin)
    except asyncio.CancelledError:
        # The reader left while the engine was taking the hold: `begin` still runs, so a call queued after
        # it (the engine runs calls in order) frees whatever it took.
        def give_back(core):
            for h in taken:
                kvs.holds_of(core).free(h)

        with contextlib.suppress(Exception):
            await asyncio.shield(engine.call(give_back))
        raise
    if held is None:
        raise HttpError(
            ApiError(404, f"no KV hold {req.hold_id!r} (unknown, fetched or expired)", code="not_found")
        )
    if hold is None and req.tp_size is not None and req.tp_size != layout.tp_size:
        raise HttpError(
            ApiError(
                409,
                f"tensor_parallel_size differs: this prefill pod has {layout.tp_size}, the fetching pod "
                f"{req.tp_size} (each rank holds only its KV heads; both roles need the same size)",
                param="tp_size",
                code=TP_MISMATCH,
            )
        )
    if hold is None:
        raise HttpError(invalid(f"start {req.start} is past the {held} held blocks", param="start"))
    try:
        bs = len(hold.token_ids) // max(1, len(hold.blocks))
        header = wire.FetchHeader(
            layout=layout.as_json(),
            block_size=bs,
            cache_salt=hold.cache_salt,
            parent=hold.block_hashes[req.start - 1].hex() if req.start else None,
            block_hashes=[h.hex() for h in hold.block_hashes[req.start :]],
            token_ids=list(hold.token_ids[req.start * bs :]),
        )
        resp = web.StreamResponse(headers={"Content-Type": wire.CONTENT_TYPE})
        await resp.prepare(request)
        await resp.write(wire.encode_header(header))
        ids = hold.block_ids[req.start :]
        for i in range(0, len(ids), _BLOCKS_PER_CALL):
            chunk = ids[i : i + _BLOCKS_PER_CALL]
            payloads = await engine.call(
                lambda core, chunk=chunk: PodKV(core.runner.kv_caches, core.workers).read(chunk)
            )
            for p in payloads:
                await resp.write(p)
            kvs.metrics.blocks.labels("sent").inc(len(payloads))
            kvs.metrics.bytes.labels("sent").inc(sum(len(p) for p in payloads))
        await resp.write_eof()
        return resp
    finally:  # fetched, or the reader went away: either way nobody will fetch it again
        with contextlib.suppress(Exception):
            await asyncio.shield(engine.call(lambda core: kvs.holds_of(core).free(hold)))


async def release_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    kvs = request.app[KV_TRANSFER_KEY]
    hold_id = request.match_info["hold_id"]
    # `cancel`, not `release`: a streamed prefill names its hold before the request finishes, so the hold may
    # still be only announced. Cancelled, it is never taken; released only once taken, it would be taken at
    # the finish after this answered 404 and stay pinned for its whole ttl.
    released = await state.require_engine().call(lambda core: kvs.holds_of(core).cancel(hold_id))
    if not released:
        raise HttpError(
            ApiError(404, f"no KV hold {hold_id!r} (unknown, fetched or expired)", code="not_found")
        )
    return web.json_response({"released": hold_id})


# ---- decode pod ---------------------------------------------------------------------------------------------


def _decode_prompt(path: str, state, engine, raw: bytes) -> PromptOf:
    """The prompt the handler will run: a continuation's own ids, else built as the handler builds them."""
    payload = json.loads(raw)
    continuation = payload.get(CONTINUATION_FIELD)
    if isinstance(continuation, dict) and isinstance(continuation.get("prompt_token_ids"), list):
        salt = payload.get("cache_salt")
        model = payload.get("model")
        return PromptOf(
            [int(t) for t in continuation["prompt_token_ids"]],
            salt if isinstance(salt, str) else None,
            state.check_model(model if isinstance(model, str) else None),
        )
    return _prompt(path, state, engine, raw)


async def _decode(request: web.Request, params: wire.DecodeParams, raw: bytes) -> None:
    """Bring the prompt's KV over from the prefill pod, or count why not (the request then recomputes)."""
    state = request.app[STATE_KEY]
    kvs = request.app[KV_TRANSFER_KEY]
    engine = state.require_engine()
    auth = request.headers.get("Authorization")
    tp_size = engine.config.parallel.tensor_parallel_size
    try:
        hashes = [bytes.fromhex(h) for h in params.block_hashes]
    except ValueError:
        raise HttpError(invalid("block_hashes must be hex strings", param=wire.FIELD)) from None
    prompt = _decode_prompt(request.path, state, engine, raw)
    adapter_key = await _adapter_key(state, prompt.lora)
    if not hashes:  # a streamed prefill sends none: this pod hashes the prompt as it will run it

        def own_hashes(core):
            km = core.kv_manager
            extra = with_adapter(km.hash_extra, prompt.salt, adapter_key)
            return block_hashes_for(prompt.token_ids, km.block_size, extra)

        hashes = await engine.call(own_hashes)
    start = await engine.call(lambda core: cached_prefix_len(core.kv_manager, hashes))
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(kvs.timeout):
            header, payloads = await kvs.transport.fetch(
                params.remote_url, params.hold_id, start, auth, tp_size
            )
    except KVFetchError as e:
        return _fallback(kvs, e.reason, e)
    except TimeoutError as e:
        return _fallback(kvs, "timeout", e)
    except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError, ValueError) as e:
        return _fallback(kvs, "unreachable", e)
    if [bytes.fromhex(h) for h in header.block_hashes] != hashes[start : start + len(header.block_hashes)]:
        return _fallback(kvs, "mismatch", KVTransferError("the fetched blocks are not the announced ones"))
    got = [bytes.fromhex(h) for h in header.block_hashes]
    parent = bytes.fromhex(header.parent) if header.parent else None

    def insert(core):
        km, pod = core.kv_manager, PodKV(core.runner.kv_caches, core.workers)
        check_layout(pod.layout, header.layout)
        check_chain(km, got, header.token_ids, header.cache_salt, parent, adapter_key)

        def fill(block_ids: list[int]) -> int:
            pod.write(block_ids, payloads[: len(block_ids)])
            return len(block_ids)

        return insert_prefix_blocks(km, got, header.token_ids, parent, fill)

    try:
        inserted = await engine.call(insert)
    except KVTransferError as e:
        their_tp = int(header.layout.get("tp_size", 1))
        return _fallback(kvs, TP_MISMATCH if their_tp != tp_size else "refused", e)
    kvs.metrics.blocks.labels("received").inc(inserted)
    kvs.metrics.bytes.labels("received").inc(sum(len(p) for p in payloads[:inserted]))
    kvs.metrics.seconds.observe(time.monotonic() - t0)


def _fallback(kvs: KVTransferState, reason: str, error: BaseException) -> None:
    # A TP-size mismatch is a deployment error that will not go away by itself: said louder than a blip.
    level = logging.ERROR if reason == TP_MISMATCH else logging.WARNING
    logger.log(level, "KV transfer failed (%s: %s): recomputing the prompt", reason, error)
    kvs.metrics.fallbacks.labels(reason).inc()


# ---- wiring -------------------------------------------------------------------------------------------------


@web.middleware
async def kv_transfer_middleware(request: web.Request, handler) -> web.StreamResponse:
    if request.method != "POST" or request.path not in _GENERATION_PATHS:
        return await handler(request)
    raw = await request.read()  # cached: the handler reads the same bytes
    if wire.FIELD.encode() not in raw:
        return await handler(request)
    try:
        member = json.loads(raw).get(wire.FIELD)
    except (ValueError, AttributeError):
        return await handler(request)  # the handler reports malformed JSON
    if not isinstance(member, dict):
        raise HttpError(invalid(f"{wire.FIELD} must be an object", param=wire.FIELD))
    try:
        if member.get("do_remote_decode"):
            return await _prefill(request, handler, wire.PrefillParams.model_validate(member), raw)
        if member.get("do_remote_prefill"):
            await _decode(request, wire.DecodeParams.model_validate(member), raw)
    except ValidationError as e:
        raise HttpError(
            invalid(f"{wire.FIELD}: {e.errors(include_url=False)[0]['msg']}", param=wire.FIELD)
        ) from None
    return await handler(request)


async def _sweep(app: web.Application) -> AsyncIterator[None]:
    kvs = app[KV_TRANSFER_KEY]

    async def loop() -> None:
        while True:
            await asyncio.sleep(_SWEEP_SECONDS)
            engine = app[STATE_KEY].engine
            if engine is None or kvs.holds is None or not len(kvs.holds):
                continue
            with contextlib.suppress(Exception):
                n = await engine.call(lambda core: kvs.holds_of(core).expire(time.monotonic()))
                if n:
                    kvs.metrics.expired.inc(n)

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if isinstance(kvs.transport, HttpKVTransport):
        await kvs.transport.close()


def install(app: web.Application) -> None:
    """Add disaggregation to a pod app (before it starts): the middleware, the two routes, the hold sweeper."""
    app[KV_TRANSFER_KEY] = KVTransferState(app[STATE_KEY].metrics.registry)
    app.middlewares.append(kv_transfer_middleware)
    app.router.add_post(wire.FETCH_PATH, fetch_endpoint)
    app.router.add_delete(wire.HOLDS_PATH + "/{hold_id}", release_endpoint)
    app.cleanup_ctx.append(_sweep)
    app.on_response_prepare.append(_name_hold)
