"""BlockPool through its public API: exact block ids, eviction order, ref counts, KV events."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_block
from tokenfleet.runtime.engine.kv_cache.block_pool import BlockPool
from tokenfleet.runtime.engine.kv_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tokenfleet.runtime.errors import ConfigError


def h(i: int) -> bytes:
    return hash_block(None, [i], ("test",))


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_fresh_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)


def test_freed_cached_blocks_queue_in_lru_order_after_empty_ones():
    pool = BlockPool(5)
    a = pool.get_new_blocks(3)  # 0 1 2
    pool.cache_blocks(a[:2], [h(0), h(1)], None, [0, 0], 1)
    pool.free_blocks([a[1], a[0], a[2]])
    # Empty blocks (3, 4, then 2 which holds no hash) are reused before any cached one; cached ones
    # in the order they were freed.
    assert pool.free_block_ids() == [3, 4, 2, 1, 0]
    assert pool.num_free_blocks == 5 and pool.usage == 0.0
    assert pool.get_cached_block(h(0)) is a[0]


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(3)
    a = pool.get_new_blocks(2)
    pool.cache_blocks(a, [h(0), h(1)], None, [7, 8], 1)
    pool.free_blocks(reversed(a))
    assert pool.free_block_ids() == [2, 1, 0]
    hit = pool.get_cached_block(h(0))
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_block_ids() == [2, 1]
    pool.touch([hit])  # a second user of the same block
    assert hit.ref_cnt == 2
    pool.free_blocks([hit])
    assert pool.free_block_ids() == [2, 1]
    pool.free_blocks([hit])
    assert pool.free_block_ids() == [2, 1, 0]  # freed again: back at the tail (most recently used)


def test_reusing_a_cached_block_evicts_its_hash_and_emits_removed():
    pool = BlockPool(2)
    a = pool.get_new_blocks(2)
    pool.cache_blocks(a, [h(0), h(1)], None, [5, 6], 1)
    assert pool.take_events() == [BlockStored((h(0), h(1)), None, (5, 6), 1)]
    pool.free_blocks([a[1], a[0]])
    (b,) = pool.get_new_blocks(1)
    assert b.block_id == 1  # freed first, evicted first
    assert b.block_hash is None and b.ref_cnt == 1
    assert pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(0)) is a[0]
    assert pool.take_events() == [BlockRemoved((h(1),))]
    assert pool.take_events() == []


def test_duplicate_content_keeps_the_first_block_and_splits_event_runs():
    pool = BlockPool(6)
    first = pool.get_new_blocks(1)
    pool.cache_blocks(first, [h(1)], h(0), [1], 1)
    other = pool.get_new_blocks(3)  # 1 2 3: a second sequence computed the same middle block
    pool.cache_blocks(other, [h(0), h(1), h(2)], None, [0, 1, 2], 1)
    assert pool.get_cached_block(h(1)) is first[0]
    assert other[1].block_hash is None
    assert pool.take_events() == [
        BlockStored((h(1),), h(0), (1,), 1),
        BlockStored((h(0),), None, (0,), 1),
        BlockStored((h(2),), h(1), (2,), 1),
    ]
    pool.free_blocks(reversed(other))
    assert pool.free_block_ids() == [4, 5, 2, 3, 1]  # the uncached duplicate is an empty block


def test_reset_prefix_cache_forgets_every_hash():
    pool = BlockPool(3)
    a = pool.get_new_blocks(2)
    pool.cache_blocks(a, [h(0), h(1)], None, [0, 1], 1)
    pool.free_blocks([a[1]])
    pool.take_events()
    pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_cached_block(h(0)) is None and pool.get_cached_block(h(1)) is None
    assert a[0].ref_cnt == 1 and a[0].block_hash is None
    assert pool.free_block_ids() == [2, 1]


def test_caching_disabled_and_bad_config():
    pool = BlockPool(2, enable_caching=False)
    a = pool.get_new_blocks(1)
    pool.cache_blocks(a, [h(0)], None, [0], 1)
    assert pool.get_cached_block(h(0)) is None and pool.take_events() == []
    with pytest.raises(ConfigError):
        BlockPool(0)
    with pytest.raises(ConfigError, match="eviction"):
        BlockPool(4, eviction="random")
