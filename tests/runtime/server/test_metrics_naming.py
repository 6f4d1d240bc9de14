"""/metrics in both namings, read by Prometheus' own text parser, on the real engine under load.

An endpoint picker or a KEDA rule written for vLLM must find vLLM's names, types, units and labels; ours
stay the default. With one running slot and four concurrent requests, three must show up as waiting while
the first decodes, and the KV-cache utilisation must be a fraction.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

BODY = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
NUM_REQUESTS = 4


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(family, sample_name: str | None = None, **labels: str) -> float:
    for s in family.samples:
        if (sample_name is None or s.name == sample_name) and labels.items() <= s.labels.items():
            return s.value
    raise AssertionError(f"no sample {sample_name or family.name} with {labels} in {family.samples}")


async def _scrape(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200
        return _families(await resp.text())


async def _under_load(url: str) -> tuple[list[dict], dict]:
    """Scrape every 50 ms while NUM_REQUESTS requests run; the samples seen, and the scrape after."""
    seen: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one() -> int:
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                await resp.read()
                return resp.status

        requests = asyncio.gather(*(one() for _ in range(NUM_REQUESTS)))
        while not requests.done():
            seen.append(await _scrape(session, url))
            await asyncio.sleep(0.05)
        assert await asyncio.wait_for(requests, 120) == [200] * NUM_REQUESTS
        return seen, await _scrape(session, url)


# (naming, prefix, labels every vLLM-defined metric carries)
MODES = [
    ("tokenfleet", "tokenfleet:", {"model_name": "smollm2-135m-instruct"}),
    ("vllm", "vllm:", {"model_name": "smollm2-135m-instruct", "engine": "0"}),
]


@pytest.mark.parametrize(("naming", "prefix", "labels"), MODES)
async def test_metrics_in_both_namings_move_under_load(start_real_server, naming, prefix, labels):
    server = start_real_server(metrics={"naming": naming}, scheduler={"max_num_seqs": 1})
    seen, after = await _under_load(server.url)

    # Names and types as vLLM defines them (the parser strips `_total` from counter family names).
    types = {
        "num_requests_running": "gauge",
        "num_requests_waiting": "gauge",
        "kv_cache_usage_perc": "gauge",
        "cache_config_info": "gauge",
        "prompt_tokens": "counter",
        "generation_tokens": "counter",
        "request_success": "counter",
        "num_preemptions": "counter",
        "prefix_cache_queries": "counter",
        "time_to_first_token_seconds": "histogram",
        "inter_token_latency_seconds": "histogram",
        "e2e_request_latency_seconds": "histogram",
        "request_queue_time_seconds": "histogram",
        "request_prefill_time_seconds": "histogram",
        "request_decode_time_seconds": "histogram",
    }
    for base, kind in types.items():
        family = after[prefix + base]
        assert family.type == kind, base
    other = "vllm:" if prefix == "tokenfleet:" else None
    if other is not None:
        assert not any(name.startswith(other) for name in after), "vllm: names must be opt-in"
    # Metrics vLLM has no counterpart for keep our names in both modes.
    assert after["tokenfleet:num_kv_blocks_total"].type == "gauge"
    # The step clock runs on the CPU: model seconds, and gaps between the steps of a busy engine (requests
    # queue behind one slot, so the engine never idles between them until the last one ends).
    steps = _value(after["tokenfleet:engine_steps"])
    gaps = _value(after["tokenfleet:engine_host_gaps"])
    assert 0 < gaps < steps and after["tokenfleet:engine_host_gaps"].type == "counter"
    assert _value(after["tokenfleet:engine_model_seconds"]) > 0
    assert 0 < _value(after["tokenfleet:engine_host_gap_seconds"]) < 120

    # Label sets: model_name everywhere, plus vLLM's engine index in its naming.
    for base in ("num_requests_waiting", "kv_cache_usage_perc", "generation_tokens"):
        (sample,) = after[prefix + base].samples
        assert sample.labels == labels, base
    assert {s.labels["finished_reason"] for s in after[prefix + "request_success"].samples} == {"length"}

    # Units: seconds histograms; tokens counted; all requests finished with 12 tokens each.
    assert _value(after[prefix + "generation_tokens"]) >= NUM_REQUESTS * BODY["max_tokens"]
    ttft = after[prefix + "time_to_first_token_seconds"]
    assert _value(ttft, prefix + "time_to_first_token_seconds_count") >= NUM_REQUESTS
    assert 0 < _value(ttft, prefix + "time_to_first_token_seconds_sum") < 120  # seconds, not ms
    assert _value(
        after[prefix + "inter_token_latency_seconds"], prefix + "inter_token_latency_seconds_count"
    ) >= (NUM_REQUESTS * (BODY["max_tokens"] - 1))
    # The queue under one running slot shows up in the queue-time histogram too.
    queue = after[prefix + "request_queue_time_seconds"]
    assert _value(queue, prefix + "request_queue_time_seconds_sum") > 0
    # The phases split each request's latency: queue + prefill = TTFT, TTFT + decode = E2E, so their sums
    # add up too (the same timestamps, subtracted).
    sums = {
        base: _value(after[prefix + base], prefix + base + "_sum")
        for base in (
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "time_to_first_token_seconds",
            "e2e_request_latency_seconds",
        )
    }
    assert sums["request_prefill_time_seconds"] > 0 and sums["request_decode_time_seconds"] > 0
    ttft, e2e = sums["time_to_first_token_seconds"], sums["e2e_request_latency_seconds"]
    assert abs(sums["request_queue_time_seconds"] + sums["request_prefill_time_seconds"] - ttft) < 1e-6
    assert abs(ttft + sums["request_decode_time_seconds"] - e2e) < 1e-6

    # The cache facts an endpoint picker reads: block size and capacity in blocks.
    (info,) = after[prefix + "cache_config_info"].samples
    assert info.value == 1.0
    assert info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) == 256
    assert info.labels["enable_prefix_caching"] == "True"
    if naming == "vllm":
        assert info.labels["engine"] == "0" and "model_name" not in info.labels

    # Values move under load: requests queued behind the one running slot; usage is a fraction.
    waiting = [
        _value(s[prefix + "num_requests_waiting"]) for s in seen if prefix + "num_requests_waiting" in s
    ]
    running = [
        _value(s[prefix + "num_requests_running"]) for s in seen if prefix + "num_requests_running" in s
    ]
    usage = [_value(s[prefix + "kv_cache_usage_perc"]) for s in seen if prefix + "kv_cache_usage_perc" in s]
    assert max(waiting) >= 1 and max(running) == 1
    assert all(0.0 <= u <= 1.0 for u in usage) and max(usage) > 0
    assert _value(after[prefix + "num_requests_waiting"]) == 0
    assert _value(after[prefix + "num_requests_running"]) == 0
