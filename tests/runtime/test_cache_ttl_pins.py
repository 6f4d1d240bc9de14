"""TTL expiry/refresh with a scripted clock, and pinned prefixes, through KVCacheManager / BlockPool."""

from __future__ import annotations

from tokenfleet.runtime.config import CacheConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_extra
from tokenfleet.runtime.engine.kv_cache.block_pool import BlockPool
from tokenfleet.runtime.engine.kv_cache.kv_events import BlockRemoved
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.request import Request, RequestStatus
from tokenfleet.runtime.engine.sampling_params import SamplingParams

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def req(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=1))


def run(km: KVCacheManager, r: Request, finish: bool = True) -> int:
    """Admit, compute the prompt, optionally finish and free; returns the prefix-hit tokens."""
    hits, num_hit = km.get_computed_blocks(r)
    assert km.allocate_slots(r, r.num_tokens - num_hit, hits) is not None
    r.num_computed_tokens = r.num_tokens
    if finish:
        r.status = RequestStatus.FINISHED_LENGTH
        km.free(r)
    return num_hit


def cache_one(pool: BlockPool, name: str) -> int:
    (block,) = pool.get_new_blocks(1)
    pool.cache_blocks([block], [name.encode()], None, [0] * BS, BS)
    pool.free_blocks([block])
    return block.block_id


# ---- TTL ---------------------------------------------------------------------------------------------------


def test_expired_blocks_are_evicted_before_the_policy_is_asked():
    clock = Clock()
    pool = BlockPool(4, eviction="lfu", ttl_seconds=10, clock=clock)
    cache_one(pool, "a")  # t=0
    clock.now = 0.5
    for _ in range(3):  # a is by far the most used: LFU alone would evict it last
        block = pool.get_cached_block(b"a")
        pool.touch([block])
        pool.free_blocks([block])  # a was last used at t=0.5
    for t, name in ((1.0, "b"), (2.0, "c"), (3.0, "d")):
        clock.now = t
        cache_one(pool, name)
    clock.now = 11.5  # a (freed at 0.5) and b (1) expired; c (2), d (3) not
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]  # a then b, by free time
    assert pool.num_evicted_ttl == 2 and pool.num_evicted_pressure == 0
    assert [b.block_id for b in pool.get_new_blocks(1)] == [2]  # nothing expired: LFU's choice
    assert pool.num_evicted_pressure == 1


def test_a_hit_refreshes_the_ttl_and_the_sweep_drops_expired_blocks_with_events():
    clock = Clock()
    km = KVCacheManager(8, BS, hash_extra=hash_extra("m"), ttl_seconds=10, clock=clock)
    a, b = req("a", range(9)), req("b", range(100, 109))
    run(km, a)  # t=0: caches 2 blocks
    run(km, b)
    km.take_events()
    clock.now = 8.0
    assert run(km, req("a2", range(9))) == 8  # a hit at t=8 restarts a's clock
    clock.now = 12.0
    assert run(km, req("b2", range(100, 109))) == 0  # b expired at t=10: a miss, recomputed
    removed = [x for e in km.take_events() if isinstance(e, BlockRemoved) for x in e.block_hashes]
    assert len(removed) == 2 and set(removed) == set(b.block_hashes[:2])
    clock.now = 17.0
    assert run(km, req("a3", range(9))) == 8  # 9 s after its hit: still alive
    assert km.metrics().evicted_ttl_blocks == 2


def test_ttl_changes_apply_live_to_blocks_already_free():
    clock = Clock()
    km = KVCacheManager(8, BS, hash_extra=hash_extra("m"), clock=clock)  # no TTL
    run(km, req("a", range(9)))
    clock.now = 1000.0
    assert run(km, req("a2", range(9))) == 8
    km.apply_policy(CacheConfig(ttl_seconds=5, eviction="s3fifo"))
    assert km.pool.eviction == "s3fifo"
    clock.now = 1006.0
    assert run(km, req("a3", range(9))) == 0


# ---- pins --------------------------------------------------------------------------------------------------


def pin(km: KVCacheManager, rid: str, tokens) -> Request:
    r = req(rid, tokens)
    km.pins.expect(rid, tuple(tokens))
    run(km, r)
    return r


def test_a_pin_survives_pressure_and_is_evictable_again_after_unpin():
    km = KVCacheManager(8, BS, hash_extra=hash_extra("m"), max_pinned_fraction=0.5)
    system = list(range(13))  # 3 full blocks (+1 token that is not pinned)
    pin(km, "pin-0", system)
    assert km.pins.pinned_block_ids(tuple(system)) == [0, 1, 2]
    assert km.metrics().pinned_blocks == 3 and km.num_free_blocks == 5
    for i in range(6):  # one-off requests fill the cache over and over
        run(km, req(f"x{i}", range(1000 * (i + 1), 1000 * (i + 1) + 20)))
    assert run(km, req("user", [*system, 77, 78])) == 12  # all 3 pinned blocks still hit
    km.pins.unpin(tuple(system))
    assert km.metrics().pinned_blocks == 0 and km.num_free_blocks == 8
    run(km, req("big", range(5000, 5032)))  # 8 blocks: everything is evicted, the old pins too
    assert run(km, req("user2", [*system, 77])) == 0


def test_pins_are_capped_and_the_cap_can_shrink_live():
    km = KVCacheManager(10, BS, hash_extra=hash_extra("m"), max_pinned_fraction=0.3)  # 3 blocks
    first, second = tuple(range(9)), tuple(range(50, 59))  # 2 full blocks each
    pin(km, "p1", first)
    pin(km, "p2", second)  # only one of its two blocks fits
    assert km.pins.pinned_block_ids(first) == [0, 1]
    assert km.pins.pinned_block_ids(second) == [3]
    km.apply_policy(CacheConfig(max_pinned_fraction=0.1))  # 1 block: trims the newest pins first
    assert km.pins.pinned_block_ids(second) == [] and km.pins.pinned_block_ids(first) == [0]
    assert km.metrics().pinned_blocks == 1


def test_a_pin_prefill_preempted_before_its_prompt_is_computed_pins_on_its_final_free():
    km = KVCacheManager(8, BS, hash_extra=hash_extra("m"))
    r = req("pin", range(9))
    km.pins.expect("pin", tuple(range(9)))
    hits, _ = km.get_computed_blocks(r)
    km.allocate_slots(r, 4, hits)
    r.num_computed_tokens = 4  # one chunk done, then preempted
    km.free(r)
    assert km.metrics().pinned_blocks == 0 and km.pins.pending_key("pin") is not None
    r.num_computed_tokens = 0
    run(km, r)
    assert km.metrics().pinned_blocks == 2


def test_an_aborted_pin_prefill_pins_nothing_and_leaks_nothing():
    km = KVCacheManager(8, BS, hash_extra=hash_extra("m"))
    r = req("pin", range(9))
    km.pins.expect("pin", tuple(range(9)))
    hits, _ = km.get_computed_blocks(r)
    km.allocate_slots(r, 9, hits)
    r.status = RequestStatus.FINISHED_ABORTED
    km.free(r)
    assert km.pins.pending_key("pin") is None and km.num_free_blocks == 8
