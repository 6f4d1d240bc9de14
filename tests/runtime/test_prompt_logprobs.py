"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`) against HF transformers on the real default model.

Every prompt position's logprob must equal log_softmax of HF's logits within 1e-4: in one prefill, spread over
many chunked-prefill steps, after a prefix-cache hit (such a request recomputes its prompt rather than read
the cache), and across a preemption. Requests that ask for none get none, and compute no extra logits.
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.runtime.config import RuntimeConfig, SpeculativeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.logprobs import compute_prompt_logprobs
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler_output import PromptLogprobsChunk
from tokenfleet.runtime.errors import InvalidRequest

from .test_tensor_parallel import checkpoints  # noqa: F401 (the tiny random checkpoints, a fixture)

TOL = 1e-4
TOP = 5

SYSTEM = (
    "You are a meticulous assistant for a shipping company. Always answer with short, factual sentences, "
    "cite the relevant policy number when one applies, and never invent tracking numbers or dates. "
)
LONG = (
    "In machine learning, a transformer is a deep learning architecture that relies on the attention "
    "mechanism. It was introduced in 2017 and has since become the basis of most large language models, "
    "including those used for chat assistants. The key idea is that every token attends to every earlier "
    "token, weighting them by learned relevance, so that long-range dependencies are captured directly "
    "instead of through a recurrent state that must carry everything forward step by step."
)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model.tokenizer


def hf_logprobs(hf_oracle, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: row i is log_softmax of HF's logits after ids[: i + 1] (scores ids[i + 1])."""
    with torch.no_grad():
        logits = hf_oracle(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def max_abs_diff(prompt_logprobs, ids: list[int], ref: torch.Tensor, k: int = TOP) -> float:
    """Checks the shape, and that each entry's rank holds HF's value at that rank (ties may swap ids);
    returns the largest |ours - HF| over every value given."""
    assert len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    worst = 0.0
    for i, position in enumerate(prompt_logprobs[1:]):
        row = ref[i]
        ranked = row.sort(descending=True).values
        token = ids[i + 1]
        assert next(iter(position)) == token, "the prompt token comes first"
        assert k + 1 >= len(position) >= k
        for t, lp in position.items():
            worst = max(worst, abs(lp.logprob - float(row[t])))
            assert abs(lp.logprob - float(ranked[lp.rank - 1])) < TOL
    return worst


def run(loaded, prompts_ids, params, **options):
    llm = LLM(config=RuntimeConfig(), loaded=loaded, dtype="float32", **options)
    return llm, llm.generate(prompts_ids, params, use_tqdm=False)


def test_one_prefill_matches_hf(default_model, hf_oracle, tokenizer):
    ids = [tokenizer.encode(p) for p in ("The capital of France is", SYSTEM + "Where is my parcel?")]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)
    llm, outs = run(default_model, ids, params)
    for prompt, out in zip(ids, outs, strict=True):
        assert max_abs_diff(out.prompt_logprobs, prompt, hf_logprobs(hf_oracle, prompt)) < TOL
        # Sampled-token logprobs were not asked for: none (as in vLLM).
        assert out.outputs[0].logprobs is None
    km = llm.engine.kv_manager
    assert km.num_free_blocks == km.num_blocks


def test_chunked_prefill_matches_hf(default_model, hf_oracle, tokenizer):
    ids = tokenizer.encode(LONG)
    assert len(ids) > 64
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP)
    llm, (out,) = run(default_model, [ids], params, max_num_batched_tokens=13)
    assert llm.engine.stats().num_steps >= len(ids) // 13  # the prompt was spread over many steps
    assert max_abs_diff(out.prompt_logprobs, ids, hf_logprobs(hf_oracle, ids)) < TOL


def test_prefix_cache_hit_recomputes_the_prompt(default_model, hf_oracle, tokenizer):
    """The second request finds the first one's blocks cached, but scores every position anyway."""
    first = tokenizer.encode(SYSTEM + "Where is my parcel?")
    second = tokenizer.encode(SYSTEM + "How do I return an item?")
    llm = LLM(config=RuntimeConfig(), loaded=default_model, dtype="float32", block_size=16)
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([first], plain, use_tqdm=False)
    # Without prompt logprobs the shared prefix is a hit ...
    (hit,) = llm.generate([second], plain, use_tqdm=False)
    assert hit.num_cached_tokens >= 16
    # ... with them the same prompt is computed from its first token, and every position is scored.
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP)
    (out,) = llm.generate([second], scored, use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert max_abs_diff(out.prompt_logprobs, second, hf_logprobs(hf_oracle, second)) < TOL
    # Its blocks were still cached for others.
    (after,) = llm.generate([second], plain, use_tqdm=False)
    assert after.num_cached_tokens >= 16
    km = llm.engine.kv_manager
    assert km.num_free_blocks == km.num_blocks


def test_chunked_and_cached_mix_in_one_batch(default_model, hf_oracle, tokenizer):
    """Scoring and non-scoring requests share steps; n > 1 scores the prompt once, for the first."""
    long_ids = tokenizer.encode(LONG)
    short_ids = tokenizer.encode(SYSTEM + "Who are you?")
    llm = LLM(
        config=RuntimeConfig(),
        loaded=default_model,
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=24,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0, n=2),
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2),
    ]
    outs = llm.generate([long_ids, short_ids, short_ids], params, use_tqdm=False)
    assert outs[1].prompt_logprobs is None
    for ids, out, k in ((long_ids, outs[0], 0), (short_ids, outs[2], 2)):
        assert max_abs_diff(out.prompt_logprobs, ids, hf_logprobs(hf_oracle, ids), k) < TOL
    # The n completions agree with the request without prompt logprobs (same greedy tokens).
    assert outs[0].outputs[0].token_ids == outs[0].outputs[1].token_ids


def test_preemption_mid_prefill_scores_each_position_once(default_model, hf_oracle, tokenizer, monkeypatch):
    """Preempted part-way through its prompt, a request resumes scoring where it stopped: each position is
    scored once, and the values still match HF."""
    ids = tokenizer.encode(LONG)
    llm = LLM(
        config=RuntimeConfig(),
        loaded=default_model,
        dtype="float32",
        block_size=16,
        num_blocks=7,
        max_num_batched_tokens=32,
    )
    scheduler = llm.engine.scheduler
    preempted_at: list[tuple[str, int]] = []  # (request id, positions scored so far)
    original = scheduler._preempt

    def recording(request):
        if request.prompt_logprobs is not None:
            preempted_at.append((request.request_id, len(request.prompt_logprobs)))
        original(request)

    monkeypatch.setattr(scheduler, "_preempt", recording)
    others = [tokenizer.encode(SYSTEM + q) for q in ("Where is my parcel?", "Who are you?")]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    ]
    outs = llm.generate([*others, ids], params, use_tqdm=False)
    assert any(0 < scored < len(ids) - 1 for _, scored in preempted_at), preempted_at
    assert max_abs_diff(outs[2].prompt_logprobs, ids, hf_logprobs(hf_oracle, ids), 1) < TOL


def test_speculative_decoding_keeps_prompt_logprobs_and_tokens(default_model, hf_oracle, tokenizer):
    """Scored rows come after the sample and verify rows of the same step; neither is disturbed."""
    ids = [tokenizer.encode(p) for p in ("1, 2, 3, 4, 5, 6, 1, 2, 3,", SYSTEM + "Where is my parcel?")]
    config = RuntimeConfig(
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=2, ngram_max=4)
    )
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = LLM(config=RuntimeConfig(), loaded=default_model, dtype="float32").generate(
        ids, plain, use_tqdm=False
    )
    llm = LLM(config=config, loaded=default_model, dtype="float32", max_num_batched_tokens=16)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2),
    ]
    outs = llm.generate(ids, params, use_tqdm=False)
    assert llm.engine.stats().spec_decode_num_draft_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in reference]
    assert max_abs_diff(outs[1].prompt_logprobs, ids[1], hf_logprobs(hf_oracle, ids[1]), 2) < TOL


def test_range_is_checked():
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_single_token_prompt(default_model):
    _, (out,) = run(default_model, [[1]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3))
    assert out.prompt_logprobs == [None]


def test_no_prompt_logprobs_computes_only_sampling_rows(default_model, tokenizer, monkeypatch):
    """The hot path: without prompt logprobs the runner asks the model for one logit row per sampled
    request, whatever the chunk length."""
    llm = LLM(config=RuntimeConfig(), loaded=default_model, dtype="float32")
    rows: list[int] = []
    model = llm.engine.runner.model
    original = model.compute_logits

    def counting(hidden, out=None):
        rows.append(hidden.shape[0])
        return original(hidden, out=out)

    monkeypatch.setattr(model, "compute_logits", counting)
    llm.generate([tokenizer.encode(LONG)], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert rows == [1, 1, 1]
    rows.clear()
    ids = tokenizer.encode(LONG)
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    assert rows == [1 + len(ids) - 1, 1]


def test_compute_prompt_logprobs_splits_rows_by_chunk():
    logits = torch.randn(5, 11)
    chunks = (PromptLogprobsChunk("a", 3, (4, 7), 2), PromptLogprobsChunk("b", 0, (1, 2, 10), 0))
    out = compute_prompt_logprobs(logits, chunks)
    ref = torch.log_softmax(logits, dim=-1)
    assert [e.token_id for e in out["a"]] == [4, 7] and [e.token_id for e in out["b"]] == [1, 2, 10]
    for row, entry in enumerate(out["a"] + out["b"]):
        assert abs(entry.logprob - float(ref[row, entry.token_id])) < 1e-6
    assert all(len(e.top) == 2 for e in out["a"]) and all(e.top == () for e in out["b"])


@pytest.mark.slow
def test_tensor_parallel_scores_like_one_process(checkpoints):  # noqa: F811
    """Every rank computes the scored rows' logits (the vocabulary is gathered across ranks)."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    prompt = [5, 9, 17, 40, 41, 3, 8, 60, 2, 11, 19, 23]

    def run(tp: int):
        llm = LLM(
            config=RuntimeConfig.model_validate(
                {
                    "model": {"model": checkpoints["llama"], "dtype": "float32"},
                    "cache": {"block_size": 8, "num_blocks": 16},
                    "scheduler": {"max_num_batched_tokens": 5},
                    "parallel": {"tensor_parallel_size": tp},
                }
            )
        )
        try:
            return llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
        finally:
            llm.shutdown()

    one, two = run(1), run(2)
    assert len(two) == len(prompt) and two[0] is None
    for a, b in zip(one[1:], two[1:], strict=True):
        assert list(a) == list(b)
        assert all(abs(a[t].logprob - b[t].logprob) < TOL for t in a)
