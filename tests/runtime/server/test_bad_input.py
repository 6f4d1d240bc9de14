"""Bad input gets a 4xx OpenAI-shaped JSON error; the server stays healthy and nothing is left running."""

from __future__ import annotations

import asyncio

import pytest
from tokenfleet.runtime.config import RuntimeConfig

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

CASES = [
    # (id, path, raw body, status, param)
    ("malformed-json", COMPL, b'{"prompt": "a", ', 400, None),
    ("not-an-object", COMPL, b"[1, 2]", 400, None),
    ("wrong-type-max-tokens", COMPL, {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("wrong-type-prompt", COMPL, {"prompt": 5}, 400, "prompt"),
    ("missing-prompt", COMPL, {"max_tokens": 3}, 400, "prompt"),
    ("negative-max-tokens", COMPL, {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("temperature-below-zero", COMPL, {"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ("top-p-zero", CHAT, {"messages": MSGS, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", CHAT, {"messages": MSGS, "top_p": 1.5}, 400, "top_p"),
    ("n-zero", CHAT, {"messages": MSGS, "n": 0}, 400, "n"),
    ("prompt-too-long", COMPL, {"prompt": "x" * 100}, 400, "prompt"),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages"),
    ("unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (
        "image-part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages.0.content.0.type",
    ),
    ("top-logprobs-without-logprobs", CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    ("tools", CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, 400, "tools"),
    ("unknown-model", CHAT, {"model": "gpt-9", "messages": MSGS}, 404, "model"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
async def test_bad_input_is_a_json_4xx(client, fake_engine, path, body, status, param):
    if isinstance(body, bytes):
        resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    else:
        resp = await client.post(path, json=body)
    assert resp.status == status
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert err["param"] == param
    assert fake_engine.active == set()
    assert (await client.get("/health")).status == 200
    ok = await client.post(COMPL, json={"prompt": "ok", "max_tokens": 1})
    assert ok.status == 200


async def test_oversized_body_is_413(make_client, fake_engine):
    config = RuntimeConfig.model_validate({"server": {"max_body_bytes": 1024}})
    client = await make_client(fake_engine, config)
    resp = await client.post(COMPL, json={"prompt": "x" * 2000})
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "request_too_large"
    # Without a Content-Length (chunked upload) the limit holds too.

    async def chunks():
        for _ in range(4):
            yield b"x" * 512

    resp = await client.post(COMPL, data=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status == 413
    assert fake_engine.active == set()


async def test_overloaded_engine_maps_to_429(client, fake_engine):
    fake_engine.max_waiting = 1
    fake_engine.step_s = 0.05
    first = asyncio.ensure_future(client.post(COMPL, json={"prompt": "a", "max_tokens": 5}))
    await asyncio.sleep(0.02)
    resp = await client.post(COMPL, json={"prompt": "b", "max_tokens": 5, "n": 1})
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "3"  # 2.5 s rounded up
    assert (await resp.json())["error"]["type"] == "rate_limit_error"
    assert (await first).status == 200


async def test_refused_choice_aborts_the_accepted_ones(client, fake_engine):
    fake_engine.max_waiting = 2
    resp = await client.post(COMPL, json={"prompt": "a", "max_tokens": 5, "n": 3})
    assert resp.status == 429
    assert fake_engine.active == set()
    assert len(fake_engine.aborted) == 2
