"""A pod continues a stream begun elsewhere exactly (the default model, served in-process).

Each case streams a request once, annotated as the router asks, then cuts it after several events and
sends the continuation the router would send. What the client held plus the continuation must equal the
unbroken stream: the same text to the character (greedy, seeded sampling at temperature 1, a stop string
whose held-back prefix straddles the cut, a grammar, logprobs with their offsets), one id, the usage of
the whole completion. Requests that cannot be continued exactly say why in their first annotation.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.openai.resume import (
    CONTINUATION_FIELD,
    RESUME_HEADER,
    RESUME_STREAM,
    Progress,
    StreamStart,
    split_event,
)
from tokenfleet.runtime.server.resume import why_not_resumable

pytestmark = pytest.mark.slow

HEADERS = {RESUME_HEADER: RESUME_STREAM}


async def post_stream(url: str, path: str, body: dict) -> list[tuple[list, dict | None]]:
    """The stream as (annotations, client event) pairs; the event is None for annotation-only events."""
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, headers=HEADERS) as r:
        raw = await r.read()
        assert r.status == 200, raw
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        annotations, client = split_event(block.encode())
        data = client.decode().removeprefix("data: ") if client else None
        out.append((annotations, None if data in (None, "[DONE]") else json.loads(data)))
    return out


def client_text(events, chat: bool) -> str:
    parts = []
    for _, e in events:
        for c in (e or {}).get("choices", []):
            parts.append((c["delta"].get("content") or "") if chat else c["text"])
    return "".join(parts)


def finish_reason(events) -> str | None:
    reasons = [
        c["finish_reason"] for _, e in events for c in (e or {}).get("choices", []) if c["finish_reason"]
    ]
    return reasons[-1] if reasons else None


async def check_continuations(url: str, path: str, body: dict, cuts=None) -> list:
    """Stream `body`, then continue it from several cut points; every splice equals the unbroken stream."""
    chat = path.endswith("chat/completions")
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    full = await post_stream(url, path, body)
    start = next(a for anns, _ in full for a in anns if isinstance(a, StreamStart))
    assert start.resumable, start.why_not
    progress_at = [i for i, (anns, _) in enumerate(full) if any(isinstance(a, Progress) for a in anns)]
    usage = [e["usage"] for _, e in full if e and e.get("usage")][-1]
    for k in cuts or (1, len(progress_at) // 2, len(progress_at) - 1):
        held = full[: progress_at[k - 1] + 1]  # the client got every event up to the k-th token event
        progress = [a for anns, _ in held for a in anns if isinstance(a, Progress)]
        continuation = {
            "id": start.id,
            "created": start.created,
            "prompt_token_ids": start.prompt_token_ids,
            "output_token_ids": [t for p in progress for t in p.token_ids],
            "num_delivered_chars": progress[-1].num_chars,
        }
        rest = await post_stream(url, path, {**body, CONTINUATION_FIELD: continuation})
        assert client_text(held, chat) + client_text(rest, chat) == client_text(full, chat), k
        assert finish_reason(rest) == finish_reason(full)
        assert {e["id"] for _, e in rest if e} == {start.id}
        assert {e["created"] for _, e in rest if e} == {start.created}
        rest_usage = [e["usage"] for _, e in rest if e and e.get("usage")][-1]
        assert rest_usage["completion_tokens"] == usage["completion_tokens"]
        assert rest_usage["prompt_tokens"] == usage["prompt_tokens"]
        if chat:  # the client already has the role delta
            assert not any(c["delta"].get("role") for _, e in rest if e for c in e["choices"])
    return full


async def test_greedy_and_seeded_completions_continue_exactly(real_server):
    base = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
    await check_continuations(real_server.url, "/v1/completions", {**base, "temperature": 0})
    # Seeded sampling at temperature 1: the continuation's generator is advanced past the draws made.
    await check_continuations(real_server.url, "/v1/completions", {**base, "temperature": 1.0, "seed": 11})


async def test_seeded_chat_continues_exactly(real_server):
    body = {
        "messages": [{"role": "user", "content": "Name three colours and a fruit."}],
        "max_tokens": 24,
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": 3,
        "frequency_penalty": 0.5,  # counts the generated tokens: they must count on the new pod too
    }
    await check_continuations(real_server.url, "/v1/chat/completions", body)


async def test_a_stop_string_across_the_cut_still_stops(real_server):
    path = "/v1/completions"
    base = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    free = await post_stream(real_server.url, path, {**base, "stream": True})
    tokens = [(p.token_ids, p.num_chars) for anns, _ in free for p in anns if isinstance(p, Progress)]
    text = client_text(free, chat=False)
    # A stop string made of the text of tokens 6..8: on the first pod tokens 6 and 7 are held back as a
    # possible start of it, so cutting after them puts the seam inside the stop string.
    begin, end = tokens[5][1], tokens[8][1]
    stop = text[begin:end]
    assert stop.strip()
    full = await check_continuations(real_server.url, path, {**base, "stop": [stop]}, cuts=(6, 7, 8))
    assert client_text(full, chat=False) == text[:begin] and finish_reason(full) == "stop"


async def test_a_grammar_continues_from_the_generated_tokens(real_server):
    body = {
        "prompt": "Pick one animal:",
        "max_tokens": 20,
        "temperature": 1.0,
        "seed": 5,
        "structured_outputs": {"choice": ["the quick brown fox", "a lazy dog sleeping", "an owl at night"]},
    }
    full = await check_continuations(real_server.url, "/v1/completions", body, cuts=(1, 2, 3))
    assert client_text(full, chat=False) in body["structured_outputs"]["choice"]


async def test_logprobs_continue_with_their_offsets(real_server):
    body = {
        "prompt": "One, two, three,",
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 2,
        "ignore_eos": True,
    }
    full = await check_continuations(real_server.url, "/v1/completions", body, cuts=(4,))
    offsets = [
        o
        for _, e in full
        if e
        for c in e["choices"]
        if c.get("logprobs")
        for o in c["logprobs"]["text_offset"]
    ]
    assert offsets == sorted(offsets) and len(offsets) == 12


@pytest.mark.parametrize(
    ("path", "extra", "why"),
    [
        ("/v1/completions", {"prompt": "Hi", "n": 2}, "several choices"),
        ("/v1/completions", {"prompt": ["Hi", "Hello"]}, "several choices"),
    ],
)
async def test_streams_that_cannot_be_continued_say_why(real_server, path, extra, why):
    events = await post_stream(real_server.url, path, {**extra, "max_tokens": 2, "stream": True})
    start = next(a for anns, _ in events for a in anns if isinstance(a, StreamStart))
    assert not start.resumable and why in start.why_not


def test_tool_calls_and_seeded_speculation_are_not_resumable():
    # The default model's template has no tools; the rule itself is pure.
    seeded = SamplingParams(temperature=1.0, seed=1)
    assert "tool-call" in why_not_resumable(SamplingParams(), 1, tools=True, speculative=False)
    assert "speculative" in why_not_resumable(seeded, 1, tools=False, speculative=True)
    assert (
        why_not_resumable(SamplingParams(temperature=0.0, seed=1), 1, tools=False, speculative=True) is None
    )
    assert why_not_resumable(seeded, 1, tools=False, speculative=False) is None


async def test_a_continuation_past_max_tokens_is_refused(real_server):
    continuation = {"id": "cmpl-x", "created": 1, "prompt_token_ids": [1, 2], "output_token_ids": [5, 6, 7]}
    body = {
        "prompt": "Hi",
        "max_tokens": 3,
        "stream": True,
        CONTINUATION_FIELD: {**continuation, "num_delivered_chars": 0},
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(real_server.url + "/v1/completions", json=body, headers=HEADERS) as r,
    ):
        assert r.status == 400
        assert (await r.json())["error"]["param"] == CONTINUATION_FIELD
