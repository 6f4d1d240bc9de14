"""Tensor parallelism with the engine's other features, on CPU (gloo) with real worker processes.

- The host KV tier: every rank copies its own heads' KV to and from host memory, on the copies rank 0's
  KV manager decides; greedy output after a host round trip equals one process and equals no offload.
"""

from __future__ import annotations

import pytest
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams

from .test_tensor_parallel import checkpoints  # noqa: F401 (the tiny random checkpoints, a fixture)

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1)


def _llm(tp: int, model_dir: str, **cache) -> LLM:
    return LLM(
        config=RuntimeConfig.model_validate(
            {
                "model": {"model": model_dir, "dtype": "float32"},
                "cache": {"block_size": 8, "num_blocks": 8, **cache},
                "parallel": {"tensor_parallel_size": tp},
            }
        )
    )


def _round_trip(llm: LLM, doc_a: list[int], doc_b: list[int]):
    """doc_a cold, doc_b (needs every block: evicts doc_a's), doc_a again; outputs and doc_a's cached tokens."""
    cold = llm.generate([doc_a], GREEDY)[0]
    other = llm.generate([doc_b], GREEDY)[0]
    again = llm.generate([doc_a], GREEDY)[0]
    km = llm.engine.kv_manager
    assert km.num_free_blocks == km.num_blocks  # no leaked blocks
    outs = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in (cold, other, again)]
    return outs, again.num_cached_tokens


@pytest.mark.slow
def test_host_kv_round_trip_at_tp2_matches_one_process_and_no_offload(checkpoints):  # noqa: F811
    doc_a = [(7 * i) % 250 + 5 for i in range(20)]  # 2 full blocks of 8 + 4 tokens
    doc_b = [(11 * i) % 250 + 5 for i in range(61)]  # 61 + 3 generated = 64 tokens: all 8 blocks
    model_dir = checkpoints["llama"]
    reference, recomputed = _round_trip(_llm(1, model_dir), doc_a, doc_b)
    one_process, _ = _round_trip(_llm(1, model_dir, cpu_offload_gib=0.0001), doc_a, doc_b)
    llm = _llm(2, model_dir, cpu_offload_gib=0.0001)  # ~50 host blocks per rank
    try:
        sharded, from_host = _round_trip(llm, doc_a, doc_b)
        m = llm.engine.kv_manager.metrics()
    finally:
        llm.shutdown()
    assert recomputed == 0 and from_host == 16  # the 2 full blocks came back from the host tier
    assert m.host_hit_blocks == 2 and m.loaded_blocks == 2 and m.offloaded_blocks >= 2
    for ref, tp1, tp2 in zip(reference, one_process, sharded, strict=True):
        assert ref[0] == tp1[0] == tp2[0]
        assert ref[1] == pytest.approx(tp2[1], abs=1e-4)  # fp32: only the all-reduce order differs
