"""The real default model behind the real server, driven by the official `openai` client.

Greedy outputs are compared with the offline engine (`LLM`, sharing the same weights) for the same
request; usage counts must equal the real token counts.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def oai(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(loaded_model) -> LLM:
    return LLM(loaded=loaded_model, num_blocks=64)


def greedy(offline: LLM, token_ids: list[int], max_tokens: int):
    return offline.generate([token_ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].outputs[0]


def wait_idle(server, timeout: float = 30.0) -> None:
    """Every request finished and every KV block back in the free pool."""
    deadline = time.monotonic() + timeout
    while True:
        s = server.engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
            assert s.kv_cache_usage == 0.0
            return
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.05)


def test_chat_greedy_equals_offline_engine(oai, real_server, offline):
    resp = oai.chat.completions.create(
        model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=8, temperature=0
    )
    tok = real_server.engine.tokenizer
    prompt_ids = tok.encode(
        tok.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False
    )
    ref = greedy(offline, prompt_ids, 8)
    assert resp.choices[0].message.content == ref.text
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == len(prompt_ids) + len(ref.token_ids)
    assert "Paris" in resp.choices[0].message.content


def test_chat_stream_matches_non_stream_and_reports_usage(oai):
    kwargs = {"model": "smollm2-135m-instruct", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    whole = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completions_stream_and_not(oai, real_server, offline):
    prompt = "The capital of France is"
    resp = oai.completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=6, temperature=0, logprobs=2
    )
    ids = real_server.engine.tokenizer.encode(prompt)
    ref = greedy(offline, ids, 6)
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].text.startswith(" Paris")
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(ref.token_ids)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids) and len(lp.top_logprobs[0]) <= 2
    assert all(v <= 0 for v in lp.token_logprobs)
    stream = oai.completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == ref.text


def test_models_and_unknown_model(oai):
    assert [m.id for m in oai.models.list().data] == ["smollm2-135m-instruct"]
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)


def test_too_long_prompt_is_400_and_leaks_nothing(oai, real_server):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="smollm2-135m-instruct", prompt=[1] * 9000, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    wait_idle(real_server)


async def test_64_streams_with_a_quarter_disconnecting(real_server):
    url = real_server.url + "/v1/completions"

    async def client(i: int, session: aiohttp.ClientSession) -> str:
        body = {
            "prompt": f"Count to {i}:",  # short prompts: one prefill step admits all 64
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        resp = await session.post(url, json=body)
        assert resp.status == 200
        if i % 4 == 0:  # read a couple of events, then hang up
            await resp.content.readuntil(b"\n\n")
            await resp.content.readuntil(b"\n\n")
            resp.close()
            return "disconnected"
        events = [e for e in (await resp.text()).split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: ") :])
        assert last["choices"][0]["finish_reason"] == "length"
        return "completed"

    async def aborted_so_far() -> float:
        async with aiohttp.ClientSession() as session:
            text = await (await session.get(real_server.url + "/metrics")).text()
        prefix = (
            'tokenfleet:request_success_total{finished_reason="abort",model_name="smollm2-135m-instruct"} '
        )
        return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))

    aborted_before = await aborted_so_far()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as session:
        outcomes = await asyncio.gather(*(client(i, session) for i in range(64)))
    assert outcomes.count("completed") == 48 and outcomes.count("disconnected") == 16
    await asyncio.to_thread(wait_idle, real_server)
    async with aiohttp.ClientSession() as session:
        metrics = await (await session.get(real_server.url + "/metrics")).text()
    label = '{model_name="smollm2-135m-instruct"}'
    assert f"tokenfleet:num_requests_running{label} 0.0" in metrics
    assert f"tokenfleet:num_requests_waiting{label} 0.0" in metrics
    assert f"tokenfleet:kv_cache_usage_perc{label} 0.0" in metrics
    assert await aborted_so_far() - aborted_before == 16


async def test_kv_events_stream_reports_new_cached_blocks(real_server):
    async with aiohttp.ClientSession() as session:
        first = await (await session.get(real_server.url + "/v1/kv-events")).json()
        assert first["reset"] is True and first["block_size"] == 16
        body = {
            "prompt": [1000 + i for i in range(40)],
            "max_tokens": 1,
        }  # two full blocks, never seen before
        assert (await session.post(real_server.url + "/v1/completions", json=body)).status == 200
        params = {"since": first["seq"], "epoch": first["epoch"], "wait": 5}
        reply = await (await session.get(real_server.url + "/v1/kv-events", params=params)).json()
        assert reply["reset"] is False and reply["seq"] > first["seq"]
        stored = [h for e in reply["events"] if e["type"] == "stored" for h in e["block_hashes"]]
        assert len(stored) >= 2
        load = await (await session.get(real_server.url + "/load")).json()
        assert set(load) == {"num_running", "num_waiting", "kv_cache_usage", "tokenizer_digest", "access"}
        assert load["tokenizer_digest"]  # the router re-fetches the tokenizer when this changes
        # No key configured on this server: every endpoint is open, and /load says so.
        assert load["access"]["/v1/completions"]["needs"] == "none"
