"""The KV-event wire both ways: what the pod writes (`to_json`) reads back (`from_json`) unchanged, and a
reader refuses anything malformed with an error naming the field."""

from __future__ import annotations

import json

import pytest
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra
from tokenfleet.runtime.kv_wire import KVEventsReply, KVWireEvent, WireFormatError
from tokenfleet.runtime.server.kv_event_log import KVEventLog

EXTRA = hash_extra("m")
H = tuple(block_hashes_for(list(range(64)), 16, EXTRA))


def test_every_event_type_round_trips_through_json():
    for event in [
        KVWireEvent("stored", H),
        KVWireEvent("removed", H[:1]),
        KVWireEvent("cleared"),
        KVWireEvent("scheduled", H[:2]),
    ]:
        assert KVWireEvent.from_json(json.loads(json.dumps(event.to_json()))) == event


def test_the_pods_own_reply_parses_to_what_it_published():
    from tokenfleet.runtime.engine.kv_cache.kv_events import BlockStored, PrefillScheduled

    log = KVEventLog(16, EXTRA)
    log.publish([BlockStored(H[:3], None, (), 16), PrefillScheduled(H)])
    reply = KVEventsReply.from_json(json.loads(json.dumps(log.read(0, log.epoch))))
    assert (reply.epoch, reply.seq, reply.block_size, reply.hash_extra, reply.reset) == (
        log.epoch,
        1,
        16,
        EXTRA,
        False,
    )
    assert reply.events == (KVWireEvent("stored", H[:3]), KVWireEvent("scheduled", H))
    assert KVEventsReply.from_json(reply.to_json()) == reply
    resync = KVEventsReply.from_json(log.read(None, None))
    assert resync.reset and [e.type for e in resync.events] == ["cleared", "stored"]
    assert set(resync.events[1].block_hashes) == set(H[:3])


def _reply(**over) -> dict:
    reply = {
        "epoch": "e1",
        "seq": 3,
        "reset": False,
        "block_size": 16,
        "hash_extra": list(EXTRA),
        "events": [],
    }
    return reply | over


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        ([], "must be a JSON object, got list"),
        ({k: v for k, v in _reply().items() if k != "epoch"}, "missing 'epoch'"),
        (_reply(epoch=7), "'epoch' must be str, got int"),
        (_reply(seq="3"), "'seq' must be int, got str"),
        (_reply(seq=True), "'seq' must be int, got bool"),
        (_reply(seq=-1), "'seq' must be >= 0"),
        (_reply(block_size=0), "'block_size' must be >= 1"),
        (_reply(hash_extra="m"), "'hash_extra' must be list"),
        (_reply(hash_extra=[1.5]), "'hash_extra' items must be str, int or null"),
        (_reply(reset="yes"), "'reset' must be a bool"),
        (_reply(events={"type": "stored"}), "'events' must be list"),
        (_reply(events=["stored"]), "event 0: kv event must be a JSON object"),
        (_reply(events=[{"kind": "stored"}]), "event 0: kv event: missing 'type'"),
        (_reply(events=[{"type": "cleared"}, {"type": "teleported"}]), "event 1: unknown kv event type"),
        (_reply(events=[{"type": "stored", "block_hashes": "abcd"}]), "'block_hashes' must be a list"),
        (_reply(events=[{"type": "stored", "block_hashes": ["zz"]}]), "'block_hashes' must be hex strings"),
        (_reply(events=[{"type": "stored", "block_hashes": [12]}]), "'block_hashes' must be hex strings"),
    ],
)
def test_malformed_replies_are_refused_naming_the_problem(obj, says):
    with pytest.raises(WireFormatError) as err:
        KVEventsReply.from_json(obj)
    assert says in str(err.value)


def test_optional_fields_take_their_defaults():
    reply = KVEventsReply.from_json({k: v for k, v in _reply().items() if k != "reset"})
    assert reply.reset is False and reply.events == ()
    assert KVWireEvent.from_json({"type": "cleared"}) == KVWireEvent("cleared")
