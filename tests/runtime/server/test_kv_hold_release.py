"""A prefill pod's hold released before its prefill finished: never taken, so none of its blocks stay pinned.

A streamed prefill names its hold in the response header, before the request finishes; the router's DELETE
(the client left, or the decode side gave the blocks up) can then reach the pod while the hold is only
announced. Real engine core, real KV manager and KVHolds, the pod's real app and routes; only the
engine's thread hop is replaced by a direct call (the test drives the engine steps itself).
"""

from __future__ import annotations

import time

from aiohttp.test_utils import TestClient, TestServer
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.openai import kv_transfer as wire
from tokenfleet.runtime.server.app import STATE_KEY, build_app
from tokenfleet.runtime.server.kv_transfer import KV_TRANSFER_KEY

ONE = SamplingParams(temperature=0, max_tokens=1)


class _Engine:
    """The part of the AsyncEngine the KV routes use: `call(fn)` runs `fn(core)` between steps."""

    def __init__(self, core):
        self.core = core

    async def call(self, fn):
        return fn(self.core)


def _step_until_finished(core, request_id: str, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if any(o.request_id == request_id and o.finished for o in core.step()):
            return
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


def _setup(default_model):
    llm = LLM(config=RuntimeConfig(), loaded=default_model, dtype="float32", block_size=16, num_blocks=8)
    core, km = llm.engine, llm.engine.kv_manager
    app = build_app(RuntimeConfig())
    app[STATE_KEY].engine = _Engine(core)  # set once built, as the pod does when its model has loaded
    text = "The printing press changed how books were made. " * 8
    ids = default_model.tokenizer.encode(text, add_special_tokens=False)[:64]
    hashes = block_hashes_for(ids, km.block_size, km.hash_extra)  # 4 full blocks
    return core, km, app, ids, hashes


async def test_a_release_before_the_prefill_finishes_cancels_the_announced_hold(default_model):
    core, km, app, ids, hashes = _setup(default_model)
    holds = app[KV_TRANSFER_KEY].holds_of(core)
    pending = holds.expect("h", hashes, ids, None, ttl=30.0)
    core.add_request("prefill", ids, ONE)
    async with TestClient(TestServer(app)) as client:
        r = await client.delete(f"{wire.HOLDS_PATH}/h")  # the prefill has not finished: only announced
        assert r.status == 200 and await r.json() == {"released": "h"}
        _step_until_finished(core, "prefill")
        # The finish did not take it: nothing is held, every block is back in the pool.
        assert pending.held is None and len(holds) == 0 and holds.num_pending == 0
        assert holds.num_held_blocks == 0 and km.num_free_blocks == km.num_blocks
        # Nor does the pod's fallback for a request that finished without the listener taking its hold.
        assert holds.hold_pending(pending, time.monotonic() + 30.0) is None
        assert len(holds) == 0 and km.num_free_blocks == km.num_blocks
        r = await client.delete(f"{wire.HOLDS_PATH}/h")  # it ended once: a second release finds nothing
        assert r.status == 404


async def test_a_release_after_the_prefill_finished_frees_the_taken_hold(default_model):
    core, km, app, ids, hashes = _setup(default_model)
    holds = app[KV_TRANSFER_KEY].holds_of(core)
    pending = holds.expect("h", hashes, ids, None, ttl=30.0)
    core.add_request("prefill", ids, ONE)
    _step_until_finished(core, "prefill")
    assert pending.held is not None and holds.num_held_blocks == 4
    assert km.num_free_blocks == km.num_blocks - 4
    async with TestClient(TestServer(app)) as client:
        r = await client.delete(f"{wire.HOLDS_PATH}/h")
        assert r.status == 200 and await r.json() == {"released": "h"}
    assert len(holds) == 0 and km.num_free_blocks == km.num_blocks


def test_the_fallback_takes_an_announced_hold_that_was_not_cancelled(default_model):
    core, km, app, ids, hashes = _setup(default_model)
    holds = app[KV_TRANSFER_KEY].holds_of(core)
    core.finish_listeners.clear()  # a finish the listener does not see: the fallback has to take it
    pending = holds.expect("h", hashes, ids, None, ttl=30.0)
    core.add_request("prefill", ids, ONE)
    _step_until_finished(core, "prefill")
    assert pending.held is None and holds.num_pending == 1
    held = holds.hold_pending(pending, deadline=time.monotonic() + 30.0)
    assert held is pending.held and len(held.blocks) == 4 and holds.num_pending == 0
    assert holds.hold_pending(pending, deadline=0.0) is held  # taken once
    assert holds.cancel("h") and km.num_free_blocks == km.num_blocks
