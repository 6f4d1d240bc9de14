"""Prefill/decode disaggregation between two real tensor-parallel pods (TP=2 each: 4 processes, gloo, CPU).

Driven over the pods' own wire, as a router drives it. Checked: the decode pod's greedy output equals, token
for token, an aggregated TP=2 pod's computing the prompt cold (the prefill pod itself, asked with another
cache salt so nothing of its cache serves it); every rank's shard of the prompt's blocks moves (blocks sent
= received > 0, no fallback, the decode pod's prefix hit covers them). Pods of another tensor-parallel
size (a TP=1 pod) refuse the transfer both ways, naming both sizes: the fetch answers 409 and ends the
hold, the decode pod logs it, counts the fallback and recomputes the same answer. Slow: two TP=2 pods
and a TP=1 pod start (5 processes, tiny model).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from tokenfleet.sim.real_pod import wait_ready

from .test_tensor_parallel import checkpoints  # noqa: F401 (the tiny random checkpoints, a fixture)

pytestmark = pytest.mark.slow

TIMEOUT = aiohttp.ClientTimeout(total=120)
PROMPTS = [
    [(13 * i) % 290 + 5 for i in range(45)],  # 5 full blocks of 8 + 5
    [(13 * i) % 290 + 5 for i in range(24)] + [(7 * i) % 250 + 5 for i in range(20)],  # shares 3 blocks
    [(11 * i) % 280 + 7 for i in range(33)],
]


def _spawn(tmp: Path, model_dir: str, port: int, tp: int) -> subprocess.Popen:
    config = tmp / f"pod-{port}.json"
    config.write_text(
        json.dumps(
            {
                "model": {"model": model_dir, "dtype": "float32"},
                "cache": {"block_size": 8, "num_blocks": 64},
                "parallel": {"tensor_parallel_size": tp},
                "server": {"host": "127.0.0.1", "port": port},
            }
        )
    )
    with open(tmp / f"pod-{port}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tokenfleet.runtime.cli", "serve", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp,  # never the repo root: its `operator/` folder would shadow the stdlib module
        )


@pytest.fixture(scope="module")
def pods(tmp_path_factory, checkpoints):  # noqa: F811
    """(prefill url, decode url, one-process url, model name, log folder): two TP=2 pods of the tiny Qwen2
    (2 KV heads: one per rank) and one TP=1 pod of it."""
    import socket

    tmp = tmp_path_factory.mktemp("tp-disagg")
    model_dir = checkpoints["qwen2"]
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    procs = [_spawn(tmp, model_dir, port, tp) for port, tp in zip(ports, (2, 2, 1), strict=True)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:

        async def ready() -> None:
            async with aiohttp.ClientSession() as s:
                await asyncio.gather(*(wait_ready(s, u, p, 300.0) for u, p in zip(urls, procs, strict=True)))

        asyncio.run(ready())
        yield urls[0], urls[1], urls[2], model_dir, tmp
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)


async def _post(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with s.post(url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        out = await r.json()
        assert r.status == 200, out
        return out


async def _metric(s, url: str, name: str, labels: str = "") -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for m in re.finditer(rf"^(?:[a-z_]+:)?{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.e+-]+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


async def _used(s, url: str) -> float:
    async with s.get(url + "/load") as r:
        return (await r.json())["kv_cache_usage"]


def test_tp2_prefill_to_tp2_decode_moves_every_shard_and_matches_an_aggregated_tp2_pod(pods):
    p_url, d_url, _, model, _ = pods

    def body(prompt, max_tokens=8, **extra):
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, **extra}  # fmt: skip

    async def run():
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            for prompt in PROMPTS:
                # The aggregated answer: the whole prompt computed cold (another salt: no cached block).
                plain = await _post(s, p_url, body(prompt, cache_salt="aggregated"))
                params = {"do_remote_decode": True, "hold_seconds": 30}
                first = await _post(s, p_url, body(prompt, max_tokens=1, kv_transfer_params=params))
                done = first["kv_transfer_params"]
                assert len(done["block_hashes"]) == len(prompt) // 8
                out = await _post(
                    s, d_url, body(prompt, kv_transfer_params={"do_remote_prefill": True, **done})
                )
                got, want = out["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
                assert (
                    got["tokens"] == want["tokens"]
                    and out["choices"][0]["text"] == plain["choices"][0]["text"]
                )
                assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
                assert got["tokens"][0] == first["choices"][0]["logprobs"]["tokens"][0]
            wall = time.monotonic() - t0
            sent = await _metric(s, p_url, "tokenfleet:kv_transfer_blocks_total", 'direction="sent"')
            received = await _metric(s, d_url, "tokenfleet:kv_transfer_blocks_total", 'direction="received"')
            fallbacks = await _metric(s, d_url, "tokenfleet:kv_transfer_fallbacks_total")
            hits = await _metric(s, d_url, "prefix_cache_hits_total")  # vLLM's name
            seconds = await _metric(s, d_url, "tokenfleet:kv_transfer_seconds_sum")
            print(
                f"\nTP=2 -> TP=2: {received:.0f} blocks moved, {fallbacks:.0f} fallbacks, identical tokens; "
                f"3 prompts (aggregated + prefill + decode each) in {wall:.2f} s, transfers {seconds:.3f} s"
            )
            # The second prompt's first 3 blocks were already on the decode pod (the first prompt's).
            assert sent == received == 5 + 2 + 4 and fallbacks == 0
            assert hits >= 8 * (5 + 5 + 4)
            assert [await _used(s, u) for u in (p_url, d_url)] == [0.0, 0.0]  # holds released

    asyncio.run(run())


def test_pods_of_another_tensor_parallel_size_refuse_the_transfer_naming_both_and_recompute(pods):
    p_url, d_url, one_url, model, logs = pods
    prompt = [(17 * i) % 280 + 9 for i in range(30)]

    async def run():
        async with aiohttp.ClientSession() as s:
            # A TP=1 prefill pod's blocks offered to the TP=2 decode pod: refused, the prompt is recomputed.
            plain = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            want = await _post(s, one_url, plain)
            params = {"do_remote_decode": True, "hold_seconds": 30}
            done = (await _post(s, one_url, {**plain, "max_tokens": 1, "kv_transfer_params": params}))[
                "kv_transfer_params"
            ]
            reason = 'reason="tp_size_mismatch"'
            before = await _metric(s, d_url, "tokenfleet:kv_transfer_fallbacks_total", reason)
            params = {"do_remote_prefill": True, **done}
            out = await _post(s, d_url, {**plain, "kv_transfer_params": params})
            assert out["choices"][0]["text"] == want["choices"][0]["text"]
            assert await _metric(s, d_url, "tokenfleet:kv_transfer_fallbacks_total", reason) == before + 1
            port = d_url.rsplit(":", 1)[1]
            assert "this prefill pod has 1, the fetching pod 2" in (logs / f"pod-{port}.log").read_text()
            assert await _used(s, one_url) == 0.0  # the refused fetch ended the hold

            # The other way round, asked directly: a TP=2 prefill pod refuses a fetch for one process.
            params = {"do_remote_decode": True, "hold_seconds": 30}
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": params}
            hold = (await _post(s, p_url, body))["kv_transfer_params"]["hold_id"]
            async with s.post(p_url + "/v1/kv/fetch", json={"hold_id": hold, "tp_size": 1}) as r:
                error = (await r.json())["error"]
                assert r.status == 409 and error["code"] == "tp_size_mismatch"
                assert "this prefill pod has 2, the fetching pod 1" in error["message"]
            async with s.post(p_url + "/v1/kv/fetch", json={"hold_id": hold, "tp_size": 2}) as r:
                assert r.status == 404  # the refused fetch ended the hold
            assert await _used(s, p_url) == 0.0

    asyncio.run(run())
