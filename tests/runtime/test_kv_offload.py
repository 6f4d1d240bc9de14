"""The host KV tier: blocks evicted from the device pool come back by copy, byte-identical, in order."""

from __future__ import annotations

import pytest
import torch
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_extra
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.kv_cache.offload import HostKVTier, KVTransfer
from tokenfleet.runtime.engine.kv_cache.offload_copy import HostKVBuffers
from tokenfleet.runtime.engine.request import Request, RequestStatus
from tokenfleet.runtime.engine.sampling_params import SamplingParams

BS = 4
SHAPE = (BS, 2, 8)  # block_size, kv heads, head dim


def kv_caches(num_blocks: int, num_layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(num_blocks, *SHAPE), torch.zeros(num_blocks, *SHAPE)) for _ in range(num_layers)]


class Device:
    """A manager with a host tier over real tensors; `compute` writes each block's KV like a forward."""

    def __init__(self, num_blocks: int, host_slots: int):
        self.km = KVCacheManager(num_blocks, BS, hash_extra=hash_extra("m"))
        self.host = HostKVTier(host_slots)
        self.caches = kv_caches(num_blocks)
        self.buffers = HostKVBuffers(self.caches, host_slots)
        self.km.attach_host_tier(self.host, lambda transfers: self.buffers.run(transfers, self.caches))

    def run(self, rid: str, tokens: list[int]) -> tuple[int, tuple[int, ...]]:
        """Admit, copy, 'compute' the missing blocks (KV = f(token ids)), finish; (hit tokens, block ids)."""
        r = Request(rid, list(tokens), SamplingParams(max_tokens=1))
        hits, num_hit = self.km.get_computed_blocks(r)
        assert self.km.allocate_slots(r, r.num_tokens - num_hit, hits) is not None
        assert self.host.take_transfers() == []  # the manager ran them already
        block_ids = self.km.get_block_ids(rid)
        for i, bid in enumerate(block_ids[num_hit // BS :], start=num_hit // BS):
            for layer, (k, v) in enumerate(self.caches):
                k[bid] = expected_kv(tokens[i * BS : (i + 1) * BS], layer, 0)
                v[bid] = expected_kv(tokens[i * BS : (i + 1) * BS], layer, 1)
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.FINISHED_LENGTH
        self.km.free(r)
        return num_hit, block_ids

    def assert_holds(self, block_ids, tokens: list[int]) -> None:
        for i, bid in enumerate(block_ids[: len(tokens) // BS]):
            for layer, (k, v) in enumerate(self.caches):
                assert torch.equal(k[bid], expected_kv(tokens[i * BS : (i + 1) * BS], layer, 0))
                assert torch.equal(v[bid], expected_kv(tokens[i * BS : (i + 1) * BS], layer, 1))


def expected_kv(block_tokens: list[int], layer: int, kv: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((tuple(block_tokens), layer, kv)) % 2**31)
    return torch.randn(SHAPE, generator=g)


def test_evicted_prefix_comes_back_from_the_host_tier_with_identical_kv():
    dev = Device(num_blocks=4, host_slots=8)
    doc = list(range(13))  # 3 full blocks + 1 token
    assert dev.run("a", doc) == (0, (0, 1, 2, 3))
    dev.run("other", list(range(100, 116)))  # 4 blocks: pressure evicts all of a's cached blocks
    assert dev.host.num_blocks_offloaded == 3 and len(dev.host) == 3
    hit, block_ids = dev.run("a2", doc)
    assert hit == 12  # 3 blocks copied back instead of recomputed
    dev.assert_holds(block_ids, doc)
    m = dev.km.metrics()
    assert (m.device_hit_blocks, m.host_hit_blocks, m.loaded_blocks) == (0, 3, 3)
    assert m.evicted_pressure_blocks >= 3 and m.host_used_blocks == len(dev.host)


def test_a_prefix_split_across_tiers_is_found_in_both():
    dev = Device(num_blocks=6, host_slots=8)
    doc = list(range(17))  # 4 full blocks
    assert dev.run("a", doc)[1] == (0, 1, 2, 3, 4)  # freed tail first: 4 (partial: empty), 3, 2, 1, 0
    assert dev.run("b", list(range(200, 212)))[1] == (5, 4, 3)  # empty ones, then evicts block 3
    hit, block_ids = dev.run("a2", doc)
    assert hit == 16
    assert block_ids[:3] == (0, 1, 2)  # device hits; the 4th block came back from the host
    dev.assert_holds(block_ids, doc)
    m = dev.km.metrics()
    assert (m.device_hit_blocks, m.host_hit_blocks, m.miss_blocks) == (3, 1, 4 + 2)  # a, b missed


def test_host_tier_evicts_its_least_recently_used_and_stays_inclusive():
    tier = HostKVTier(2)
    tier.offload(0, b"a")
    tier.offload(1, b"b")
    assert tier.load(b"a", 5)  # a is now the most recent
    tier.offload(2, b"c")  # evicts b
    assert tier.hashes() == [b"a", b"c"] and tier.num_evicted == 1
    tier.offload(7, b"a")  # still held: no copy
    assert tier.take_transfers() == [
        KVTransfer(True, 0, 0),
        KVTransfer(True, 1, 1),
        KVTransfer(False, 5, 0),
        KVTransfer(True, 2, 1),
    ]


def test_copies_run_in_recorded_order_when_a_block_is_evicted_and_refilled_in_one_step():
    caches = kv_caches(2, num_layers=1)
    caches[0][0][0] = 1.0
    buffers = HostKVBuffers(caches, 2)
    buffers.buffers[0][0][1] = 2.0
    # block 0's KV goes out to slot 0, then slot 1 comes into block 0, then block 0 goes out to slot 1
    buffers.run([KVTransfer(True, 0, 0), KVTransfer(False, 0, 1), KVTransfer(True, 0, 1)], caches)
    assert buffers.buffers[0][0][0].eq(1.0).all() and buffers.buffers[0][0][1].eq(2.0).all()
    assert caches[0][0][0].eq(2.0).all()


def test_resizing_keeps_the_most_recent_entries_and_their_kv():
    caches = kv_caches(4, num_layers=1)
    tier, buffers = HostKVTier(3), HostKVBuffers(caches, 3)
    for bid in range(3):
        caches[0][0][bid] = float(bid + 1)
        tier.offload(bid, f"h{bid}".encode())
    buffers.run(tier.take_transfers(), caches)
    buffers.resize(tier.resize(2), 2)
    assert tier.hashes() == [b"h1", b"h2"] and tier.num_slots == 2
    assert tier.load(b"h2", 3)
    buffers.run(tier.take_transfers(), caches)
    assert caches[0][0][3].eq(3.0).all()
    with pytest.raises(ValueError):
        tier.resize(0)


# ---- with the model: the host tier changes no output -----------------------------------------------------

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "books were made, sold and read across Europe. Within fifty years presses worked in hundreds of towns, "
    "and the price of a book fell so far that students could own the texts they studied. "
)


def _llm(default_model, cpu_offload_gib: float):
    from tokenfleet.runtime.config import RuntimeConfig
    from tokenfleet.runtime.engine.cache_policy import CachePolicyRuntime
    from tokenfleet.runtime.engine.llm import LLM

    # 8 blocks of 16 tokens: a 124-token request (+2 generated) needs all of them, evicting everything.
    llm = LLM(config=RuntimeConfig(), loaded=default_model, dtype="float32", block_size=16, num_blocks=8)
    policy = getattr(llm.engine, "cache_policy", None) or CachePolicyRuntime(llm.engine)
    policy.apply(llm.config.cache.model_copy(update={"cpu_offload_gib": cpu_offload_gib}))
    return llm


def test_greedy_output_after_a_host_round_trip_matches_no_offload_and_cold(default_model):
    greedy = SamplingParams(temperature=0, max_tokens=2)
    ids = default_model.tokenizer.encode(TEXT * 4, add_special_tokens=False)
    doc_a, doc_b = ids[:70], ids[70:194]
    assert len(doc_b) == 124
    with_host, without = _llm(default_model, 0.01), _llm(default_model, 0.0)  # ~14 host blocks
    outs = {}
    for name, llm in (("host", with_host), ("none", without)):
        cold = llm.generate([doc_a], greedy)[0]
        llm.generate([doc_b], greedy)  # evicts all of doc_a's blocks (to the host tier, if any)
        again = llm.generate([doc_a], greedy)[0]
        outs[name] = (cold, again)
        km = llm.engine.kv_manager
        assert km.num_free_blocks == km.num_blocks  # no leaked blocks
    cold, from_host = outs["host"]
    _, recomputed = outs["none"]
    assert cold.num_cached_tokens == 0 and recomputed.num_cached_tokens == 0
    assert from_host.num_cached_tokens == 64  # 4 full blocks copied back, not recomputed
    assert from_host.outputs[0].token_ids == cold.outputs[0].token_ids == recomputed.outputs[0].token_ids
    m = with_host.engine.kv_manager.metrics()
    assert m.host_hit_blocks == 4 and m.loaded_blocks == 4 and m.offloaded_blocks >= 4
