"""KVCacheManager through its public API: block tables, prefix hits, sharing, lazy caching, rollback."""

from __future__ import annotations

from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra
from tokenfleet.runtime.engine.kv_cache.kv_events import BlockRemoved, BlockStored
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampling_params import SamplingParams

BS = 4
EXTRA = hash_extra("m")


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def admit(km: KVCacheManager, r: Request) -> int:
    """What the scheduler does for a waiting request; returns the hit tokens."""
    hits, num_hit = km.get_computed_blocks(r)
    assert km.allocate_slots(r, r.num_tokens - num_hit, hits) is not None
    r.num_computed_tokens = num_hit
    return num_hit


def compute(r: Request) -> None:
    """The model ran over every scheduled token."""
    r.num_computed_tokens = r.num_tokens


def test_allocation_gives_exact_block_ids_and_grows_by_blocks():
    km = KVCacheManager(num_blocks=8, block_size=BS, hash_extra=EXTRA)
    r = req("a", range(10))
    assert admit(km, r) == 0
    assert km.get_block_ids("a") == (0, 1, 2)
    compute(r)
    r.output_token_ids += [100, 101]  # 12 tokens: still 3 blocks
    assert km.allocate_slots(r, 2) == ()
    r.num_computed_tokens = 12
    r.output_token_ids.append(102)
    new = km.allocate_slots(r, 1)
    assert [b.block_id for b in new] == [3]
    assert km.get_block_ids("a") == (0, 1, 2, 3)
    assert km.num_free_blocks == 4 and km.usage == 0.5


def test_shared_prefix_is_shared_with_ref_counts_and_counted_as_hits():
    km = KVCacheManager(num_blocks=10, block_size=BS, hash_extra=EXTRA)
    a = req("a", range(10))
    admit(km, a)
    compute(a)
    km.free(a)  # caches blocks 0, 1 (full, computed); block 2 holds a partial block
    b = req("b", [*range(8), 50, 51, 52])
    assert admit(km, b) == 8
    assert km.get_block_ids("b")[:2] == (0, 1)
    c = req("c", [*range(8), 60])
    assert admit(km, c) == 8
    blocks = km.pool.blocks
    assert (blocks[0].ref_cnt, blocks[1].ref_cnt) == (2, 2)
    assert km.prefix_queries == 10 + 11 + 9 and km.prefix_hits == 16
    km.free(b)
    assert (blocks[0].ref_cnt, blocks[1].ref_cnt) == (1, 1)
    km.free(c)
    assert all(blk.ref_cnt == 0 for blk in blocks)
    assert km.num_free_blocks == 10


def test_never_serves_the_whole_prompt_from_cache():
    km = KVCacheManager(num_blocks=6, block_size=BS, hash_extra=EXTRA)
    a = req("a", range(8))  # exactly two full blocks
    admit(km, a)
    compute(a)
    km.free(a)
    again = req("again", range(8))
    hits, num_hit = km.get_computed_blocks(again)
    assert num_hit == 4 and [b.block_id for b in hits] == [0]  # the last token must be computed


def test_free_releases_in_reverse_so_tails_are_evicted_first():
    km = KVCacheManager(num_blocks=3, block_size=BS, hash_extra=EXTRA)
    a = req("a", range(12))
    admit(km, a)
    compute(a)
    km.take_events()
    km.free(a)
    assert km.pool.free_block_ids() == [2, 1, 0]
    hashes = block_hashes_for(list(range(12)), BS, EXTRA)
    assert km.take_events() == [BlockStored(tuple(hashes), None, tuple(range(12)), BS)]
    b = req("b", [7] * 5)  # needs 2 blocks: evicts the tail of "a" first
    admit(km, b)
    assert km.get_block_ids("b") == (2, 1)
    assert km.take_events() == [BlockRemoved((hashes[2], hashes[1]))]
    assert km.get_computed_blocks(req("c", range(12)))[1] == 4  # the head block survived


def test_allocation_refuses_without_change_counting_touched_free_hits():
    km = KVCacheManager(num_blocks=4, block_size=BS, hash_extra=EXTRA)
    a = req("a", range(9))
    admit(km, a)
    compute(a)
    km.free(a)  # blocks 0, 1 cached and free; 3 and 2 (partial, uncached) empty
    b = req("b", [*range(8), *range(100, 112)])  # 20 tokens: 5 blocks, 2 of them hits
    hits, num_hit = km.get_computed_blocks(b)
    assert num_hit == 8
    # 4 free blocks, but 2 are the hits themselves: the 3 new ones do not fit.
    assert km.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert km.num_free_blocks == 4 and km.get_block_ids("b") == ()
    assert [blk.ref_cnt for blk in km.pool.blocks] == [0, 0, 0, 0]
    assert km.pool.free_block_ids() == [3, 2, 1, 0]
    assert km.prefix_queries == 9  # the refused lookup is not counted
    small = req("small", [*range(8), 1, 2, 3])  # 2 hits + 1 new block fits
    assert admit(km, small) == 8
    assert km.get_block_ids("small") == (0, 1, 3)


def test_blocks_are_cached_only_after_their_kv_is_computed():
    km = KVCacheManager(num_blocks=8, block_size=BS, hash_extra=EXTRA)
    a = req("a", range(10))
    hits, _ = km.get_computed_blocks(a)
    km.allocate_slots(a, 6, hits)  # a chunk of 6 tokens: block 0 full, block 1 half
    assert km.take_events() == []  # nothing computed yet
    assert km.get_computed_blocks(req("x", range(10)))[1] == 0
    a.num_computed_tokens = 6  # the step ran
    km.allocate_slots(a, 4)  # next chunk: block 0 is now written, so it gets cached
    (event,) = km.take_events()
    assert event.block_hashes == tuple(block_hashes_for(list(range(4)), BS, EXTRA))
    assert km.get_computed_blocks(req("x", range(10)))[1] == 4


def test_cache_salt_isolates_tenants():
    km = KVCacheManager(num_blocks=8, block_size=BS, hash_extra=EXTRA)
    a = req("a", range(9), salt="tenant-a")
    admit(km, a)
    compute(a)
    km.free(a)
    assert km.get_computed_blocks(req("b", range(9), salt="tenant-b"))[1] == 0
    assert km.get_computed_blocks(req("c", range(9)))[1] == 0
    assert km.get_computed_blocks(req("d", range(9), salt="tenant-a"))[1] == 8
    # The hashes are exactly what a router computes from the tokens and hash_extra(model, salt).
    assert a.block_hashes == block_hashes_for(list(range(9)), BS, hash_extra("m", "tenant-a"))


def test_free_blocks_beyond_rolls_back_speculative_slots():
    km = KVCacheManager(num_blocks=8, block_size=BS, hash_extra=EXTRA)
    r = req("r", range(6))
    admit(km, r)
    r.num_computed_tokens = 5
    r.output_token_ids.append(9)  # 7 tokens; a decode with 4 proposals needs slots up to position 10
    km.allocate_slots(r, 1 + 4)
    assert km.get_block_ids("r") == (0, 1, 2)
    assert km.free_blocks_beyond(r, 7) == 1  # none accepted: positions >= 7 are garbage
    assert km.get_block_ids("r") == (0, 1)
    assert km.num_free_blocks == 6
    assert km.free_blocks_beyond(r, 7) == 0


def test_caching_disabled_never_hits_and_counts_nothing():
    km = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=False, hash_extra=EXTRA)
    a = req("a", range(9))
    admit(km, a)
    compute(a)
    km.free(a)
    assert km.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert km.take_events() == [] and km.prefix_queries == 0
    assert a.block_hashes == []
    assert km.can_fit(16) and not km.can_fit(17)
