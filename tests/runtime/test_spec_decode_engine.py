"""Speculative decoding through the whole engine.

- Greedy: token-identical to plain decoding for every proposer, in batches, with chunked prefill, prefix
  caching and preemption (a cache too small for the batch), and every KV block free afterwards.
- Temperature > 0: the emitted tokens follow the target distribution (many seeded requests on a tiny random
  model whose exact next-token distributions are known).
- Counters: proposed / accepted tokens, acceptance rate, mean accepted length.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenfleet.runtime.config import ModelConfig, RuntimeConfig, SpeculativeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model import load_model

MAX_NEW = 16
# Repetitive prompts (n-gram lookup finds continuations) and an open one.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7,",
    "The capital of France is",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
]


def write_tiny_llama(
    directory: Path,
    vocab: int,
    tokenizer_json: str,
    *,
    layers: int,
    hidden: int = 64,
    std: float = 0.02,
    seed: int = 0,
) -> Path:
    """A random Llama checkpoint directory (config.json, model.safetensors, tokenizer.json)."""
    directory.mkdir(parents=True, exist_ok=True)
    heads, kv_heads, ffn = 4, 2, 2 * hidden
    head_dim = hidden // heads
    config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 0,
    }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text(tokenizer_json)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(ffn, hidden),
            p + "mlp.up_proj.weight": rand(ffn, hidden),
            p + "mlp.down_proj.weight": rand(hidden, ffn),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file(weights, str(directory / "model.safetensors"))
    return directory


def spec_config(method: str, k: int = 4, **extra: object) -> RuntimeConfig:
    return RuntimeConfig(
        speculative=SpeculativeConfig(method=method, num_speculative_tokens=k, **extra)  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def draft_dir(default_model, tmp_path_factory) -> Path:
    """A tiny random draft model sharing the default model's tokenizer (low acceptance: many rejections)."""
    directory = tmp_path_factory.mktemp("draft")
    tokenizer_json = default_model.tokenizer.backend.to_str()
    return write_tiny_llama(directory, default_model.arch.vocab_size, tokenizer_json, layers=2, std=0.5)


def generate(loaded, config: RuntimeConfig, prompts, params, **options):
    llm = LLM(config=config, loaded=loaded, **options)
    outs = llm.generate(prompts, params)
    km = llm.engine.kv_manager
    assert km.num_free_blocks == km.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs], llm.engine.stats()


@pytest.fixture(scope="module")
def greedy_reference(default_model):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    tokens, _ = generate(default_model, RuntimeConfig(), PROMPTS, params)
    return tokens


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize(
    ("method", "extra"), [("ngram", {"ngram_min": 2, "ngram_max": 4}), ("self", {"draft_layers": 26})]
)
def test_greedy_is_token_identical_to_plain_decoding(default_model, greedy_reference, method, extra):
    tokens, stats = generate(default_model, spec_config(method, **extra), PROMPTS, GREEDY)
    assert tokens == greedy_reference
    assert stats.spec_decode_num_draft_tokens > 0
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_mean_accepted_length > 1.0
    # Fewer steps than tokens: several tokens were emitted per step.
    assert stats.num_steps < MAX_NEW * len(PROMPTS)


def test_draft_model_greedy_is_token_identical(default_model, greedy_reference, draft_dir):
    config = spec_config("draft", k=3, draft_model=str(draft_dir))
    tokens, stats = generate(default_model, config, PROMPTS, GREEDY)
    assert tokens == greedy_reference
    assert stats.spec_decode_num_draft_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_greedy_under_preemption_and_chunked_prefill(default_model, greedy_reference, method):
    # 6 blocks of 16 tokens cannot hold the 4 sequences at once: requests are preempted and recomputed,
    # prompts are prefilled in chunks of <= 24 tokens, and resumed requests hit the prefix cache.
    extra = {"draft_layers": 26} if method == "self" else {}
    tokens, stats = generate(
        default_model, spec_config(method, **extra), PROMPTS, GREEDY, num_blocks=6, max_num_batched_tokens=24
    )
    assert tokens == greedy_reference
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_accepted_tokens > 0


def test_stop_token_inside_accepted_proposals_ends_the_output(default_model, greedy_reference):
    # Stop at a token that the plain run emits mid-output: nothing after it may leak out, whether it came
    # as an accepted proposal or not; max_tokens likewise caps a multi-token step.
    ref = greedy_reference[1]
    stop = ref[6]
    cut = ref.index(stop) + 1
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]
    llm = LLM(config=spec_config("ngram", k=6), loaded=default_model)
    outs = [o.outputs[0] for o in llm.generate([PROMPTS[1], PROMPTS[1]], params)]
    assert outs[0].token_ids == ref[:cut]
    assert outs[0].finish_reason == "stop"
    assert outs[1].token_ids == ref[:7]
    assert outs[1].finish_reason == "length"


def test_invalid_speculative_configs_are_refused(default_model, tmp_path):
    with pytest.raises(ConfigError):
        LLM(config=spec_config("self", draft_layers=30), loaded=default_model)
    with pytest.raises(ConfigError):
        LLM(config=spec_config("draft"), loaded=default_model)
    other = write_tiny_llama(tmp_path / "other", 32, _word_level_tokenizer(32), layers=1)
    with pytest.raises(ConfigError):
        LLM(config=spec_config("draft", draft_model=str(other)), loaded=default_model)


# ---- temperature > 0: the target distribution, exactly ------------------------------------------------

TINY_VOCAB = 16
# chi-square critical value, 15 degrees of freedom, p = 0.001 (the seeds are fixed: deterministic).
CHI2_CRIT_15 = 37.70


def _word_level_tokenizer(vocab: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    directory = write_tiny_llama(
        tmp_path_factory.mktemp("tiny"),
        TINY_VOCAB,
        _word_level_tokenizer(TINY_VOCAB),
        layers=2,
        std=0.6,
        seed=3,
    )
    return load_model(ModelConfig(model=str(directory), dtype="float32", device="cpu"), torch.device("cpu"))


def _next_token_probs(loaded, prompts: list[list[int]]) -> torch.Tensor:
    """Exact next-token distributions (temperature 1): full-vocabulary logprobs of a plain run."""
    llm = LLM(config=RuntimeConfig(), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=TINY_VOCAB, ignore_eos=True)
    probs = torch.zeros(len(prompts), TINY_VOCAB, dtype=torch.float64)
    for row, out in enumerate(llm.generate(prompts, params)):
        for token, logprob in out.outputs[0].logprobs[0].items():
            probs[row, token] = float(torch.tensor(logprob.logprob, dtype=torch.float64).exp())
    return probs


# ngram_min 1: on the short random prompts here only single-token matches give a proposal every step.
@pytest.mark.parametrize(("method", "extra"), [("ngram", {"ngram_min": 1}), ("self", {"draft_layers": 1})])
def test_sampled_tokens_follow_the_target_distribution(tiny_target, method, extra):
    # Every token occurs in the prompt, so n-gram lookup proposes after any first token.
    prompt = list(range(TINY_VOCAB)) * 2
    num = 600
    params = [
        SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=1000 + i) for i in range(num)
    ]
    config = spec_config(method, k=2, **extra).model_copy(
        update={"scheduler": RuntimeConfig().scheduler.model_copy(update={"max_num_seqs": 256})}
    )
    llm = LLM(config=config, loaded=tiny_target)
    outs = llm.generate([prompt] * num, params)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts >= num  # every second token went through verification
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens

    first = _next_token_probs(tiny_target, [prompt])[0]
    second_given = _next_token_probs(tiny_target, [[*prompt, a] for a in range(TINY_VOCAB)])
    expected_second = first @ second_given  # P(t2) = sum_a P(a) P(t2 | a)
    assert expected_second.max() < 0.5, "the tiny model should not be near-deterministic"
    for position, expected in ((0, first), (1, expected_second)):
        counts = torch.bincount(
            torch.tensor([o.outputs[0].token_ids[position] for o in outs]), minlength=TINY_VOCAB
        ).double()
        assert chi2_pooled(counts, expected * num) < CHI2_CRIT_15, f"token {position + 1}"


def chi2_pooled(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's statistic with cells expected below 5 pooled into one (the usual validity rule); pooling
    only lowers the degrees of freedom, so the 15-df critical value stays conservative."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().unsqueeze(0)])
    exp = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
