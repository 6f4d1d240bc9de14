"""A real server with `server.stream_interval`: fewer SSE events, the same stream as every step's."""

from __future__ import annotations

import json

import aiohttp

BODY = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 13,
        "temperature": 0, "ignore_eos": True, "logprobs": 1, "stream": True,
        "stream_options": {"include_usage": True}}  # fmt: skip


async def _events(url: str) -> list[dict]:
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=BODY) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).decode()
    lines = [line[6:] for line in raw.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _text_and_logprobs(events: list[dict]) -> tuple[str, list]:
    choices = [c for e in events for c in e["choices"]]
    text = "".join(c["text"] for c in choices)
    tokens = [
        (t, lp)
        for c in choices
        if c["logprobs"]
        for t, lp in zip(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"], strict=True)
    ]
    return text, tokens


async def test_a_stream_interval_sends_fewer_events_with_the_same_text_logprobs_and_usage(
    real_server, start_real_server
):
    every = await _events(real_server.url)
    chunky = await _events(start_real_server(server={"stream_interval": 4}).url)
    assert _text_and_logprobs(chunky) == _text_and_logprobs(every)
    assert chunky[-1]["usage"] == every[-1]["usage"] and every[-1]["usage"]["completion_tokens"] == 13
    counts = [len(c["logprobs"]["tokens"]) for e in chunky for c in e["choices"]]
    # The first token at once, then four at a time, the finish with the rest: 1 + 4 + 4 + 4.
    assert counts == [1, 4, 4, 4], counts
    assert len([e for e in every if e["choices"]]) == 13
    assert chunky[-2]["choices"][0]["finish_reason"] == "length"
