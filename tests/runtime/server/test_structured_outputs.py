"""Structured outputs on the real default model: response_format json_schema / json_object and the
`structured_outputs` extension (regex, choice) through the official `openai` client; grammar-constrained
decoding stays exact under batching, recompute preemption and speculative decoding."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from tokenfleet.runtime.config import RuntimeConfig, SpeculativeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec

MODEL = "smollm2-135m-instruct"


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z]{1,8}$")
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        # A pattern, not maxLength: xgrammar expands maxLength into a repetition its mask cache cannot
        # cover (~100x the per-token mask cost, measured by bench/structured_output.py).
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def oai(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
def test_fifty_seeded_samples_at_temperature_one_all_validate(oai):
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        n=50,
        seed=1234,
        temperature=1.0,
        max_tokens=48,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
    )
    assert len(resp.choices) == 50
    people = [Person.model_validate_json(c.message.content) for c in resp.choices]
    assert all(c.finish_reason == "stop" for c in resp.choices)
    assert len({p.model_dump_json() for p in people}) > 5  # sampled, not one forced answer


def test_json_object_is_json(oai):
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with a key x."}],
        temperature=0,
        max_tokens=32,
        response_format={"type": "json_object"},
    )
    text = resp.choices[0].message.content
    assert text.lstrip().startswith("{")
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_regex_and_choice_are_honoured_streamed_and_not(oai):
    pattern = r"\d{3}-[a-z]{2,4}"
    resp = oai.completions.create(
        model=MODEL,
        prompt="A code:",
        n=4,
        seed=7,
        temperature=1.0,
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert all(re.fullmatch(pattern, c.text) for c in resp.choices), [c.text for c in resp.choices]
    options = ["positive", "negative", "neutral"]
    kwargs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Classify: tokenfleet is great!"}],
        "temperature": 1.0,
        "seed": 3,
        "max_tokens": 8,
        "extra_body": {"structured_outputs": {"choice": options}},
    }
    whole = oai.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content in options
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
            "response_format",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(oai, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param


# --- engine level: the constrained path equals itself under batching, preemption and speculation --------

ARRAY_SPEC = GrammarSpec.json_schema(
    {"type": "array", "items": {"type": "string", "enum": ["alpha", "beta"]}, "minItems": 12, "maxItems": 12}
)


def _prompt(loaded, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def test_greedy_grammar_output_is_exact_with_ngram_speculation(loaded_model):
    prompt = _prompt(loaded_model, "List alpha and beta twelve times as a JSON array.")
    params = SamplingParams(temperature=0, max_tokens=80, structured_output=ARRAY_SPEC)
    plain = LLM(loaded=loaded_model, num_blocks=64).generate([prompt], params)[0].outputs[0]
    config = RuntimeConfig(
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
    )
    spec_llm = LLM(config=config, loaded=loaded_model, num_blocks=64)
    spec = spec_llm.generate([prompt], params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids
    items = json.loads(spec.text)
    assert len(items) == 12 and set(items) <= {"alpha", "beta"}
    stats = spec_llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0  # drafts were really checked against the grammar
    assert stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.slow
def test_grammar_state_survives_batching_and_recompute_preemption(loaded_model):
    prompts = [_prompt(loaded_model, f"Person number {i} as JSON.") for i in range(4)]
    person = GrammarSpec.json_schema(PERSON_SCHEMA)
    params = [
        SamplingParams(
            temperature=0.8, seed=i, max_tokens=40, structured_output=person if i % 2 == 0 else None
        )
        for i in range(4)
    ]
    single = LLM(loaded=loaded_model, num_blocks=64)
    alone = [single.generate([p], q)[0].outputs[0] for p, q in zip(prompts, params, strict=True)]
    # Four sequences in a cache that cannot hold them all at once: the newest get preempted and recomputed.
    tight = LLM(loaded=loaded_model, num_blocks=12, block_size=16, enable_prefix_caching=False)
    batched = [o.outputs[0] for o in tight.generate(prompts, params)]
    assert tight.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    for i in range(0, 4, 2):
        Person.model_validate_json(batched[i].text)


def test_grammars_compile_once_per_spec_in_a_bounded_lru_over_our_tokenizer(loaded_model):
    import torch
    from tokenfleet.runtime.engine.structured_output.compiler import GrammarCompiler
    from tokenfleet.runtime.engine.structured_output.state import GrammarState, grammar_bitmask

    tok = loaded_model.tokenizer
    vocab = loaded_model.arch.vocab_size
    compiler = GrammarCompiler(tok, vocab, cache_size=2)
    a, b, c = (GrammarSpec.regex(p) for p in ("a+", "b+", "c+"))
    compiler.compile(a)
    compiler.compile(GrammarSpec.regex("a+"))  # equal spec: a cache hit
    assert compiler.num_compiled == 1
    compiler.compile(b)
    compiler.compile(c)  # evicts `a`, the least recently used
    assert len(compiler) == 2
    compiler.compile(b)
    assert compiler.num_compiled == 3
    compiler.compile(a)
    assert compiler.num_compiled == 4
    # The vocabulary is ours: inside a JSON string, ordinary tokens are allowed but special ones are not.
    state = GrammarState(compiler.compile(GrammarSpec.json_schema({"type": "string"})), vocab)
    mask = grammar_bitmask([(state, tok.encode('"abc', add_special_tokens=False))], vocab)
    allowed = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(-1)[:vocab]
    assert allowed[tok.encode("def", add_special_tokens=False)[0]]
    assert not allowed[tok.backend.token_to_id("<|im_start|>")]
    assert allowed[tok.encode('"', add_special_tokens=False)[0]]


# --- an unset `strict` is strict (what instructor-style clients rely on) -----------------------------------

# Optional properties and no `additionalProperties`: the shape pydantic / instructor send, without `strict`.
PET_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "legs": {"type": "integer"}},
    "required": ["name"],
}


def _pet_spec(json_schema: dict) -> GrammarSpec:
    from tokenfleet.runtime.openai.protocol import ChatCompletionRequest
    from tokenfleet.runtime.openai.translate import chat_params

    body = {
        "model": MODEL,
        "messages": ASK,
        "response_format": {"type": "json_schema", "json_schema": json_schema},
    }
    spec = chat_params(ChatCompletionRequest.model_validate(body)).structured_output
    assert spec is not None
    return spec


def test_a_json_schema_without_strict_refuses_properties_the_schema_does_not_declare(loaded_model):
    import xgrammar as xgr
    from tokenfleet.runtime.engine.structured_output.compiler import GrammarCompiler

    compiler = GrammarCompiler(loaded_model.tokenizer, loaded_model.arch.vocab_size)

    def accepts(spec: GrammarSpec, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile(spec))
        return matcher.accept_string(text) and matcher.is_completed()

    unset = _pet_spec({"name": "pet", "schema": PET_SCHEMA})
    assert accepts(unset, '{"name":"Rex","legs":4}')
    assert not accepts(unset, '{"name":"Rex","color":"brown"}')
    assert not accepts(unset, '{"name": "Rex"}')  # compact separators, as before
    assert not accepts(
        _pet_spec({"name": "pet", "schema": PET_SCHEMA, "strict": True}), '{"name":"Rex","x":1}'
    )
    # An explicit `strict: false` still opens the object; a schema that allows extra properties is obeyed.
    assert accepts(_pet_spec({"name": "pet", "schema": PET_SCHEMA, "strict": False}), '{"name":"Rex","x":1}')
    open_schema = {**PET_SCHEMA, "additionalProperties": True}
    assert accepts(_pet_spec({"name": "pet", "schema": open_schema}), '{"name":"Rex","x":1}')


def test_a_served_json_schema_without_strict_answers_only_declared_properties(oai):
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a pet as JSON, with as many details as you like."}],
        n=8,
        seed=11,
        temperature=1.0,
        max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}},
    )
    finished = [json.loads(c.message.content) for c in resp.choices if c.finish_reason == "stop"]
    assert finished, [c.message.content for c in resp.choices]
    for pet in finished:
        assert set(pet) <= {"name", "legs"} and "name" in pet, pet
