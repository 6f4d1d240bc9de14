"""Generation defaults from the checkpoint (HF generation_config.json, GGUF general.sampling.*): requests
that leave temperature / top_p / top_k unset use them; `model.generation_config: none` turns that off.
Also: Retry-After on a 429 follows the rate the queue drains at."""

from __future__ import annotations

import json

import gguf
import openai
import pytest
from tokenfleet.runtime.engine.async_engine import AsyncEngine
from tokenfleet.runtime.engine.drain_rate import MAX_RETRY_S, MIN_RETRY_S, DrainRate
from tokenfleet.runtime.model.generation_defaults import GenerationDefaults, read_generation_defaults
from tokenfleet.runtime.model.source import ModelSource, resolve_source
from tokenfleet.runtime.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenfleet.runtime.openai.translate import chat_params, completion_params, fit_default_max_tokens

from .conftest import ServerThread, real_config
from .tool_checkpoint import build_tool_checkpoint

ASK = [{"role": "user", "content": "Say something."}]


def test_reads_hf_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "do_sample": True, "eos_token_id": 2})
    )
    assert read_generation_defaults(ModelSource("hf_dir", tmp_path)) == GenerationDefaults(0.7, 0.8, 20)
    assert read_generation_defaults(ModelSource("hf_dir", tmp_path / "missing")) == GenerationDefaults()


def test_reads_gguf_sampling_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_int32("general.sampling.top_k", 40)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_generation_defaults(ModelSource("gguf", path)).as_dict() == pytest.approx(
        {"temperature": 0.6, "top_k": 40}
    )


def test_request_values_win_over_model_defaults():
    defaults = {"temperature": 0.2, "top_k": 7, "top_p": 0.9}
    unset = ChatCompletionRequest.model_validate({"messages": ASK})
    p = chat_params(unset, defaults)
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.2, 7, 0.9, 0.0)
    explicit = ChatCompletionRequest.model_validate({"messages": ASK, "temperature": 1.0, "top_k": 0})
    p = chat_params(explicit, defaults)
    assert (p.temperature, p.top_k, p.top_p) == (1.0, 0, 0.9)
    assert chat_params(unset).temperature == 1.0  # no defaults: OpenAI's


def test_max_new_tokens_is_read_as_the_default_max_tokens(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 300, "max_length": 20}))
    assert read_generation_defaults(ModelSource("hf_dir", tmp_path)) == GenerationDefaults(max_tokens=300)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    assert read_generation_defaults(ModelSource("hf_dir", tmp_path)) == GenerationDefaults()


def test_the_builtin_model_carries_its_cards_sampling_settings():
    defaults = read_generation_defaults(resolve_source("smollm2-135m-instruct"))
    assert defaults.as_dict() == pytest.approx({"temperature": 0.2, "top_p": 0.9, "max_tokens": 512})


def test_a_default_max_tokens_applies_only_when_the_request_sets_none_and_fits_the_context():
    defaults = {"max_tokens": 100}
    unset = ChatCompletionRequest.model_validate({"messages": ASK})
    assert chat_params(unset, defaults).max_tokens == 100
    assert chat_params(unset).max_tokens is None  # no default: up to the context, as OpenAI
    explicit = ChatCompletionRequest.model_validate({"messages": ASK, "max_completion_tokens": 300})
    assert chat_params(explicit, defaults).max_tokens == 300
    # A default shrinks to what the prompt leaves; a requested length is the request's (admission judges it).
    assert fit_default_max_tokens(chat_params(unset, defaults), unset, [950], 1000).max_tokens == 50
    assert fit_default_max_tokens(chat_params(unset, defaults), unset, [10], 1000).max_tokens == 100
    assert fit_default_max_tokens(chat_params(explicit, defaults), explicit, [950], 1000).max_tokens == 300
    # Completions default to 16 tokens (OpenAI); an explicit null asks for the default bound.
    completion = CompletionRequest.model_validate({"prompt": ["a", "b"], "max_tokens": None})
    params = completion_params(completion, defaults)
    assert fit_default_max_tokens(params, completion, [900, 960], 1000).max_tokens == 40


def test_server_default_max_tokens_bounds_requests_without_max_tokens(start_real_server):
    server = start_real_server(model={"default_max_tokens": 5})
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    unset = oai.chat.completions.create(
        model="smollm2-135m-instruct", messages=ASK, extra_body={"ignore_eos": True}
    )
    assert (unset.usage.completion_tokens, unset.choices[0].finish_reason) == (5, "length")
    asked = oai.completions.create(
        model="smollm2-135m-instruct", prompt="Once", max_tokens=9, extra_body={"ignore_eos": True}
    )
    assert asked.usage.completion_tokens == 9  # the request's own value wins


@pytest.fixture(scope="module")
def greedy_checkpoint(tmp_path_factory):
    return build_tool_checkpoint(tmp_path_factory.mktemp("gen-defaults"), {"temperature": 0.0})


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_server_applies_checkpoint_defaults_unless_off(greedy_checkpoint, mode):
    config = real_config(model={"model": str(greedy_checkpoint), "generation_config": mode})
    server = ServerThread(config, AsyncEngine.from_config).start()
    try:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = oai.models.list().data[0].id

        def text(**kw) -> str:
            return (
                oai.chat.completions.create(model=model, messages=ASK, max_tokens=16, **kw)
                .choices[0]
                .message.content
            )

        greedy = text(temperature=0)
        if mode == "auto":  # the checkpoint says temperature 0: unset means greedy, every time
            assert text() == greedy and text(seed=1) == greedy
        else:  # OpenAI's temperature 1: an unset temperature samples like an explicit 1.0
            assert text(seed=1) == text(seed=1, temperature=1.0) != greedy
    finally:
        server.stop()


def test_retry_after_follows_the_drain_rate():
    drain = DrainRate()
    assert drain.retry_after(100) == MIN_RETRY_S  # nothing finished yet: no rate to go by
    for i in range(11):
        drain.record(float(i) * 0.5)  # 2 requests per second
    assert drain.rate() == pytest.approx(2.0)
    assert drain.retry_after(20) == 10
    assert drain.retry_after(0) == MIN_RETRY_S
    assert drain.retry_after(10_000) == MAX_RETRY_S
