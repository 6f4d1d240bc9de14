"""A tensor-parallel pod's KV blocks: every rank's shard gathered by rank 0, and scattered back to the ranks.

- Pure: shards join into one payload per block, rank 0 first, and split back; sizes that do not fit and
  another tensor-parallel size are refused, naming both sizes.
- Real TP=2 engines (worker processes, gloo): a gathered block is each rank's own KV heads (each shard is
  that head of a one-process cache); blocks gathered from one TP=2 engine and scattered into another give
  a full prefix hit and the same greedy tokens — also when the insertion evicts cached blocks into the host
  tier, whose copies every rank must run before the transfer overwrites those blocks.
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for
from tokenfleet.runtime.engine.kv_cache.kv_connector import (
    KVLayout,
    KVTransferError,
    check_chain,
    check_layout,
    insert_prefix_blocks,
    layout_of,
    read_blocks,
)
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.parallel.kv_shards import PodKV, join_shards, split_shards
from tokenfleet.runtime.engine.sampling_params import SamplingParams

from .test_tensor_parallel import checkpoints  # noqa: F401 (the tiny random checkpoints, a fixture)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)


def test_shards_join_into_one_payload_per_block_rank_0_first_and_split_back():
    shards = [[b"a0a0", b"b0b0"], [b"a1a1", b"b1b1"], [b"a2a2", b"b2b2"]]
    joined = join_shards(shards)
    assert joined == [b"a0a0a1a1a2a2", b"b0b0b1b1b2b2"]
    assert split_shards(joined, 3) == shards
    with pytest.raises(KVTransferError, match="different numbers of blocks"):
        join_shards([[b"a0"], [b"a1", b"b1"]])
    with pytest.raises(KVTransferError, match="does not split into 2 equal shards"):
        split_shards([b"abc"], 2)


def test_another_tensor_parallel_size_is_refused_naming_both_sizes():
    ours = KVLayout(2, (8, 1, 16), "float32", 4, tp_size=2)
    check_layout(ours, ours.as_json())
    with pytest.raises(KVTransferError, match="the sending pod has 1, this pod 2"):
        check_layout(ours, {**ours.as_json(), "tp_size": 1})
    one = KVLayout(2, (8, 2, 16), "float32", 4)
    no_size = {k: v for k, v in one.as_json().items() if k != "tp_size"}  # a sender of one process
    check_layout(one, no_size)
    with pytest.raises(KVTransferError, match="the sending pod has 1, this pod 2"):
        check_layout(ours, no_size)
    with pytest.raises(KVTransferError, match="is not ours"):
        check_layout(one, {**one.as_json(), "dtype": "bfloat16"})
    assert ours.bytes_per_block == 2 * ours.bytes_per_shard == one.bytes_per_block


def test_a_one_process_pod_reads_and_writes_whole_blocks_and_refuses_wrong_sizes():
    src = [(torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)) for _ in range(2)]
    dst = [(torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)) for _ in range(2)]
    payloads = PodKV(src, None).read([3, 1])
    assert payloads == read_blocks(src, [3, 1]) and PodKV(src, None).layout == layout_of(src)
    PodKV(dst, None).write([0, 2], payloads)
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        assert torch.equal(dk[0], sk[3]) and torch.equal(dv[2], sv[1]) and not dk[1].any()
    with pytest.raises(KVTransferError, match="this pod's blocks have"):
        PodKV(dst, None).write([1], [payloads[0][:-4]])
    assert not dst[0][0][1].any()


def _tp_llm(tp: int, model_dir: str, **cache) -> LLM:
    return LLM(
        config=RuntimeConfig.model_validate(
            {
                "model": {"model": model_dir, "dtype": "float32"},
                "cache": {"block_size": 8, "num_blocks": 32, **cache},
                "parallel": {"tensor_parallel_size": tp},
            }
        )
    )


def _ids_and_lps(result) -> tuple[list[int], list[float]]:
    out = result.outputs[0]
    return out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]


def _heads(payload: bytes, layout: KVLayout) -> torch.Tensor:
    """[layers, K/V, block_size, heads, head_dim] of one shard's (or one process's) payload."""
    flat = torch.frombuffer(bytearray(payload), dtype=torch.float32)
    return flat.view(layout.num_layers, 2, *layout.block_shape)


@pytest.mark.slow
def test_blocks_gathered_from_one_tp2_engine_and_scattered_into_another_give_the_same_tokens(
    checkpoints,  # noqa: F811
):
    prompt = [(13 * i) % 290 + 5 for i in range(57)]  # 7 full blocks of 8 + 1
    doc = [(7 * i) % 250 + 5 for i in range(20)]  # 2 full blocks + 4
    model_dir = checkpoints["qwen2"]  # 2 KV heads: one per rank

    one = _tp_llm(1, model_dir)
    km1 = one.engine.kv_manager
    hashes = block_hashes_for(prompt, 8, km1.hash_extra)
    one.generate([prompt], GREEDY)
    whole = read_blocks(one.engine.runner.kv_caches, [km1.pool.get_cached_block(h).block_id for h in hashes])
    whole_layout = layout_of(one.engine.runner.kv_caches)

    a = _tp_llm(2, model_dir)
    try:
        cold = a.generate([prompt], GREEDY)[0]
        ka = a.engine.kv_manager
        ids = [ka.pool.get_cached_block(h).block_id for h in hashes]
        pod = PodKV(a.engine.runner.kv_caches, a.engine.workers)
        payloads = pod.read(ids)
        own = read_blocks(a.engine.runner.kv_caches, ids)
    finally:
        a.shutdown()
    layout = pod.layout
    assert layout.tp_size == 2 and layout.block_shape == (8, 1, 16)
    assert [len(p) for p in payloads] == [layout.bytes_per_block] * 7
    shards = split_shards(payloads, 2)
    assert shards[0] == own  # rank 0's part is this process's own cache
    shard_layout = KVLayout(whole_layout.num_layers, (8, 1, 16), "float32", 4)
    for i, block in enumerate(whole):
        full = _heads(block, whole_layout)
        for rank in range(2):  # rank r's part is KV head r of the one-process cache
            part = _heads(shards[rank][i], shard_layout)
            torch.testing.assert_close(part[..., 0, :], full[..., rank, :], atol=1e-5, rtol=1e-5)

    # 8 blocks: the 7 inserted ones evict the document's cached blocks into the host tier.
    b = _tp_llm(2, model_dir, num_blocks=8, cpu_offload_gib=0.0001)
    try:
        kb = b.engine.kv_manager
        doc_cold = b.generate([doc], GREEDY)[0]

        def insert(core):
            target = PodKV(core.runner.kv_caches, core.workers)
            check_layout(target.layout, layout.as_json())
            check_chain(core.kv_manager, hashes, prompt[:56], None)

            def fill(block_ids: list[int]) -> int:
                target.write(block_ids, payloads[: len(block_ids)])
                return len(block_ids)

            return insert_prefix_blocks(core.kv_manager, hashes, prompt[:56], None, fill)

        assert insert(b.engine) == 7
        warm = b.generate([prompt], GREEDY)[0]
        doc_again = b.generate([doc], GREEDY)[0]
        m = kb.metrics()
        assert kb.num_free_blocks == kb.num_blocks
    finally:
        b.shutdown()
    assert warm.num_cached_tokens == 56 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert _ids_and_lps(warm)[1] == pytest.approx(_ids_and_lps(cold)[1], abs=1e-4)
    # The document came back from the host tier on every rank, with its own KV.
    assert m.host_hit_blocks == 2 and doc_again.num_cached_tokens == 16
    assert doc_again.outputs[0].token_ids == doc_cold.outputs[0].token_ids
    assert _ids_and_lps(doc_again)[1] == pytest.approx(_ids_and_lps(doc_cold)[1], abs=1e-4)
