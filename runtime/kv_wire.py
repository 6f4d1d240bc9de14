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
                  "tokenizer_digest": str | null, "lora_adapters": {name: key, ...}, "lora_room": int,
                  "lora_pinned": [name, ...], "lora_active": [name, ...], "lora_slots": int,
                  "access": {path: {"needs": ..., "why": ...}}}

`tokenizer_digest` is that of the pod's `GET /v1/tokenizer` (openai/tokenizer_wire.py): a router that
fetched the tokenizer refetches it when the digest changes. `access` is for people (which key each
endpoint needs and why); routers ignore it.

`hash_extra` is the pod's base extra of the block hash (`block_hash.hash_extra(model_name, pod_salt)`): the
router appends a request's `cache_salt` with `block_hash.with_salt` exactly as the engine does, so it computes
the same chained hashes from the same token ids. `lora_adapters` (only on a pod serving LoRA adapters) maps
each loaded adapter to the key its requests' blocks are hashed with (`block_hash.with_adapter`: the name and
the weights' digest), so a router hashes an adapter's prompt as that pod does — and knows which pods hold
which adapter. `lora_room` (with it) counts the adapters the pod could load now: host places free or held
by an adapter no request is using nor a pin holds; at 0 a request for an adapter it does not hold would be
refused (503). `lora_pinned` lists the adapters pinned there now (kept loaded for a lease: an adapter's
minimum copies); the operator reads it, routers ignore it. `lora_active` lists the adapters with requests in
flight there (waiting or running) and `lora_slots` how many distinct adapters one step runs (`max_loras`):
a request for an adapter that is not active waits for a slot while `lora_slots` are, however much host
room there is, so routers count both.

The pod serves it (`runtime/server/kv_event_log.py`); the router consumes it (`runtime/router/kv_events.py`).
Both share only the types below. The pod writes each event with `KVWireEvent.to_json`; the router reads a
whole reply with `KVEventsReply.from_json`, which checks every field and raises `WireFormatError` naming the
first thing wrong, so a reader never acts on half a message.
"""

from __future__ import annotations

from dataclasses import dataclass

EVENT_TYPES = ("stored", "removed", "cleared", "scheduled")
MAX_WAIT_SECONDS = 10.0


class WireFormatError(ValueError):
    """A message that does not follow this wire format; the text says which field and why."""


def _field(obj: dict, name: str, kinds: type | tuple[type, ...], where: str):
    if name not in obj:
        raise WireFormatError(f"{where}: missing {name!r}")
    value = obj[name]
    # bool is an int subclass: a count or size given as true/false is malformed, not 1/0.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise WireFormatError(f"{where}: {name!r} must be {_names(kinds)}, got {type(value).__name__}")
    return value


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _names(kinds: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kinds))


def _object(obj: object, where: str) -> dict:
    if not isinstance(obj, dict):
        raise WireFormatError(f"{where} must be a JSON object, got {type(obj).__name__}")
    return obj


@dataclass(frozen=True, slots=True)
class KVWireEvent:
    """One event as it travels (the engine's own event types are `engine.kv_cache.kv_events`)."""

    type: str  # stored | removed | cleared | scheduled
    block_hashes: tuple[bytes, ...] = ()

    def to_json(self) -> dict:
        return {"type": self.type, "block_hashes": [h.hex() for h in self.block_hashes]}

    @classmethod
    def from_json(cls, obj: object) -> KVWireEvent:
        obj = _object(obj, "kv event")
        kind = _field(obj, "type", str, "kv event")
        if kind not in EVENT_TYPES:
            raise WireFormatError(f"unknown kv event type {kind!r} (known: {', '.join(EVENT_TYPES)})")
        raw = obj.get("block_hashes", [])
        if not isinstance(raw, list):
            raise WireFormatError(f"{kind} event: 'block_hashes' must be a list, got {type(raw).__name__}")
        try:
            hashes = tuple(map(bytes.fromhex, raw))  # C-level: a resync carries every block the pod holds
        except (TypeError, ValueError) as e:
            raise WireFormatError(f"{kind} event: 'block_hashes' must be hex strings ({e})") from e
        return cls(kind, hashes)


@dataclass(frozen=True, slots=True)
class KVEventsReply:
    """One `GET /v1/kv-events` reply: the events after the poll's `since`, or a resync (`reset`)."""

    epoch: str
    seq: int
    block_size: int
    hash_extra: tuple[str | int | None, ...]
    events: tuple[KVWireEvent, ...] = ()
    reset: bool = False

    def to_json(self) -> dict:
        return {
            "epoch": self.epoch,
            "seq": self.seq,
            "reset": self.reset,
            "block_size": self.block_size,
            "hash_extra": list(self.hash_extra),
            "events": [e.to_json() for e in self.events],
        }

    @classmethod
    def from_json(cls, obj: object) -> KVEventsReply:
        where = "kv-events reply"
        obj = _object(obj, where)
        epoch = _field(obj, "epoch", str, where)
        seq = _field(obj, "seq", int, where)
        if seq < 0:
            raise WireFormatError(f"{where}: 'seq' must be >= 0, got {seq}")
        block_size = _field(obj, "block_size", int, where)
        if block_size < 1:
            raise WireFormatError(f"{where}: 'block_size' must be >= 1, got {block_size}")
        extra = _field(obj, "hash_extra", list, where)
        for part in extra:
            if part is not None and (not isinstance(part, str | int) or isinstance(part, bool)):
                raise WireFormatError(f"{where}: 'hash_extra' items must be str, int or null, got {part!r}")
        reset = obj.get("reset", False)
        if not isinstance(reset, bool):
            raise WireFormatError(f"{where}: 'reset' must be a bool, got {type(reset).__name__}")
        raw_events = _field(obj, "events", list, where)
        events = []
        for i, e in enumerate(raw_events):
            try:
                events.append(KVWireEvent.from_json(e))
            except WireFormatError as err:
                raise WireFormatError(f"{where}: event {i}: {err}") from None
        return cls(epoch, seq, block_size, tuple(extra), tuple(events), reset)


@dataclass(frozen=True, slots=True)
class LoadReport:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    tokenizer_digest: str | None = None
    lora_adapters: dict[str, str] | None = None  # adapter name -> its block-hash key; None: LoRA off
    lora_room: int | None = None  # adapters it could load now (free or idle host places); None: LoRA off
    lora_pinned: tuple[str, ...] | None = None  # adapters pinned now; None: LoRA off
    lora_active: tuple[str, ...] | None = None  # adapters with requests in flight; None: LoRA off
    lora_slots: int | None = None  # distinct adapters per step (max_loras); None: LoRA off

    def to_json(self) -> dict:
        out: dict = {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_cache_usage": self.kv_cache_usage,
        }
        if self.tokenizer_digest is not None:
            out["tokenizer_digest"] = self.tokenizer_digest
        if self.lora_adapters is not None:
            out["lora_adapters"] = dict(self.lora_adapters)
        if self.lora_room is not None:
            out["lora_room"] = self.lora_room
        if self.lora_pinned is not None:
            out["lora_pinned"] = list(self.lora_pinned)
        if self.lora_active is not None:
            out["lora_active"] = list(self.lora_active)
        if self.lora_slots is not None:
            out["lora_slots"] = self.lora_slots
        return out
