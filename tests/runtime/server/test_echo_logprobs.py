"""Scoring a text through the server: `/v1/completions` with `echo` + `logprobs` (OpenAI's legacy shape, as
lm-eval-harness uses it), `max_tokens: 0` with echo, and vLLM's `prompt_logprobs` on both endpoints.

The real model behind the real server: the prompt's logprobs must equal HF transformers' log_softmax.
Bad combinations are 400s naming the parameter (on the fake engine: they never reach an engine).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

COMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
TOL = 1e-4
TEXT = "The quick brown fox jumps over the lazy dog because it was"


@pytest.fixture(scope="module")
def http(real_server) -> str:
    return real_server.url


@pytest.fixture(scope="module")
def tokenizer(real_server):
    return real_server.engine.tokenizer


def hf_logprobs(hf_oracle, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_oracle(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def post(base_url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def test_echo_with_logprobs_scores_the_prompt(http, tokenizer, hf_oracle):
    ids = tokenizer.encode(TEXT)
    body = post(http, COMPL, {"prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0})
    (choice,) = body["choices"]
    assert choice["text"].startswith(TEXT)
    assert "prompt_logprobs" not in choice  # not asked for
    lps = choice["logprobs"]
    num = len(ids) + body["usage"]["completion_tokens"]
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(lps["top_logprobs"]) == num
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert lps["tokens"][: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lps["text_offset"][0] == 0
    assert lps["text_offset"] == sorted(lps["text_offset"])
    assert lps["text_offset"][len(ids)] == len(TEXT)  # generated tokens start after the echo
    ref = hf_logprobs(hf_oracle, ids)
    worst = max(abs(lps["token_logprobs"][i + 1] - float(ref[i, ids[i + 1]])) for i in range(len(ids) - 1))
    assert worst < TOL
    for i in range(len(ids) - 1):
        top = lps["top_logprobs"][i + 1]
        assert len(top) <= 2
        best = ref[i].topk(1)
        assert abs(max(top.values()) - float(best.values[0])) < TOL


def test_echo_with_max_tokens_zero_returns_only_the_prompt(http, tokenizer, hf_oracle):
    ids = tokenizer.encode(TEXT)
    body = post(http, COMPL, {"prompt": [TEXT, "Hello there"], "echo": True, "logprobs": 0, "max_tokens": 0})
    first, second = body["choices"]
    assert first["text"] == TEXT and second["text"] == "Hello there"
    assert first["finish_reason"] == "length" and second["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids) + len(tokenizer.encode("Hello there"))
    lps = first["logprobs"]
    assert len(lps["tokens"]) == len(ids)
    assert all(t == {} for t in lps["top_logprobs"][1:])  # logprobs 0: the token's own logprob only
    ref = hf_logprobs(hf_oracle, ids)
    assert (
        max(abs(lps["token_logprobs"][i + 1] - float(ref[i, ids[i + 1]])) for i in range(len(ids) - 1)) < TOL
    )
    # The prompt is the whole answer: its text offsets run over the echo alone.
    assert lps["text_offset"][-1] + len(lps["tokens"][-1]) == len(TEXT)


def test_streamed_echo_with_max_tokens_zero_sends_only_the_prompt(http):
    body = {
        "prompt": TEXT,
        "echo": True,
        "max_tokens": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        http + COMPL, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        lines = [line.decode().strip() for line in resp if line.strip()]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    choices = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == TEXT
    assert [c["finish_reason"] for c in choices][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 0


def test_echo_with_n_gives_every_choice_the_prompt_scores(http, tokenizer):
    ids = tokenizer.encode(TEXT)
    body = post(
        http,
        COMPL,
        {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 2, "n": 2, "temperature": 1.0, "seed": 3},
    )
    a, b = body["choices"]
    p = len(ids)
    assert a["logprobs"]["token_logprobs"][:p] == b["logprobs"]["token_logprobs"][:p]
    assert a["logprobs"]["token_logprobs"][0] is None


def test_prompt_logprobs_on_completions_in_vllm_shape(http, tokenizer, hf_oracle):
    ids = tokenizer.encode(TEXT)
    body = post(http, COMPL, {"prompt": TEXT, "prompt_logprobs": 3, "max_tokens": 1, "temperature": 0})
    (choice,) = body["choices"]
    assert choice["logprobs"] is None
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = hf_logprobs(hf_oracle, ids)
    for i, position in enumerate(plp[1:]):
        token = ids[i + 1]
        assert next(iter(position)) == str(token)  # the prompt token first, then the alternatives
        assert 3 <= len(position) <= 4
        for key, entry in position.items():
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert abs(entry["logprob"] - float(ref[i, int(key)])) < TOL
            assert entry["decoded_token"] == tokenizer.decode([int(key)])
        # The top 3 by rank, one of which may be the prompt token itself.
        assert {1, 2, 3} <= {e["rank"] for e in position.values()}


def test_prompt_logprobs_on_chat_beside_the_choices(http, tokenizer, hf_oracle):
    messages = [{"role": "user", "content": "Name a color."}]
    body = post(
        http, CHAT, {"messages": messages, "prompt_logprobs": 0, "max_tokens": 2, "temperature": 0, "n": 2}
    )
    prompt_ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
    )
    plp = body["prompt_logprobs"]
    assert len(plp) == len(prompt_ids) == body["usage"]["prompt_tokens"]
    assert plp[0] is None
    ref = hf_logprobs(hf_oracle, prompt_ids)
    for i, position in enumerate(plp[1:]):
        assert list(position) == [str(prompt_ids[i + 1])]
        assert abs(position[str(prompt_ids[i + 1])]["logprob"] - float(ref[i, prompt_ids[i + 1]])) < TOL
    # Not asked for: absent.
    plain = post(http, CHAT, {"messages": messages, "max_tokens": 1})
    assert "prompt_logprobs" not in plain


BAD = [
    # (id, path, body, param)
    ("echo-logprobs-stream", COMPL, {"prompt": "ab", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    (
        "prompt-logprobs-stream",
        COMPL,
        {"prompt": "ab", "prompt_logprobs": 1, "stream": True},
        "prompt_logprobs",
    ),
    (
        "chat-prompt-logprobs-stream",
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0, "stream": True},
        "prompt_logprobs",
    ),
    ("prompt-logprobs-above-20", COMPL, {"prompt": "ab", "prompt_logprobs": 21}, "prompt_logprobs"),
    (
        "prompt-logprobs-negative",
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": -1},
        "prompt_logprobs",
    ),
    ("max-tokens-zero-without-echo", COMPL, {"prompt": "ab", "max_tokens": 0}, "max_tokens"),
    ("echo-logprobs-above-20", COMPL, {"prompt": "ab", "echo": True, "logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
async def test_bad_combinations_are_400s(client, fake_engine, path, body, param):
    resp = await client.post(path, json=body)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert fake_engine.active == set() and fake_engine.submitted == []
