"""KVCacheManager with a sliding window on every layer: blocks behind the window go back to the pool (cached,
still hittable), their places keep the null block, and the request holds O(window) blocks."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_extra
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampling_params import SamplingParams

BS = 4
W = 6
EXTRA = hash_extra("m")
MAX_HELD = -(-W // BS) + 1


def req(rid: str, tokens, max_tokens: int = 64) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def admit(km: KVCacheManager, r: Request) -> int:
    hits, num_hit = km.get_computed_blocks(r)
    assert km.allocate_slots(r, r.num_tokens - num_hit, hits) is not None
    r.num_computed_tokens = num_hit
    return num_hit


def decode(km: KVCacheManager, r: Request, token: int) -> None:
    """One step: the last token's KV was written (computed), a new token is sampled and scheduled."""
    r.num_computed_tokens = r.num_tokens
    r.output_token_ids.append(token)
    assert km.allocate_slots(r, 1) is not None


def check_table(km: KVCacheManager, r: Request) -> None:
    """Every place a query at num_computed_tokens or later can see holds a real block of this request's; the
    places before it hold the null block; nothing held is on the free lists."""
    ids = km.get_block_ids(r.request_id)
    null = km.null_block.block_id
    first_visible = r.num_computed_tokens - W + 1
    free = set(km.pool.free_block_ids())
    for j, block_id in enumerate(ids):
        if (j + 1) * BS - 1 >= first_visible:
            assert block_id != null and block_id not in free
    held = [b for b in ids if b != null]
    assert len(held) == len(set(held)) == km.num_held_blocks(r.request_id)
    assert len(ids) * BS >= r.num_tokens


def test_long_decode_holds_a_window_of_blocks():
    km = KVCacheManager(num_blocks=12, block_size=BS, hash_extra=EXTRA, sliding_window=W)
    assert km.num_blocks == 11 and km.num_free_blocks == 11  # block 0 is the null block
    r = req("a", range(10))
    admit(km, r)
    check_table(km, r)
    # 200 tokens through 11 usable blocks: without the release it would need 53.
    for t in range(190):
        decode(km, r, 1000 + t)
        check_table(km, r)
        assert km.num_held_blocks("a") <= MAX_HELD
    assert len(km.get_block_ids("a")) == -(-r.num_tokens // BS)
    assert 0 not in {b.block_id for b in km.tables["a"].blocks[km.tables["a"].num_released :]}
    km.free(r)
    assert km.num_free_blocks == 11
    assert km.pool.blocks[0].ref_cnt == 1  # the null block is never given out


def test_released_blocks_stay_cached_and_a_later_prompt_hits_them():
    km = KVCacheManager(num_blocks=32, block_size=BS, hash_extra=EXTRA, sliding_window=W)
    r = req("a", range(12))
    admit(km, r)
    for t in range(14):  # 26 tokens: the block entered at 24 released (24 - 6 + 1) // 4 = 4 blocks
        decode(km, r, 500 + t)
    released = km.tables["a"].num_released
    assert released >= 4  # the prompt's 3 blocks and a generated one went back
    # Released blocks are free and cached (evictable), not held.
    assert km.num_free_blocks == 31 - km.num_held_blocks("a")
    # A prompt with the same tokens (prompt + the first generated ones) hits every released block while
    # the first request still runs: its KV depends on tokens and positions only.
    b = req("b", [*r.prompt_token_ids, *r.output_token_ids[:5], 7, 7])
    assert admit(km, b) == 16
    km.free(r)
    km.free(b)
    assert km.num_free_blocks == 31


def test_a_long_prefix_hit_behind_the_window_is_given_back_at_admission():
    km = KVCacheManager(num_blocks=32, block_size=BS, hash_extra=EXTRA, sliding_window=W)
    a = req("a", range(21))
    admit(km, a)
    a.num_computed_tokens = a.num_tokens
    km.free(a)  # caches 5 full blocks
    b = req("b", range(21))
    assert admit(km, b) == 20
    # The first query is at 20: blocks ending before 20 - 6 + 1 = 15 (blocks 0..2) are not held.
    assert km.tables["b"].num_released == 3 and km.num_held_blocks("b") == 3
    check_table(km, b)
    for j in range(3):  # still cached, so still hits for others
        assert km.pool.get_cached_block(b.block_hashes[j]) is not None


def test_preempted_request_resumes_from_the_cache():
    km = KVCacheManager(num_blocks=16, block_size=BS, hash_extra=EXTRA, sliding_window=W)
    r = req("a", range(9))
    admit(km, r)
    for t in range(20):
        decode(km, r, 300 + t)
    num_tokens = r.num_tokens
    km.free(r)  # preempted: recomputed from scratch, prefix cache permitting
    r.num_computed_tokens = 0
    assert km.num_free_blocks == 15
    hit = admit(km, r)
    assert hit == (num_tokens - 1) // BS * BS  # every full block was still cached
    check_table(km, r)
    assert km.num_held_blocks("a") <= MAX_HELD
    decode(km, r, 9)
    check_table(km, r)
    km.free(r)
    assert km.num_free_blocks == 15


def test_pressure_evicts_released_blocks_and_hits_stop_at_the_first_gap():
    km = KVCacheManager(num_blocks=8, block_size=BS, hash_extra=EXTRA, sliding_window=W)
    r = req("a", range(8))
    admit(km, r)
    for t in range(24):
        decode(km, r, 700 + t)
    km.free(r)
    # Another request takes every free block: the cached ones are evicted.
    other = req("o", range(100, 100 + 7 * BS - 1))
    admit(km, other)
    assert km.num_free_blocks == 0 and km.pool.num_evicted_pressure > 0
    km.free(other)
    hits, num = km.get_computed_blocks(req("c", [*range(8), *range(700, 724), 1]))
    assert num == len(hits) * BS
    for block in hits:
        assert block.block_hash is not None and block.block_id != 0


def test_without_caching_released_blocks_go_back_empty():
    km = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False, sliding_window=W)
    r = req("a", range(10))
    admit(km, r)
    for t in range(40):
        decode(km, r, t)
        check_table(km, r)
        assert km.num_held_blocks("a") <= MAX_HELD
    assert all(b.block_hash is None for b in km.pool.blocks)
    km.free(r)
    assert km.num_free_blocks == 7


def test_speculative_rollback_after_a_release():
    km = KVCacheManager(num_blocks=16, block_size=BS, hash_extra=EXTRA, sliding_window=W)
    r = req("a", range(10))
    admit(km, r)
    for t in range(12):
        decode(km, r, 40 + t)
    r.num_computed_tokens = r.num_tokens
    assert km.allocate_slots(r, 9) is not None  # room for proposals
    released = km.tables["a"].num_released
    freed = km.free_blocks_beyond(r, r.num_tokens + 1)  # most were rejected
    assert freed >= 1 and km.tables["a"].num_released == released
    check_table(km, r)
    km.free(r)
    assert km.num_free_blocks == 15


def test_window_needs_a_spare_block_and_a_positive_size():
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(num_blocks=8, block_size=BS, sliding_window=0)
    with pytest.raises(ValueError, match="null block"):
        KVCacheManager(num_blocks=1, block_size=BS, sliding_window=W)
