"""Protocol-level behaviour of the server over a fake engine: shapes, SSE, n, logprobs, ids, metrics."""

from __future__ import annotations

import json

from tokenfleet.runtime.server.app import STATE_KEY


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    return [block[len("data: ") :] for block in raw.strip().split("\n\n")]


async def test_completion_returns_text_usage_and_echoes_request_id(client):
    resp = await client.post(
        "/v1/completions", json={"prompt": "abc", "max_tokens": 5}, headers={"x-request-id": "req-42"}
    )
    assert resp.status == 200
    assert resp.headers["x-request-id"] == "req-42"
    body = await resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "abcab", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == 8


async def test_every_response_gets_a_request_id(client):
    resp = await client.get("/nope")
    assert resp.status == 404
    assert len(resp.headers["x-request-id"]) == 32
    assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_chat_stream_is_openai_sse_with_usage_chunk(client, fake_engine):
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    prompt = fake_engine.tokenizer.decode(fake_engine.submitted[0][1])
    assert prompt == "<user>hi\n<assistant>"
    assert text == prompt[:3]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["prompt_tokens"] == len(prompt)


async def test_n_choices_get_distinct_seeds_and_are_merged(client, fake_engine):
    resp = await client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 2, "n": 3, "seed": 7})
    body = await resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [p.seed for _, _, p in fake_engine.submitted] == [7, 8, 9]
    assert all(p.n == 1 for _, _, p in fake_engine.submitted)
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 6,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_n_choices_stream_carries_every_index(client):
    resp = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "q"}], "max_tokens": 2, "n": 2, "stream": True},
    )
    chunks = [json.loads(e) for e in sse_events(await resp.text())[:-1]]
    finished = {c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"] == "length"}
    assert finished == {0, 1}


async def test_batched_prompts_count_each_prompt_once(client):
    resp = await client.post("/v1/completions", json={"prompt": ["ab", "ABC"], "max_tokens": 1, "n": 2})
    body = await resp.json()
    assert [c["text"] for c in body["choices"]] == ["a", "a", "A", "A"]
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 4
    resp = await client.post("/v1/completions", json={"prompt": [[72, 73], [74]], "max_tokens": 1})
    assert [c["text"] for c in (await resp.json())["choices"]] == ["H", "J"]


async def test_completion_logprobs_legacy_shape(client):
    resp = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "logprobs": 1})
    choice = (await resp.json())["choices"][0]
    assert choice["text"] == "ab"
    assert choice["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.25, -0.25],
        "top_logprobs": [{"a": -0.25, "?": -2.0}, {"b": -0.25, "?": -2.0}],
        "text_offset": [0, 1],
    }
    resp = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "echo": True})
    assert (await resp.json())["choices"][0]["text"] == "abab"


async def test_chat_logprobs_shape(client, fake_engine):
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "z"}],
            "max_tokens": 1,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    content = (await resp.json())["choices"][0]["logprobs"]["content"]
    assert fake_engine.submitted[0][2].logprobs == 2
    assert content == [
        {
            "token": "<",
            "logprob": -0.25,
            "bytes": [60],
            "top_logprobs": [
                {"token": "<", "logprob": -0.25, "bytes": [60]},
                {"token": "?", "logprob": -2.0, "bytes": [63]},
            ],
        }
    ]


async def test_models_version_ready_and_health(client):
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "smollm2-135m-instruct"
    assert models["data"][0]["max_model_len"] == 64
    assert (await client.get("/version")).status == 200
    assert (await client.get("/ready")).status == 200
    assert (await (await client.get("/health")).json()) == {"status": "ok"}


async def test_not_ready_until_engine_then_draining(make_client, fake_engine):
    client = await make_client(None)
    assert (await client.get("/ready")).status == 503
    assert (await client.get("/health")).status == 200  # alive while loading: liveness must not kill us
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "not_ready"
    state = client.server.app[STATE_KEY]
    state.engine = fake_engine
    assert (await client.get("/ready")).status == 200
    state.draining = True
    assert (await client.get("/ready")).status == 503
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "draining"


async def test_health_fails_when_engine_is_dead(client, fake_engine):
    fake_engine.dead = "engine loop died: boom"
    resp = await client.get("/health")
    assert resp.status == 503
    assert "boom" in (await resp.json())["reason"]
    assert (await client.get("/ready")).status == 503
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "engine_dead"


async def test_metrics_expose_engine_stats_and_latency_histograms(client):
    await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
    text = await (await client.get("/metrics")).text()
    label = 'model_name="smollm2-135m-instruct"'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"tokenfleet:{name}{{{label}}} 0.0" in text
    for name in (
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
    ):
        assert f"tokenfleet:{name}{{{label}}}" in text
    assert f"tokenfleet:time_to_first_token_seconds_count{{{label}}} 1.0" in text
    assert f"tokenfleet:e2e_request_latency_seconds_count{{{label}}} 1.0" in text
    assert f"tokenfleet:request_queue_time_seconds_count{{{label}}} 1.0" in text
    assert f"tokenfleet:request_prefill_time_seconds_count{{{label}}} 1.0" in text
    assert f"tokenfleet:request_decode_time_seconds_count{{{label}}} 1.0" in text
    assert f"tokenfleet:inter_token_latency_seconds_count{{{label}}} 2.0" in text
    assert f'tokenfleet:request_success_total{{finished_reason="length",{label}}} 1.0' in text


async def test_kv_events_and_load_wait_for_the_engine(client):
    for path in ("/v1/kv-events", "/load"):
        resp = await client.get(path)
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "not_ready"


async def test_priority_from_the_body_wins_over_the_routers_header(client, fake_engine):
    headers = {"x-tokenfleet-priority": "5"}
    body = {"model": "smollm2-135m-instruct", "prompt": "ab", "max_tokens": 1}
    assert (await client.post("/v1/completions", json=body, headers=headers)).status == 200
    assert (
        await client.post("/v1/completions", json={**body, "priority": -1}, headers=headers)
    ).status == 200
    bad = {"x-tokenfleet-priority": "high"}
    assert (await client.post("/v1/completions", json=body, headers=bad)).status == 200
    assert list(fake_engine.priorities.values()) == [5, -1, 0]


async def test_metrics_expose_spec_decode_and_cache_tier_counters(client, fake_engine):
    from tokenfleet.runtime.engine.kv_cache.cache_metrics import KVCacheMetrics
    from tokenfleet.runtime.engine.outputs import EngineStats

    kv = KVCacheMetrics(
        device_hit_blocks=7, host_hit_blocks=3, miss_blocks=2, evicted_ttl_blocks=4, evicted_pressure_blocks=5,
        pinned_blocks=6, offloaded_blocks=8, loaded_blocks=3, host_evicted_blocks=1, host_used_blocks=9,
        host_total_blocks=64,
    )  # fmt: skip
    fake_engine.stats = lambda: EngineStats(
        spec_decode_num_drafts=2,
        spec_decode_num_draft_tokens=8,
        spec_decode_num_accepted_tokens=5,
        kv_metrics=kv,
    )
    text = await (await client.get("/metrics")).text()
    label = 'model_name="smollm2-135m-instruct"'
    assert f"tokenfleet:spec_decode_num_draft_tokens_total{{{label}}} 8.0" in text
    assert f"tokenfleet:spec_decode_num_accepted_tokens_total{{{label}}} 5.0" in text
    assert f'tokenfleet:kv_cache_lookup_blocks_total{{{label},tier="host"}} 3.0' in text
    assert f'tokenfleet:kv_cache_evicted_blocks_total{{{label},reason="ttl"}} 4.0' in text
    assert f"tokenfleet:kv_cache_pinned_blocks{{{label}}} 6.0" in text
    assert f"tokenfleet:kv_offload_total_blocks{{{label}}} 64.0" in text
