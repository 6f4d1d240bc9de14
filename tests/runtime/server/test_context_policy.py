"""context_overflow: truncate on the real default model (context length cut to 256 tokens): a long chat
keeps the system message and the most recent whole turns, usage and a header report what was kept and
dropped, a system message that alone does not fit is a 400; completions drop tokens from the left."""

from __future__ import annotations

from dataclasses import replace

import openai
import pytest
from tokenfleet.runtime.engine.async_engine import AsyncEngine
from tokenfleet.runtime.engine.engine_core import EngineCore
from tokenfleet.runtime.server.prompts import DROPPED_HEADER

from .conftest import ServerThread, real_config

MODEL = "smollm2-135m-instruct"
CONTEXT = 256
MAX_TOKENS = 8
SYSTEM = {"role": "system", "content": "You are a terse assistant."}


@pytest.fixture(scope="module")
def truncating_server(loaded_model):
    short = replace(loaded_model, max_model_len=CONTEXT)
    config = real_config(model={"context_overflow": "truncate"})
    server = ServerThread(config, lambda cfg: AsyncEngine(EngineCore(cfg, loaded=short))).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(truncating_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=truncating_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _conversation(num_turns: int) -> list[dict]:
    messages = [SYSTEM]
    for i in range(num_turns):
        messages.append({"role": "user", "content": f"Question {i}: tell me something about the number {i}."})
        messages.append(
            {"role": "assistant", "content": f"The number {i} comes after {i - 1} and before {i + 1}."}
        )
    messages.append({"role": "user", "content": "And what was the first number we discussed?"})
    return messages


def _count(tok, messages: list[dict]) -> int:
    return len(tok.encode(tok.apply_chat_template(messages), add_special_tokens=False))


def test_long_chat_keeps_system_and_most_recent_whole_turns(oai, truncating_server):
    tok = truncating_server.engine.tokenizer
    messages = _conversation(12)
    full = _count(tok, messages)
    budget = CONTEXT - MAX_TOKENS
    assert full > budget
    # The expected result, by brute force: the most recent turns (each a user message and its answer) that fit.
    turns = [messages[1 + 2 * i : 3 + 2 * i] for i in range(12)] + [[messages[-1]]]

    def last(k: int) -> list[dict]:
        return [SYSTEM, *(m for turn in turns[len(turns) - k :] for m in turn)]

    kept = next(k for k in range(len(turns), 0, -1) if _count(tok, last(k)) <= budget)
    expected = _count(tok, last(kept))
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    resp = raw.parse()
    assert 1 < kept < len(turns)
    assert resp.usage.prompt_tokens == expected
    assert int(raw.headers[DROPPED_HEADER]) == full - expected
    assert resp.choices[0].finish_reason in ("stop", "length")
    metrics = truncating_server.state.metrics.render().decode()
    assert "prompt_tokens_truncated_total" in metrics


def test_prompt_that_fits_is_untouched(oai):
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=_conversation(1), max_tokens=MAX_TOKENS, temperature=0
    )
    assert DROPPED_HEADER not in raw.headers


def test_system_message_alone_too_long_is_400(oai):
    huge = {"role": "system", "content": "rules " * 400}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=MODEL, messages=[huge, {"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS
        )
    assert e.value.body["code"] == "context_length_exceeded"
    assert "system message" in e.value.body["message"]


def test_completions_drop_tokens_from_the_left(oai, truncating_server):
    tok = truncating_server.engine.tokenizer
    prompt = " ".join(f"w{i}" for i in range(400))
    ids = tok.encode(prompt, add_special_tokens=True)
    raw = oai.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, echo=True
    )
    resp = raw.parse()
    budget = CONTEXT - MAX_TOKENS
    assert resp.usage.prompt_tokens == budget
    assert int(raw.headers[DROPPED_HEADER]) == len(ids) - budget
    # What is kept is the end of the prompt (the echo shows exactly the tokens the model saw).
    assert resp.choices[0].text.startswith(tok.decode(ids[len(ids) - budget :]))
