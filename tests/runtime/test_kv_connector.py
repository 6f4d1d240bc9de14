"""KV connectors: blocks saved and loaded by hash become prefix-cache blocks that change no output."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for
from tokenfleet.runtime.engine.kv_cache.kv_connector import (
    HostKVConnector,
    KVTransferError,
    cached_prefix_len,
    check_chain,
    insert_prefix_blocks,
    layout_of,
    read_blocks,
    write_blocks,
)
from tokenfleet.runtime.engine.kv_cache.kv_holds import KVHolds
from tokenfleet.runtime.engine.kv_cache.offload import HostKVTier
from tokenfleet.runtime.engine.kv_cache.offload_copy import HostKVBuffers
from tokenfleet.runtime.engine.sampling_params import SamplingParams

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "books were made, sold and read across Europe. Within fifty years presses worked in hundreds of towns. "
)
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _llm(default_model, num_blocks: int = 16):
    from tokenfleet.runtime.config import RuntimeConfig
    from tokenfleet.runtime.engine.llm import LLM

    return LLM(
        config=RuntimeConfig(), loaded=default_model, dtype="float32", block_size=16, num_blocks=num_blocks
    )


@pytest.fixture(scope="module")
def prompt(default_model) -> list[int]:
    return default_model.tokenizer.encode(TEXT * 2, add_special_tokens=False)[:70]  # 4 full blocks + 6


def _hashes(llm, ids):
    km = llm.engine.kv_manager
    return block_hashes_for(ids, km.block_size, km.hash_extra)


def test_host_connector_saves_and_loads_blocks_by_hash_into_free_slots(default_model, prompt):
    llm = _llm(default_model)
    core, km = llm.engine, llm.engine.kv_manager
    cold = llm.generate([prompt], GREEDY)[0]
    hashes = _hashes(llm, prompt)
    assert cached_prefix_len(km, hashes) == 4
    kv = core.runner.kv_caches
    conn = HostKVConnector(HostKVTier(8), HostKVBuffers(kv, 8))
    ids = [km.pool.get_cached_block(h).block_id for h in hashes]
    assert conn.save(kv, list(zip(hashes, ids, strict=True))) == 4
    km.reset_prefix_cache()  # the device copy is gone; only the host holds the KV now
    assert cached_prefix_len(km, hashes) == 0 and all(conn.contains(h) for h in hashes)

    def fill(block_ids):
        return conn.load(kv, list(zip(hashes, block_ids, strict=False)))

    assert insert_prefix_blocks(km, hashes, prompt[: 4 * 16], None, fill) == 4
    assert km.num_free_blocks == km.num_blocks  # inserted blocks are free cached blocks
    warm = llm.generate([prompt], GREEDY)[0]
    assert warm.num_cached_tokens == 64
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_blocks_moved_between_two_engines_give_a_full_prefix_hit_and_the_same_tokens(default_model, prompt):
    a, b = _llm(default_model), _llm(default_model)
    cold = a.generate([prompt], GREEDY)[0]
    hashes = _hashes(a, prompt)
    ka = a.engine.kv_manager
    payloads = read_blocks(a.engine.runner.kv_caches, [ka.pool.get_cached_block(h).block_id for h in hashes])
    kb, kv_b = b.engine.kv_manager, b.engine.runner.kv_caches
    assert len(payloads[0]) == layout_of(kv_b).bytes_per_block
    check_chain(kb, hashes, prompt[:64], None)

    def fill(block_ids):
        write_blocks(kv_b, block_ids, payloads[: len(block_ids)])
        return len(block_ids)

    assert insert_prefix_blocks(kb, hashes, prompt[:64], None, fill) == 4
    warm = b.generate([prompt], GREEDY)[0]
    assert warm.num_cached_tokens == 64 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert kb.num_free_blocks == kb.num_blocks


def test_a_chain_from_another_salt_or_other_tokens_is_refused(default_model, prompt):
    llm = _llm(default_model)
    km = llm.engine.kv_manager
    hashes = _hashes(llm, prompt)
    with pytest.raises(KVTransferError):
        check_chain(km, hashes, prompt[:64], "tenant-b")
    with pytest.raises(KVTransferError):
        check_chain(km, hashes, [1, *prompt[1:64]], None)
    with pytest.raises(KVTransferError):
        check_chain(km, hashes, prompt[:60], None)


def test_holds_keep_blocks_from_eviction_and_are_released_on_release_or_expiry(default_model, prompt):
    llm = _llm(default_model, num_blocks=8)
    km = llm.engine.kv_manager
    llm.generate([prompt], GREEDY)
    hashes = _hashes(llm, prompt)
    holds = KVHolds(km)
    held = holds.hold("h1", hashes, prompt, None, deadline=10.0)
    assert len(held.blocks) == 4 and km.num_free_blocks == km.num_blocks - 4
    other = default_model.tokenizer.encode(
        "Completely different words about rivers. " * 8, add_special_tokens=False
    )
    llm.generate([other[:60]], GREEDY)  # needs 4 blocks: only the free ones, never the held ones
    assert cached_prefix_len(km, hashes) == 4
    assert holds.release("h1") and not holds.release("h1") and holds.take("h1") is None
    assert km.num_free_blocks == km.num_blocks
    taken = holds.hold("h3", hashes, prompt, None, deadline=1.0)
    assert holds.take("h3") is taken and not holds.release("h3") and holds.expire(2.0) == 0
    assert km.num_free_blocks == km.num_blocks - 4  # a taken hold stays referenced until its fetch frees it
    holds.free(taken)
    assert km.num_free_blocks == km.num_blocks
    holds.hold("h2", hashes, prompt, None, deadline=5.0)
    assert holds.expire(4.0) == 0 and holds.expire(5.0) == 1 and holds.take("h2") is None
    assert km.num_free_blocks == km.num_blocks and holds.num_expired == 1


def _step_until_finished(core, request_id: str, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if any(o.request_id == request_id and o.finished for o in core.step()):
            return
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


def test_a_hold_announced_before_the_prefill_is_taken_in_the_step_it_finishes(default_model, prompt):
    """The race it closes: a prefill finishes, its blocks are free cached blocks, and the next step's
    allocations (another request) evict them before a hold taken afterwards could reference them."""
    ids = prompt[:64]  # exactly 4 full blocks
    big = default_model.tokenizer.encode("Rivers run to the sea and back. " * 30, add_special_tokens=False)
    big = big[:100]  # 7 blocks: more than the 4 blocks the prefill did not use (8 in all)
    one = SamplingParams(temperature=0, max_tokens=1)

    # Held after the fact (what a hold taken once the answer is out amounts to): the prompt is partly gone.
    llm = _llm(default_model, num_blocks=8)
    core, km = llm.engine, llm.engine.kv_manager
    hashes = _hashes(llm, ids)
    core.add_request("prefill", ids, one)
    _step_until_finished(core, "prefill")
    core.add_request("other", big, one)
    _step_until_finished(core, "other")
    late = KVHolds(km).hold("late", hashes, ids, None, deadline=10.0)
    assert len(late.blocks) < 4

    # Announced first: the engine takes it in the finishing step, every block is still there and stays.
    llm = _llm(default_model, num_blocks=8)
    core, km = llm.engine, llm.engine.kv_manager
    holds = KVHolds(km, clock=lambda: 100.0)
    core.finish_listeners.append(holds.requests_finished)
    pending = holds.expect("h", hashes, ids, None, ttl=30.0)
    assert pending.held is None and holds.num_pending == 1
    core.add_request("prefill", ids, one)
    _step_until_finished(core, "prefill")
    assert pending.held is not None and len(pending.held.blocks) == 4 and pending.held.deadline == 130.0
    assert holds.num_pending == 0 and holds.num_blocks("h") == 4
    core.add_request("other", big, one)
    for _ in range(3):  # it waits: the free blocks do not hold it, the held ones are not taken
        core.step()
    assert cached_prefix_len(km, hashes) == 4
    taken = holds.take("h")  # the decode pod fetches ...
    assert [b.block_id for b in taken.blocks] == pending.held.block_ids
    holds.free(taken)  # ... and the blocks go back: the waiting request runs
    _step_until_finished(core, "other")
    assert km.num_free_blocks == km.num_blocks


def test_an_announced_hold_is_dropped_on_cancel_and_one_without_full_blocks_is_empty(default_model, prompt):
    llm = _llm(default_model, num_blocks=8)
    km = llm.engine.kv_manager
    holds = KVHolds(km)
    llm.engine.finish_listeners.append(holds.requests_finished)
    ids = prompt[:40]
    holds.expect("a", _hashes(llm, ids), ids, None, ttl=30.0)
    assert holds.cancel("a") and holds.num_pending == 0 and not holds.cancel("a")
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    assert len(holds) == 0 and km.num_free_blocks == km.num_blocks  # nothing was announced any more
    # A salted prompt is another prompt: an announcement for the unsalted one is not taken by it.
    holds.expect("b", _hashes(llm, ids), ids, None, ttl=30.0)
    llm.engine.add_request("salted", ids, SamplingParams(temperature=0, max_tokens=1), cache_salt="tenant")
    _step_until_finished(llm.engine, "salted")
    assert holds.num_pending == 1
    holds.cancel("b")
    short = holds.expect("c", (), ids[:5], None, ttl=30.0)
    assert short.held is not None and short.held.blocks == () and holds.release("c")
    assert km.num_free_blocks == km.num_blocks


def test_blocks_inserted_over_cached_ones_send_the_evicted_kv_to_the_host_tier_intact(default_model, prompt):
    """Inserting transferred blocks can evict cached ones into the host tier: their KV is copied out before
    the transfer overwrites those device blocks, so a later host hit gives the evicted prefix's own tokens."""
    LP = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
    a = _llm(default_model)
    cold_p = a.generate([prompt], LP)[0]
    hashes = _hashes(a, prompt)
    ka = a.engine.kv_manager
    payloads = read_blocks(a.engine.runner.kv_caches, [ka.pool.get_cached_block(h).block_id for h in hashes])

    from tokenfleet.runtime.config import RuntimeConfig
    from tokenfleet.runtime.engine.llm import LLM

    # 5 device blocks: the 4 inserted ones can only fit by evicting one of the other document's 2 cached
    # blocks (3 blocks hold no hash), and the prompt's fifth block evicts the other.
    b = LLM(config=RuntimeConfig(), loaded=default_model, block_size=16, num_blocks=5, cpu_offload_gib=0.01)
    kb, kv_b = b.engine.kv_manager, b.engine.runner.kv_caches
    doc = default_model.tokenizer.encode(
        "Rivers run to the sea and back again. " * 8, add_special_tokens=False
    )
    doc = doc[:36]  # 2 full blocks + 4
    cold_doc = b.generate([doc], LP)[0]

    def fill(block_ids):
        write_blocks(kv_b, block_ids, payloads[: len(block_ids)])
        return len(block_ids)

    assert insert_prefix_blocks(kb, hashes, prompt[:64], None, fill) == 4
    warm_p = b.generate([prompt], LP)[0]
    assert warm_p.num_cached_tokens == 64 and warm_p.outputs[0].token_ids == cold_p.outputs[0].token_ids
    again = b.generate([doc], LP)[0]
    m = kb.metrics()
    assert m.offloaded_blocks >= 2 and m.host_hit_blocks == 2
    assert again.num_cached_tokens == 32  # both blocks came back from the host tier ...
    # ... holding the document's KV, not the prompt's
    assert again.outputs[0].token_ids == cold_doc.outputs[0].token_ids

    def sampled(out):  # the sampled token's logprob at each position
        c = out.outputs[0]
        return [position[t].logprob for position, t in zip(c.logprobs, c.token_ids, strict=True)]

    # A host hit computes the suffix alone, not in the cold prefill's batch: equal within float noise.
    assert sampled(again) == pytest.approx(sampled(cold_doc), abs=1e-4)
