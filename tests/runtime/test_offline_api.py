"""The offline API in vLLM's shapes, used as a vLLM example would: `from tokenfleet import LLM,
SamplingParams`; generate with n=2 and logprobs, chat, a token-id prompt. The shapes are vLLM's and the
greedy results equal the plain engine's."""

from __future__ import annotations

import math

import pytest

from tokenfleet import LLM, CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(loaded=default_model, num_blocks=128)


def _engine_greedy(llm: LLM, ids: list[int], max_tokens: int) -> list[int]:
    """The same request stepped through the EngineCore by hand: the reference the offline API must equal."""
    core = llm.engine
    core.add_request(f"ref-{len(ids)}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens: list[int] = []
    while core.has_unfinished():
        for delta in core.step():
            tokens.extend(delta.new_token_ids)
    return tokens


def test_generate_returns_one_request_output_per_prompt_with_n_completions_and_logprobs(llm):
    prompts = ["The capital of France is", "Hello, my name is"]
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=6, logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [type(o) for o in outputs] == [RequestOutput, RequestOutput]
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt == prompt and out.finished
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert [c.index for c in out.outputs] == [0, 1]
        for c in out.outputs:
            assert isinstance(c, CompletionOutput) and c.finished()
            assert c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids) <= 6
            assert c.text == llm.tokenizer.decode(c.token_ids)
            assert len(c.logprobs) == len(c.token_ids)
            for token, position in zip(c.token_ids, c.logprobs, strict=True):
                assert token in position and 3 <= len(position) <= 4  # the sampled token + the top 3
                top = sorted(position.values(), key=lambda lp: -lp.logprob)[:3]
                assert [lp.rank for lp in top] == [1, 2, 3]
                assert position[token].rank >= 1  # exact even when the sampled token is not in the top 3
                assert position[token].decoded_token == llm.tokenizer.decode(
                    [token], skip_special_tokens=False
                )
            assert c.cumulative_logprob == pytest.approx(
                sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs, strict=True))
            )
            assert c.cumulative_logprob < 0 and math.isfinite(c.cumulative_logprob)
    # seed + i per completion: the two completions of a prompt are drawn independently.
    assert outputs[0].outputs[0].token_ids != outputs[0].outputs[1].token_ids


def test_greedy_generate_chat_and_token_prompts_equal_the_plain_engine(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    ids = llm.tokenizer.encode("The capital of France is")
    reference = _engine_greedy(llm, ids, 8)
    as_text = llm.generate("The capital of France is", greedy, use_tqdm=False)[0]
    as_ids = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0]
    assert as_text.outputs[0].token_ids == as_ids.outputs[0].token_ids == reference
    assert as_ids.prompt is None and as_ids.prompt_token_ids == ids
    assert as_text.outputs[0].cumulative_logprob is None and as_text.outputs[0].logprobs is None

    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    chat = llm.chat(conversation, greedy, use_tqdm=False)
    rendered = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    chat_ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(chat) == 1 and chat[0].prompt == rendered and chat[0].prompt_token_ids == chat_ids
    assert chat[0].outputs[0].token_ids == _engine_greedy(llm, chat_ids, 8)
    # A list of conversations: one RequestOutput each, in order.
    two = llm.chat([conversation, [{"role": "user", "content": "Say hi."}]], greedy, use_tqdm=False)
    assert len(two) == 2 and two[0].prompt_token_ids == chat_ids
    assert two[0].outputs[0].token_ids == chat[0].outputs[0].token_ids


def test_vllm_spellings_of_sampling_params_and_the_progress_bar(llm):
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    assert params.structured_outputs is params.structured_output is not None
    bars = []

    class Bar:
        def __init__(self, total, **_):
            self.total, self.done = total, 0
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            pass

    outs = llm.generate(["Is Paris in France?"] * 3, params, use_tqdm=Bar)
    assert {o.outputs[0].text for o in outs} <= {"yes", "no"}
    assert [(b.total, b.done) for b in bars] == [(3, 3)]


def test_no_sampling_params_means_the_models_generation_config(llm):
    defaults = llm.get_default_sampling_params()
    # The built-in model's catalog entry: its card's settings, max_new_tokens as max_tokens.
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.2, 0.9, 512)


def test_chat_renders_tools_with_the_models_template_and_defaults_come_from_generation_config(tmp_path):
    from .server.tool_checkpoint import build_tool_checkpoint

    path = build_tool_checkpoint(tmp_path, {"temperature": 0.0, "max_new_tokens": 5})
    llm = LLM(model=str(path), num_blocks=32, dtype="float32")
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
    conversation = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = llm.chat(conversation, tools=[tool], use_tqdm=False)[0]
    plain = llm.chat(conversation, use_tqdm=False)[0]
    assert '"name": "get_weather"' in with_tools.prompt and "get_weather" not in plain.prompt
    # No SamplingParams: the checkpoint's generation_config.json (greedy, max_new_tokens 5 as max_tokens).
    again = llm.chat(conversation, tools=[tool], use_tqdm=False)[0]
    assert len(with_tools.outputs[0].token_ids) <= 5
    assert again.outputs[0].token_ids == with_tools.outputs[0].token_ids


def test_structured_outputs_params_take_exactly_one_constraint():
    from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec
    from tokenfleet.runtime.errors import InvalidRequest

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    older = SamplingParams(guided_decoding=StructuredOutputsParams(json=schema))
    assert older.structured_output == GrammarSpec.json_schema(schema)
    assert SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)).structured_output == (
        GrammarSpec.json_object()
    )
    with pytest.raises(InvalidRequest, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+", choice=["b"]))
    with pytest.raises(InvalidRequest, match="one structured output"):
        SamplingParams(structured_output=GrammarSpec.regex("a+"), structured_outputs=GrammarSpec.regex("b+"))
