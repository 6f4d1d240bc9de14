"""The KV-event stream end to end over loopback HTTP: incremental updates, long poll, resync on gap/restart."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra
from tokenfleet.runtime.engine.kv_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tokenfleet.runtime.kv_wire import LoadReport
from tokenfleet.runtime.router.kv_events import KVEventFollower, apply_reply
from tokenfleet.runtime.router.prefix_index import ExactPrefixIndex
from tokenfleet.runtime.server.kv_event_log import KVEventLog, make_kv_events_app

EXTRA = hash_extra("m")
H = block_hashes_for(list(range(64)), 16, EXTRA)


def stored(hashes) -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 16)


def test_log_incremental_then_gap_resync():
    log = KVEventLog(16, EXTRA, retain_batches=2)
    first = log.read(None, None)
    assert first["reset"] and first["seq"] == 0
    log.publish([stored(H[:2])])
    log.publish([BlockRemoved((H[0],))])
    inc = log.read(0, log.epoch)
    assert not inc["reset"] and inc["seq"] == 2
    assert [e["type"] for e in inc["events"]] == ["stored", "removed"]
    log.publish([stored(H[2:])])  # the window holds batches 2..3 now: since=0 is a gap
    gap = log.read(0, log.epoch)
    assert gap["reset"] and gap["seq"] == 3
    assert sorted(gap["events"][1]["block_hashes"]) == sorted(h.hex() for h in H[1:])
    assert log.read(3, "another-epoch")["reset"]  # the pod restarted: its seq means something else
    log.publish([AllBlocksCleared()])
    assert log.read(None, None)["events"][1]["block_hashes"] == []


def test_apply_reply_with_reset_replaces_the_endpoint_view():
    idx = ExactPrefixIndex()
    idx.stored("p", H)
    log = KVEventLog(16, EXTRA)
    log.publish([stored(H[:1])])
    pos = apply_reply(idx, "p", log.read(None, None))
    assert (pos.seq, pos.block_size, pos.hash_extra) == (1, 16, EXTRA)
    assert idx.match(H, ["p"]) == {"p": 1}
    with pytest.raises(ValueError):
        apply_reply(
            idx,
            "p",
            {
                "events": [{"type": "stored", "block_hashes": ["zz"]}],
                "epoch": "e",
                "seq": 1,
                "block_size": 16,
                "hash_extra": [],
            },
        )


async def test_follower_tracks_a_pod_over_http_and_resyncs_after_restart(serve_app):
    log = KVEventLog(16, EXTRA)
    load = LoadReport(2, 1, 0.25)
    idx = ExactPrefixIndex()
    async with serve_app(make_kv_events_app(log, lambda: load)) as url, aiohttp.ClientSession() as session:
        async with session.get(url + "/load") as r:
            assert await r.json() == {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25}
        follower = KVEventFollower(session, url, "p", idx, wait_seconds=5.0)
        await follower.poll_once()  # initial resync
        assert follower.live and idx.match(H, ["p"]) == {"p": 0}
        poll = asyncio.create_task(follower.poll_once())  # long poll: waits for the next batch
        await asyncio.sleep(0.1)
        assert not poll.done()
        log.publish([stored(H[:3])])
        await asyncio.wait_for(poll, 2.0)
        assert idx.match(H, ["p"]) == {"p": 3}
        log.publish([BlockRemoved((H[1],))])
        await follower.poll_once()
        assert idx.match(H, ["p"]) == {"p": 1}
        epoch_before = follower.position.epoch

    # The "pod" restarts with an empty cache and a fresh epoch on the same port: the follower resyncs.
    restarted = KVEventLog(16, EXTRA)
    restarted.publish([stored(H[:2])])
    port = int(url.rsplit(":", 1)[1])
    async with (
        serve_app(make_kv_events_app(restarted, lambda: load), port) as url2,
        aiohttp.ClientSession() as session,
    ):
        assert url2 == url
        follower._session = session
        await follower.poll_once()
        assert follower.position.epoch != epoch_before
        assert idx.match(H, ["p"]) == {"p": 2}


async def test_follower_drops_stale_state_when_the_stream_is_gone(serve_app):
    idx = ExactPrefixIndex()
    log = KVEventLog(16, EXTRA)
    log.publish([stored(H)])
    async with (
        serve_app(make_kv_events_app(log, lambda: LoadReport(0, 0, 0.0))) as url,
        aiohttp.ClientSession() as s,
    ):
        follower = KVEventFollower(s, url, "p", idx, wait_seconds=0.05, retry_seconds=0.05)
        task = asyncio.create_task(follower.run())
        for _ in range(100):
            if follower.live:
                break
            await asyncio.sleep(0.02)
        assert idx.match(H, ["p"]) == {"p": 4}
    for _ in range(100):  # the server is gone
        if not follower.live:
            break
        await asyncio.sleep(0.02)
    assert not follower.live and idx.match(H, ["p"]) == {"p": 0}
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_scheduled_prefills_reach_the_router_but_are_not_cached_blocks():
    from tokenfleet.runtime.engine.kv_cache.kv_events import PrefillScheduled

    log = KVEventLog(16, EXTRA)
    hashes = tuple(block_hashes_for(list(range(48)), 16, EXTRA))
    log.publish([PrefillScheduled(hashes)])
    seen: list[tuple[str, tuple[bytes, ...]]] = []
    index = ExactPrefixIndex()
    reply = log.read(0, log.epoch)
    apply_reply(index, "pod", reply, lambda ep, hs: seen.append((ep, hs)))
    assert seen == [("pod", hashes)] and index.num_blocks("pod") == 0
    # A new subscriber's snapshot holds only what is cached.
    snapshot = log.read(None, None)
    assert [e["type"] for e in snapshot["events"]] == ["cleared", "stored"]
    assert snapshot["events"][1]["block_hashes"] == []


def _reply(epoch="e1", seq=1, events=(), reset=False, **over):
    reply = {"epoch": epoch, "seq": seq, "reset": reset, "block_size": 16, "hash_extra": list(EXTRA)}
    reply["events"] = [{"type": t, "block_hashes": [h.hex() for h in hs]} for t, hs in events]
    return reply | over


def test_replies_that_do_not_follow_on_or_do_not_parse_are_rejected_whole():
    from tokenfleet.runtime.router.kv_events import StreamError

    idx = ExactPrefixIndex()
    pos = apply_reply(idx, "p", _reply(seq=1, reset=True, events=[("cleared", []), ("stored", H[:3])]))
    bad = {
        "epoch": _reply(epoch="e2", seq=2, events=[("stored", H)]),  # the pod restarted, no resync
        "order": _reply(seq=0, events=[("removed", H[:1])]),  # goes back
        "malformed": _reply(seq=2, events=[("stored", H), ("teleported", H)]),  # applies nothing, not H
    }
    also_malformed = [
        _reply(seq=2, events=[("stored", H)]) | {"events": [{"type": "stored", "block_hashes": "abc"}]},
        _reply(seq=2) | {"events": "nope"},
        _reply(seq=2, block_size=0),
        {"seq": 2},
    ]
    for reason, reply in [*bad.items(), *(("malformed", r) for r in also_malformed)]:
        with pytest.raises(StreamError) as err:
            apply_reply(idx, "p", reply, previous=pos)
        assert err.value.reason == reason
        assert idx.match(H, ["p"]) == {"p": 3} and idx.num_blocks("p") == 3  # untouched
    same_seq_no_events = apply_reply(idx, "p", _reply(seq=1), previous=pos)  # a long poll that timed out
    assert same_seq_no_events == pos
    resync = apply_reply(
        idx, "p", _reply(epoch="e2", seq=5, reset=True, events=[("stored", H[:1])]), None, pos
    )
    assert resync.epoch == "e2" and idx.match(H, ["p"]) == {"p": 1}


async def test_follower_counts_bad_replies_drops_the_endpoint_and_resyncs(serve_app):
    """A pod whose stream misbehaves (a new epoch without a resync, then garbage): the follower keeps
    running, counts each rejection, never applies a bad reply, and ends on the pod's resync snapshot."""
    from aiohttp import web

    script = [
        _reply(seq=1, reset=True, events=[("cleared", []), ("stored", H[:3])]),
        _reply(epoch="e2", seq=2, events=[("stored", H)]),  # rejected: epoch
        _reply(epoch="e2", seq=2, reset=True, events=[("cleared", []), ("stored", H[:2])]),
        _reply(epoch="e2", seq=3, events=[("stored", H[2:])]) | {"events": [{"kind": "stored"}]},  # malformed
        _reply(epoch="e2", seq=3, reset=True, events=[("cleared", []), ("stored", H[:1])]),
    ]
    asked: list[dict] = []

    async def events(request: web.Request) -> web.Response:
        asked.append(dict(request.query))
        if len(asked) > len(script):
            await asyncio.sleep(0.05)
            return web.json_response(_reply(epoch="e2", seq=3))
        return web.json_response(script[len(asked) - 1])

    app = web.Application()
    app.router.add_get("/v1/kv-events", events)
    idx = ExactPrefixIndex()
    rejected: list[str] = []
    async with serve_app(app) as url, aiohttp.ClientSession() as session:
        follower = KVEventFollower(
            session, url, "p", idx, on_error=rejected.append, wait_seconds=0.05, retry_seconds=0.01
        )
        task = asyncio.create_task(follower.run())
        for _ in range(200):
            if len(asked) > len(script) + 1:
                break
            await asyncio.sleep(0.02)
        assert not task.done()
        assert follower.live and idx.match(H, ["p"]) == {"p": 1}
        assert follower.errors == {"epoch": 1, "malformed": 1} and rejected == ["epoch", "malformed"]
        # After each rejection the follower asked afresh (no position): that is what makes the pod resync.
        assert "since" not in asked[2] and "since" not in asked[4] and asked[1]["since"] == "1"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
