"""Prefill/decode disaggregation on the virtual clock: a prompt's KV moves from a prefill pod to a decode pod.

The pods' side is the engine's own code: the prefill pod holds the prompt's full blocks when the request
finishes (`KVHolds.hold`, in the same step, so every block is still cached), the decode pod counts the blocks
it already holds (`cached_prefix_len`) and inserts the rest as free prefix-cache blocks
(`insert_prefix_blocks`), then runs the request as an ordinary one continuing the first token (as the
decode pod continues the prefill pod's stream) — its prefix lookup hits the inserted blocks. What is modelled
is only the wire: a transfer of the missing blocks takes `transfer_latency_s + bytes / link`. Tensor-parallel
pods neither hold nor fetch KV, as the engine does today (a pod's process holds only rank 0's shard of each
block): their decode pods compute the prompt themselves (counted as fallbacks).

The client sees the first token when the prefill pod produces it (the router streams it at once), then the
decode pod's tokens; the gap between the two (transfer + the decode pod's first step) is an inter-token gap.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tokenfleet.runtime.engine.kv_cache.kv_holds import KVHolds
from tokenfleet.sim.config import Disaggregation
from tokenfleet.sim.replica import RequestRecord, SimReplica


def _connector():
    # kv_connector imports torch (its copy functions move tensors): only disaggregated runs pay that import.
    from tokenfleet.runtime.engine.kv_cache import kv_connector

    return kv_connector


@dataclass(slots=True)
class Handoff:
    """One request between its phases."""

    prefill: RequestRecord  # the prefill pod's record (first token, cache hits, queueing)
    prefill_pod: str
    hold_id: str
    num_held: int  # blocks the prefill pod holds for it
    decode_pod: str | None = None
    num_sent: int = 0  # blocks that crossed the link (the decode pod lacked them)
    start: float = 0.0


class KVHandoffs:
    def __init__(
        self, spec: Disaggregation, kv_bytes_per_token: float, block_size: int, tp: int, clock
    ) -> None:
        self.spec = spec
        self.clock = clock
        self.block_bytes = kv_bytes_per_token * block_size
        self.block_size = block_size
        self.bytes_per_s = spec.link_gb_per_s * 1e9
        self.tp = tp
        self._holds: dict[str, KVHolds] = {}
        self._ids = itertools.count()
        self.num_transfers = 0
        self.num_fallbacks = 0  # holds expired before the fetch: the decode pod recomputed the prompt
        self.blocks_sent = 0
        self.blocks_skipped = 0  # already on the decode pod
        self.transfer_seconds: list[float] = []

    def holds_of(self, replica: SimReplica) -> KVHolds:
        holds = self._holds.get(replica.name)
        if holds is None:
            holds = self._holds[replica.name] = KVHolds(replica.kv, self.clock)
        return holds

    def hold(self, replica: SimReplica, record: RequestRecord, now: float) -> Handoff:
        """The prefill finished on `replica` (this very step): hold its prompt's full blocks."""
        sreq = record.request
        hold_id = f"h{next(self._ids)}"
        if self.tp > 1:  # no hold: the decode pod computes the prompt (see the module docstring)
            return Handoff(record, replica.name, hold_id, 0)
        hold = self.holds_of(replica).hold(
            hold_id, sreq.block_hashes, sreq.prompt, None, now + self.spec.hold_seconds
        )
        return Handoff(record, replica.name, hold_id, len(hold.blocks))

    def start(self, handoff: Handoff, prefill: SimReplica | None, decode: SimReplica, now: float) -> float:
        """The decode pod fetches what it lacks; the transfer's duration. A hold that expired while the
        request waited for a decode pod is gone (the prefill pod sweeps its holds): the decode pod then
        computes the prompt itself, as after any failed transfer."""
        if self.tp > 1:
            self.num_fallbacks += 1
        elif prefill is not None:
            holds = self.holds_of(prefill)
            holds.expire(now)
            if holds.num_blocks(handoff.hold_id) is None:
                handoff.num_held = 0
                self.num_fallbacks += 1
        hashes = handoff.prefill.request.block_hashes[: handoff.num_held]
        have = _connector().cached_prefix_len(decode.kv, hashes)
        handoff.decode_pod = decode.name
        handoff.num_sent = max(0, len(hashes) - have)
        handoff.start = now
        duration = self.spec.transfer_latency_s + handoff.num_sent * self.block_bytes / self.bytes_per_s
        self.num_transfers += 1
        self.blocks_sent += handoff.num_sent
        self.blocks_skipped += len(hashes) - handoff.num_sent
        self.transfer_seconds.append(duration)
        return duration

    def finish(self, handoff: Handoff, prefill: SimReplica | None, decode: SimReplica) -> int:
        """The blocks arrived: insert them on the decode pod, release the hold; blocks inserted."""
        kvc = _connector()
        sreq = handoff.prefill.request
        bs = self.block_size
        hashes = sreq.block_hashes[: handoff.num_held]
        have = kvc.cached_prefix_len(decode.kv, hashes)  # may have grown (or shrunk) meanwhile
        inserted = 0
        if have < len(hashes):
            inserted = kvc.insert_prefix_blocks(
                decode.kv,
                hashes[have:],
                sreq.prompt[have * bs : len(hashes) * bs],
                hashes[have - 1] if have else None,
                len,  # the "copy" writes every block it is given
            )
        if prefill is not None:
            holds = self.holds_of(prefill)
            hold = holds.take(handoff.hold_id)  # None after an expiry
            if hold is not None:
                holds.free(hold)
        return inserted

    def summary(self) -> dict:
        return {
            "transfers": self.num_transfers,
            "blocks_sent": self.blocks_sent,
            "blocks_already_on_decode_pod": self.blocks_skipped,
            "bytes_sent": self.blocks_sent * self.block_bytes,
            "fallbacks_to_recompute": self.num_fallbacks,
        }
