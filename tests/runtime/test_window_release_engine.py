"""The engine on a random-weight Mistral with a sliding window on every layer (W = 16, 8-token blocks): long
generations give back the blocks behind the window as they go, hold a window's worth of blocks, and still
generate exactly HF transformers' greedy tokens — beside each other in a cache too small to hold them
unreleased, after a prefix-cache hit on released blocks, and after a preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenfleet.runtime.config import ModelConfig, RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.model import load_model
from tokenizers import Tokenizer as HFTokenizerBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

WINDOW, BLOCK_SIZE, NEW_TOKENS = 16, 8, 60
MAX_HELD = -(-WINDOW // BLOCK_SIZE) + 1


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, MistralConfig, PreTrainedTokenizerFast

    backend = HFTokenizerBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["a window slides over the keys of every layer"] * 10, trainer)
    directory = tmp_path_factory.mktemp("mistral_window")
    backend.save(str(directory / "tokenizer.json"))
    config = MistralConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        intermediate_size=48,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # HF's init makes logits nearly equal; larger weights make every greedy choice clear.
            param.normal_(1.0, 0.3) if name.endswith("norm.weight") else param.normal_(0.0, 0.15)
    model.save_pretrained(directory, safe_serialization=True)
    PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), eos_token="<|endoftext|>"
    ).save_pretrained(directory)
    return directory, model


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], num_new: int) -> list[int]:
    """HF's greedy continuation, each step recomputed from scratch (no cache logic shared with ours)."""
    tokens = list(prompt)
    for _ in range(num_new):
        tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def make_llm(directory: Path, num_blocks: int, **options) -> LLM:
    loaded = load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))
    assert loaded.arch.all_layers_window == WINDOW and loaded.max_model_len == 512
    return LLM(
        config=RuntimeConfig(),
        loaded=loaded,
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        **options,
    )


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[dict[str, list[int]], int]:
    """Step the engine to completion; (tokens per request, the most blocks any decoding request held)."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    max_held = 0
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
        for request in engine.scheduler.running:
            if len(request.output_token_ids) >= 2:  # its prefill is behind it: decoding
                max_held = max(max_held, engine.kv_manager.num_held_blocks(request.request_id))
    return outputs, max_held


def test_long_generations_hold_a_window_of_blocks_and_match_transformers(mistral):
    directory, hf_model = mistral
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (20, 37)]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(e)) > 5 for e in expected)  # not one token repeated
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # 13 usable blocks: unreleased, the two sequences would need 10 + 13.
    llm = make_llm(directory, num_blocks=14)
    assert llm.engine.kv_manager.sliding_window == WINDOW
    outputs, max_held = run(llm, prompts, params)
    assert [outputs["r0"], outputs["r1"]] == expected
    assert max_held <= MAX_HELD
    assert llm.engine.scheduler.num_preemptions_total == 0
    assert llm.engine.kv_manager.num_free_blocks == 13


def test_prefix_hit_on_released_blocks_matches_transformers(mistral):
    """A later prompt sharing 32 tokens with a request whose first blocks were released and stay cached."""
    directory, hf_model = mistral
    generator = torch.Generator().manual_seed(4)
    first = torch.randint(3, 320, (37,), generator=generator).tolist()
    second = first[:32] + torch.randint(3, 320, (9,), generator=generator).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = make_llm(directory, num_blocks=64, max_num_batched_tokens=16)  # chunked prefills as well
    out = llm.generate([first], params)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, first, NEW_TOKENS)
    hit = llm.generate([second], params)[0]
    assert hit.num_cached_tokens == 32
    assert hit.outputs[0].token_ids == hf_greedy(hf_model, second, NEW_TOKENS)


def test_preempted_requests_recompute_to_the_same_tokens(mistral):
    """A long request of low priority decodes alone past its window (places released), then short ones of
    higher priority arrive in a 10-block cache: their holdings grow until their windows fill (2 blocks at
    admission, 3 later), so the long one is preempted with released places in its table; it recomputes
    (prefix hits on what is still cached) and every request ends exactly as HF."""
    directory, hf_model = mistral
    generator = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(3, 320, (38,), generator=generator).tolist()
    shorts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (9, 11, 13, 15, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = make_llm(directory, num_blocks=11)
    engine = llm.engine
    scheduler, kv = engine.scheduler, engine.kv_manager
    released_at_preemption: list[int] = []
    preempt = scheduler._preempt

    def recording_preempt(request):
        released_at_preemption.append(kv.tables[request.request_id].num_released)
        preempt(request)

    scheduler._preempt = recording_preempt
    outputs: dict[str, list[int]] = {"long": [], **{f"s{i}": [] for i in range(len(shorts))}}
    engine.add_request("long", long_prompt, params, priority=1)
    for _ in range(20):
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    assert kv.tables["long"].num_released > 0
    for i, prompt in enumerate(shorts):
        engine.add_request(f"s{i}", prompt, params)
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    assert released_at_preemption and max(released_at_preemption) > 0
    assert outputs["long"] == hf_greedy(hf_model, long_prompt, 40)
    for i, prompt in enumerate(shorts):
        assert outputs[f"s{i}"] == hf_greedy(hf_model, prompt, 40)
    assert kv.num_free_blocks == 10


def test_triton_kernels_never_see_released_blocks(mistral):
    """The Triton attention backend (the interpreter on CPU): its key walk starts at the tile holding the
    first visible key, which may begin inside a released place (the null block, read and masked). Prefill
    in chunks and decode over released places give HF's tokens."""
    directory, hf_model = mistral
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = ModelConfig(model=str(directory), dtype="float32", attention_backend="triton")
    loaded = load_model(config, device)
    assert loaded.attention_backend == "triton"
    generator = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, 320, (29,), generator=generator).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(
        config=RuntimeConfig(),
        loaded=loaded,
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=16,
        max_num_batched_tokens=12,
    )
    outputs, max_held = run(llm, [prompt], params)
    assert outputs["r0"] == hf_greedy(hf_model, prompt, 24)
    assert max_held <= MAX_HELD


@pytest.mark.parametrize(("method", "release"), [("ngram", True), ("self", False)])
def test_speculative_decoding_over_released_blocks(mistral, method, release):
    """ngram proposals (rejections roll slots back past released places) keep the release; a draft that
    writes KV into the same tables (`self`: the target's first layer) turns it off. HF's tokens either way."""
    from tokenfleet.runtime.config import SpeculativeConfig

    directory, hf_model = mistral
    generator = torch.Generator().manual_seed(17)
    base = torch.randint(3, 320, (12,), generator=generator).tolist()
    prompt = base + base + base[:7]  # repeats: ngram finds matches to propose
    loaded = load_model(ModelConfig(model=str(directory), dtype="float32"), torch.device("cpu"))
    extra = {"ngram_min": 1} if method == "ngram" else {"draft_layers": 1}
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, **extra)  # type: ignore[arg-type]
    config = RuntimeConfig(speculative=spec)
    llm = LLM(config=config, loaded=loaded, dtype="float32", block_size=BLOCK_SIZE, num_blocks=32)
    assert (llm.engine.kv_manager.sliding_window == WINDOW) is release
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs, max_held = run(llm, [prompt], params)
    assert outputs["r0"] == hf_greedy(hf_model, prompt, NEW_TOKENS)
    stats = llm.engine.stats()
    # Proposals accepted (several tokens a step) and rejected (rollbacks) both happened.
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if release:
        # Look-ahead slots for the proposals: up to one more block than a plain decode.
        assert max_held <= MAX_HELD + 1


def test_released_blocks_evicted_to_the_host_tier_come_back(mistral):
    """Released (cached) blocks evicted under pressure go to the host tier like any free cached block; a later
    prompt hits them there, copied back, and generates HF's tokens."""
    from tokenfleet.runtime.engine.cache_policy import CachePolicyRuntime

    directory, hf_model = mistral
    generator = torch.Generator().manual_seed(8)
    first = torch.randint(3, 320, (37,), generator=generator).tolist()
    other = torch.randint(3, 320, (45,), generator=generator).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = make_llm(directory, num_blocks=8)  # 7 usable: `other` takes 6, evicting `first`'s blocks
    policy = getattr(llm.engine, "cache_policy", None) or CachePolicyRuntime(llm.engine)
    policy.apply(llm.config.cache.model_copy(update={"cpu_offload_gib": 0.001}))
    expected = hf_greedy(hf_model, first, 10)
    assert llm.generate([first], params)[0].outputs[0].token_ids == expected
    llm.generate([other], params)
    again = llm.generate([first], params)[0]
    m = llm.engine.kv_manager.metrics()
    assert m.host_hit_blocks >= 3 and again.num_cached_tokens >= 24
    assert again.outputs[0].token_ids == expected
    assert llm.engine.kv_manager.num_free_blocks == 7
