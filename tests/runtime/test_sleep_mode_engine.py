"""Sleep mode in the engine (EngineCore.sleep / wake_up) with the built-in model on the CPU.

What is checked is what a warm tier relies on: after waking, greedy output is token-for-token what it was
before the sleep (level 1: weights kept in host memory; level 2: weights discarded and reloaded by the
start-up loader); while asleep the KV cache's memory is back with the kernel (RSS falls by about its
size) and, at level 2, the weights' storages are empty; the prefix cache is reset with an
`AllBlocksCleared` event for the routers.
"""

from __future__ import annotations

import os

import pytest
import torch
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.engine_core import EngineCore
from tokenfleet.runtime.engine.kv_cache.kv_events import AllBlocksCleared
from tokenfleet.runtime.engine.kv_cache.kv_tensors import kv_cache_bytes
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.sleep_weights import model_storages
from tokenfleet.runtime.errors import InvalidRequest

PROMPT = (
    "The history of the city begins with a small fishing village on the river bank, where traders from "
    "the north and the south met every spring to exchange salt, grain and wool. Over the centuries"
)
NUM_BLOCKS = 128  # about 90 MiB of fp32 KV for the default model: well above RSS noise


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def core():
    config = RuntimeConfig.model_validate({"cache": {"num_blocks": NUM_BLOCKS}})
    core = EngineCore(config)  # its own weights: level 2 frees and reloads them
    events: list[object] = []
    core.set_kv_event_sink(events.extend)
    core.events = events
    yield core
    core.shutdown()


def generate(core: EngineCore, rid: str, n: int = 24) -> list[int]:
    ids = core.tokenizer.encode(PROMPT)
    core.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            tokens += out.new_token_ids
    assert len(tokens) == n
    return tokens


def touch_kv(core: EngineCore) -> None:
    """Write every page of the KV cache, so all of it is resident (a fresh cache is lazily-backed zeros)."""
    for k, v in core.runner.kv_caches:
        k.fill_(0.5)
        v.fill_(0.5)


@pytest.mark.parametrize("level", [1, 2])
def test_output_after_wake_is_token_identical_and_kv_memory_is_returned(core, level):
    before = generate(core, f"before-{level}")
    touch_kv(core)
    kv_bytes = kv_cache_bytes(core.runner.kv_caches)
    weights = model_storages(core.runner.model)
    weight_bytes = sum(s.nbytes() for s in weights)
    core.events.clear()
    rss_awake = rss_bytes()

    freed = core.sleep(level)

    rss_asleep = rss_bytes()
    assert core.sleep_level == level
    assert freed["kv_cache"] == kv_bytes
    # The KV pages went back to the kernel (allow a tenth for allocator and page-table noise).
    assert rss_awake - rss_asleep >= 0.9 * kv_bytes, (rss_awake, rss_asleep, kv_bytes)
    if level == 1:  # on the CPU the weights already live in host memory: nothing moves
        assert freed["weights"] == 0 and all(s.nbytes() > 0 for s in weights)
    else:
        assert freed["weights"] == weight_bytes > 0
        assert all(s.nbytes() == 0 for s in weights)
        assert rss_awake - rss_asleep >= 0.9 * (kv_bytes + weight_bytes)
    # Every cached block is gone, and the routers are told so.
    assert any(isinstance(e, AllBlocksCleared) for e in core.events)
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks

    core.wake_up()

    assert core.sleep_level == 0
    assert all(float(k.abs().sum()) == 0 for k, _ in core.runner.kv_caches)  # zeroed, as at start-up
    after = generate(core, f"after-{level}")
    assert after == before
    hit = core.stats().prefix_cache_hits
    generate(core, f"again-{level}")  # the cache works again after the wake
    assert core.stats().prefix_cache_hits > hit


def test_wake_up_by_tags_weights_first_then_kv_cache(core):
    before = generate(core, "tags-before")
    core.sleep(2)
    core.wake_up(["weights"])
    assert core.sleep_level == 2 and core.runner.kv_asleep and not core.runner.weights_asleep
    core.wake_up(["kv_cache"])
    assert core.sleep_level == 0
    assert generate(core, "tags-after") == before


def test_bad_level_and_tags_are_refused(core):
    with pytest.raises(InvalidRequest, match="level must be 1 or 2"):
        core.sleep(3)
    with pytest.raises(InvalidRequest, match="unknown wake_up tags"):
        core.wake_up(["weights", "optimizer"])
    assert core.sleep_level == 0


def test_sleep_refuses_unfinished_requests(core):
    core.add_request("busy", core.tokenizer.encode(PROMPT), SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(RuntimeError, match="1 requests unfinished"):
        core.sleep(1)
    assert core.sleep_level == 0 and not core.runner.kv_asleep
    while core.has_unfinished():
        core.step()


def test_sleep_weights_offload_round_trip_keeps_views_and_ties():
    """Level 1's storage move (the CUDA path, here host to host): tied weights stay tied, values exact."""
    from tokenfleet.runtime.engine.sleep_weights import SleepingWeights

    model = torch.nn.Linear(8, 8)
    model.register_buffer("alias", model.weight.data[:2])  # a view of the weight's storage
    weight = model.weight.detach().clone()
    sleeping = SleepingWeights.offload(model)
    assert model.weight.untyped_storage().nbytes() == 0 and sleeping.nbytes == (64 + 8) * 4
    sleeping.restore()
    assert torch.equal(model.weight, weight) and torch.equal(model.alias, weight[:2])
    assert model.alias.untyped_storage().data_ptr() == model.weight.untyped_storage().data_ptr()


def test_pinned_prefixes_are_computed_again_after_wake(core):
    config = RuntimeConfig.model_validate(
        {"cache": {"num_blocks": 32, "block_size": 16, "pinned_prefixes": [PROMPT]}}
    )
    pinned = EngineCore(config, loaded=core.loaded)  # shares the weights; level 1 on the CPU keeps them
    pinned.prefill_pins()
    num_pinned = pinned.kv_manager.pins.num_pinned_blocks
    assert num_pinned >= 2
    pinned.sleep(1)
    assert pinned.kv_manager.pins.num_pinned_blocks == 0  # their KV is gone: nothing may claim it
    pinned.wake_up()
    pinned.prefill_pins()  # the queued pin prefills (AsyncEngine's loop steps them like any request)
    assert pinned.kv_manager.pins.num_pinned_blocks == num_pinned
    pinned.shutdown()


def test_asleep_the_engine_takes_no_request_and_defers_cache_policy(core):
    core.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        core.add_request("x", core.tokenizer.encode(PROMPT), SamplingParams(max_tokens=2))
    assert not core.has_unfinished()
    # A live config change asking for a pin: nothing may prefill into a freed cache; it applies on wake.
    core.apply_cache_policy(core.config.cache.model_copy(update={"pinned_prefixes": (PROMPT,)}))
    assert not core.has_unfinished()
    core.wake_up()
    core.prefill_pins()
    assert core.kv_manager.pins.num_pinned_blocks >= 2
    core.apply_cache_policy(core.config.cache)  # unpinned again: later tests start from a plain cache
    assert core.kv_manager.pins.num_pinned_blocks == 0


def test_kv_release_and_restore_of_allocator_backed_tensors():
    """The CUDA path of kv_tensors (storage resized to nothing, then back, zeroed), on ordinary tensors."""
    from tokenfleet.runtime.engine.kv_cache.kv_tensors import release_kv_caches, restore_kv_caches

    caches = [(torch.ones(4, 2, 1, 8), torch.ones(4, 2, 1, 8)) for _ in range(2)]
    view = caches[0][0][1]  # a view taken before the sleep, as a compiled step or a draft would hold
    assert release_kv_caches(caches) == 4 * 4 * 2 * 8 * 4
    assert all(t.untyped_storage().nbytes() == 0 for pair in caches for t in pair)
    restore_kv_caches(caches)
    assert all(t.shape == (4, 2, 1, 8) and not t.any() for pair in caches for t in pair)
    caches[0][0][1].fill_(3.0)
    assert view.eq(3.0).all()  # the view sees the restored memory
