"""Eviction policies through BlockPool's public API: exact victim block ids on scripted access traces."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.engine.kv_cache.block_pool import BlockPool
from tokenfleet.runtime.engine.kv_cache.eviction import EVICTION_POLICIES
from tokenfleet.runtime.engine.kv_cache.kv_events import BlockRemoved

BS = 4


def h(name: str) -> bytes:
    return name.encode()


def cache_new(pool: BlockPool, *names: str) -> list[int]:
    """Allocate one block per name (evicting if needed), cache it under that hash, free them in order."""
    blocks = pool.get_new_blocks(len(names))
    for block, name in zip(blocks, names, strict=True):
        pool.cache_blocks([block], [h(name)], None, [0] * BS, BS)
    pool.free_blocks(blocks)
    return [b.block_id for b in blocks]


def hit(pool: BlockPool, *names: str) -> None:
    """A request reuses these cached blocks, then finishes."""
    for name in names:
        block = pool.get_cached_block(h(name))
        assert block is not None, name
        pool.touch([block])
        pool.free_blocks([block])


def evict(pool: BlockPool, n: int) -> list[int]:
    return [b.block_id for b in pool.get_new_blocks(n)]


def test_registry_names_match_the_config_literal():
    from typing import get_args

    from tokenfleet.runtime.config import CacheConfig

    assert set(EVICTION_POLICIES) == set(get_args(CacheConfig.model_fields["eviction"].annotation))


def test_lru_evicts_least_recently_freed_and_a_hit_moves_a_block_to_the_back():
    pool = BlockPool(4, eviction="lru")
    assert cache_new(pool, "a", "b", "c", "d") == [0, 1, 2, 3]
    hit(pool, "a", "c")
    assert [b.block_id for b in pool._evictable] == [1, 3, 0, 2]
    assert evict(pool, 3) == [1, 3, 0]
    assert pool.get_cached_block(h("c")) is not None and pool.get_cached_block(h("b")) is None


def test_lfu_evicts_least_used_and_ages_old_counts():
    pool = BlockPool(3, eviction="lfu")
    cache_new(pool, "a", "b", "c")  # one use each
    hit(pool, "b", "b", "c")  # b: 3 uses, c: 2 uses
    assert evict(pool, 1) == [0]  # a (1 use); the cache's age becomes 1
    pool.free_blocks([pool.blocks[0]])  # back empty
    assert cache_new(pool, "d") == [0]  # d enters at age + 1 = 2, level with c; c was freed earlier
    assert evict(pool, 1) == [2]  # c; the age becomes 2
    pool.free_blocks([pool.blocks[2]])
    assert cache_new(pool, "e") == [2]  # e enters at 3, level with b's three uses: ageing at work
    assert [b.block_id for b in pool._evictable] == [0, 1, 2]  # d (2), b (3, older), e (3)
    assert evict(pool, 3) == [0, 1, 2]


def test_lfu_counts_hits_on_blocks_shared_by_running_requests():
    pool = BlockPool(2, eviction="lfu")
    cache_new(pool, "a", "b")
    block_b = pool.get_cached_block(h("b"))
    pool.touch([block_b])
    pool.touch([block_b])  # a second request shares it while the first still runs: 3 uses
    pool.free_blocks([block_b, block_b])
    assert evict(pool, 2) == [0, 1]


def test_s3fifo_one_off_blocks_are_evicted_from_the_small_queue_and_ghosts_go_to_main():
    pool = BlockPool(10, eviction="s3fifo")  # small queue: 1 block (10%)
    assert cache_new(pool, *(f"s{i}" for i in range(10))) == list(range(10))
    hit(pool, "s0", "s1")  # reused: main queue, one use each
    assert evict(pool, 3) == [2, 3, 4]  # one-off blocks go first, in FIFO order
    pool.free_blocks(pool.blocks[2:5])  # the new owners did not cache them: empty blocks
    assert evict(pool, 3) == [2, 3, 4]  # empty blocks are reused before any cached one
    assert cache_new(pool, "x") == [5]  # pressure: evicts s5 from the small queue
    pool.free_blocks(pool.blocks[2:5])
    assert cache_new(pool, "s2") == [2]  # s2 came back while its ghost is remembered: main queue
    assert [b.block_id for b in pool._evictable] == [6, 7, 8, 9, 5, 0, 1, 2]
    assert evict(pool, 5) == [3, 4, 6, 7, 8]  # empty ones, then the small queue
    # small = [9, 5(x)]; main = [0 (1 use), 1 (1 use), 2 (ghost: 0 uses)]
    assert evict(pool, 2) == [9, 5]
    assert evict(pool, 3) == [2, 0, 1]  # 0 and 1 got one more round for their use


# LFU with ageing resists a short scan but not one twice the cache: every eviction raises the age, so the
# hot blocks' three uses are matched by newcomers after a few rounds (that is what ageing is for).
@pytest.mark.parametrize(("eviction", "hot_survives"), [("lru", False), ("lfu", False), ("s3fifo", True)])
def test_a_scan_flushes_lru_but_not_the_scan_resistant_policy(eviction: str, hot_survives: bool):
    pool = BlockPool(10, eviction=eviction)
    cache_new(pool, *(f"warm{i}" for i in range(10)))
    for _ in range(2):
        hit(pool, "warm0", "warm1")  # a hot system prompt
    for i in range(20):  # a scan of one-off documents, one block at a time
        cache_new(pool, f"scan{i}")
    hot = [pool.get_cached_block(h("warm0")), pool.get_cached_block(h("warm1"))]
    assert all(b is not None for b in hot) is hot_survives


@pytest.mark.parametrize("eviction", sorted(EVICTION_POLICIES))
def test_every_policy_keeps_the_pool_consistent_over_a_random_trace(eviction: str):
    import random

    rng = random.Random(7)
    pool = BlockPool(16, eviction=eviction)
    held: list = []
    for step in range(600):
        name = f"k{rng.randrange(40)}"
        block = pool.get_cached_block(h(name))
        if block is not None:
            pool.touch([block])
            held.append(block)
        elif pool.num_free_blocks:
            (block,) = pool.get_new_blocks(1)
            pool.cache_blocks([block], [h(name)], None, [0] * BS, BS)
            held.append(block)
        if len(held) > 6 or (held and step % 3 == 0):
            pool.free_blocks([held.pop(rng.randrange(len(held)))])
    pool.free_blocks(held)
    assert pool.num_free_blocks == 16 and pool.usage == 0.0
    assert sorted(b.block_id for b in pool._evictable) == sorted(
        b.block_id for b in pool.blocks if b.block_hash is not None
    )
    removed = [x for e in pool.take_events() if isinstance(e, BlockRemoved) for x in e.block_hashes]
    assert len(removed) == pool.num_evicted_pressure


def test_policy_switch_live_keeps_the_cached_blocks_in_their_order():
    pool = BlockPool(4, eviction="lru")
    cache_new(pool, "a", "b", "c", "d")
    hit(pool, "a")
    pool.set_eviction_policy("s3fifo")
    assert pool.eviction == "s3fifo"
    assert [b.block_id for b in pool._evictable] == [1, 2, 3, 0]
    assert evict(pool, 4) == [1, 2, 3, 0]
