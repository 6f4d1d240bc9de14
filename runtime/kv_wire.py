"""Wire format of the pod -> router KV-event stream: `GET /v1/kv-events` and `GET /load` on every pod.

Wire format (JSON, one object per response; long poll):

    GET /v1/kv-events?since=SEQ&epoch=EPOCH&wait=SECONDS
    -> {"epoch": str, "seq": int, "reset": bool, "block_size": int, "hash_extra": [str | int | null, ...],
        "events": [{"type": "stored" | "removed" | "cleared" | "scheduled", "block_hashes": [hex, ...]}, ...]}

`seq` counts published batches. The reply holds every batch after `since` (waiting up to `wait` seconds,
at most 10, when there is none yet). When the router cannot be brought up to date incrementally — it is
new (no `since`), `since` fell out of the retained window (a gap), or `epoch` differs (the pod restarted and
its seq started over) — the reply is a resync: `reset: true` and the events are one `cleared` followed by
one `stored` with every block hash the pod holds now. The log tracks that set itself from the events it
publishes, so a resync never touches the engine's block pool from the HTTP thread. A router that starts
(or restarts) therefore has a warm index after its first poll.

`scheduled` is not a cache change: the pod started computing a prompt whose full blocks have these
hashes (sent when the request is first scheduled, before the forward pass). Every router following the
pod learns it within one poll, so requests sharing that prefix follow it to this pod while its prefill
runs, whichever router replica they reach; `stored` confirms the blocks once their KV is written.

    GET /load -> {"num_running": int, "num_waiting": int, "kv_cache_usage": float,
                  "tokenizer_digest": str | null, "access": {path: {"needs": ..., "why": ...}}}

`tokenizer_digest` is that of the pod's `GET /v1/tokenizer` (openai/tokenizer_wire.py): a router that
fetched the tokenizer refetches it when the digest changes. `access` is for people (which key each
endpoint needs and why); routers ignore it.

`hash_extra` is the pod's base extra of the block hash (`block_hash.hash_extra(model_name, pod_salt)`): the
router appends a request's `cache_salt` with `block_hash.with_salt` exactly as the engine does, so it computes
the same chained hashes from the same token ids.

The pod serves it (`runtime/server/kv_event_log.py`); the router consumes it (`runtime/router/kv_events.py`).
Both share only the dataclasses below.
"""

from __future__ import annotations

from dataclasses import dataclass

EVENT_TYPES = ("stored", "removed", "cleared", "scheduled")
MAX_WAIT_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class KVEvent:
    type: str  # stored | removed | cleared | scheduled
    block_hashes: tuple[bytes, ...] = ()

    def to_json(self) -> dict:
        return {"type": self.type, "block_hashes": [h.hex() for h in self.block_hashes]}


@dataclass(frozen=True, slots=True)
class LoadReport:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    tokenizer_digest: str | None = None

    def to_json(self) -> dict:
        out: dict = {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_cache_usage": self.kv_cache_usage,
        }
        if self.tokenizer_digest is not None:
            out["tokenizer_digest"] = self.tokenizer_digest
        return out
