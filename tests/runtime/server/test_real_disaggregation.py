"""Prefill/decode disaggregation between two real `tokenfleet serve` processes with the default model.

Driven over the pods' own wire, exactly as a router drives it: the prefill pod answers a `max_tokens: 1`
request with its held blocks; the decode pod fetches the ones it lacks and runs the whole request. Checked:
greedy output token-identical to a plain pod (also when the decode pod already holds part of the prompt);
the transfer lands as a prefix hit (blocks received, counted); unknown and expired holds are 404; client
disconnects in either phase leave both pods with 0 used KV blocks; a dead prefill pod costs a recompute,
not a wrong answer. Slow: two model loads.
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time

import aiohttp
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TIMEOUT = aiohttp.ClientTimeout(total=300)
SHARED = "You are a careful assistant for a library. " + " ".join(
    f"Rule {i}: cite the shelf and the year of every book you name." for i in range(8)
)
PROMPTS = [
    SHARED + " Question: which books about rivers do you hold?",
    SHARED + " Question: when does the reading room open on Sundays?",
    "Write a short poem about the sea, the wind and a lighthouse keeper who counts the ships at night. " * 3,
]


@pytest.fixture(scope="module")
def pods(tmp_path_factory, real_pods):
    """(prefill url, its process), (decode url, its process)."""
    with real_pods(tmp_path_factory.mktemp("disagg"), 2, num_blocks=128, timeout=400.0) as running:
        yield running


def _body(prompt: str, max_tokens: int = 12, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


async def _post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with s.post(url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        return r.status, await r.json()


async def _prefill(s, prefill_url: str, prompt: str, hold_seconds: float = 30.0) -> dict:
    params = {"do_remote_decode": True, "hold_seconds": hold_seconds}
    status, out = await _post(s, prefill_url, _body(prompt, max_tokens=1, kv_transfer_params=params))
    assert status == 200, out
    return out


async def _decode(s, decode_url: str, prompt: str, done: dict, max_tokens: int = 12) -> dict:
    params = {"do_remote_prefill": True, **done}
    status, out = await _post(s, decode_url, _body(prompt, max_tokens, kv_transfer_params=params))
    assert status == 200, out
    return out


async def _metric(s, url: str, name: str, labels: str = "") -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.e+-]+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


async def _used(s, url: str) -> float:
    async with s.get(url + "/load") as r:
        return (await r.json())["kv_cache_usage"]


async def _until_idle(s, urls, timeout: float = 30.0) -> list[float]:
    deadline = time.monotonic() + timeout
    while True:
        used = [await _used(s, u) for u in urls]
        if not any(used) or time.monotonic() > deadline:
            return used
        await asyncio.sleep(0.2)


def test_disaggregated_greedy_output_equals_a_plain_pod_and_moves_the_prompt_kv(pods):
    (p_url, _), (d_url, _) = pods

    async def run():
        async with aiohttp.ClientSession() as s:
            # The decode pod already holds the shared system prompt's first blocks: only the rest moves.
            await _post(s, d_url, _body(SHARED, max_tokens=1))
            received0 = await _metric(s, d_url, "tokenfleet:kv_transfer_blocks_total", 'direction="received"')
            for prompt in PROMPTS:
                first = await _prefill(s, p_url, prompt)
                done = first["kv_transfer_params"]
                assert len(done["block_hashes"]) >= 3
                out = await _decode(s, d_url, prompt, done)
                status, plain = await _post(s, p_url, _body(prompt))
                assert status == 200
                assert out["choices"][0]["text"] == plain["choices"][0]["text"]
                assert out["choices"][0]["text"].startswith(first["choices"][0]["text"])
            received = await _metric(s, d_url, "tokenfleet:kv_transfer_blocks_total", 'direction="received"')
            sent = await _metric(s, p_url, "tokenfleet:kv_transfer_blocks_total", 'direction="sent"')
            assert received - received0 == sent > 0
            assert await _metric(s, d_url, "tokenfleet:kv_transfer_fallbacks_total") == 0
            # Fetched holds are released: no block stays used on either pod.
            assert await _until_idle(s, [p_url, d_url]) == [0.0, 0.0]

    asyncio.run(run())


def test_unknown_fetched_and_expired_holds_are_404_and_release_their_blocks(pods):
    (p_url, _), (d_url, _) = pods

    async def run():
        async with aiohttp.ClientSession() as s:
            async with s.post(p_url + "/v1/kv/fetch", json={"hold_id": "nope"}) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
            first = await _prefill(s, p_url, PROMPTS[2] + " Once more.", hold_seconds=1.0)
            assert await _used(s, p_url) > 0  # held
            assert await _until_idle(s, [p_url], timeout=10) == [0.0]  # expired by the pod's sweeper
            hold_id = first["kv_transfer_params"]["hold_id"]
            async with s.post(p_url + "/v1/kv/fetch", json={"hold_id": hold_id}) as r:
                assert r.status == 404
            async with s.delete(p_url + f"/v1/kv/holds/{hold_id}") as r:
                assert r.status == 404
            assert await _metric(s, p_url, "tokenfleet:kv_holds_expired_total") >= 1
            # The decode pod falls back to recomputing for an expired hold, with the right answer.
            before = await _metric(s, d_url, "tokenfleet:kv_transfer_fallbacks_total", 'reason="http_404"')
            out = await _decode(s, d_url, PROMPTS[2] + " Once more.", first["kv_transfer_params"])
            _, plain = await _post(s, p_url, _body(PROMPTS[2] + " Once more."))
            assert out["choices"][0]["text"] == plain["choices"][0]["text"]
            after = await _metric(s, d_url, "tokenfleet:kv_transfer_fallbacks_total", 'reason="http_404"')
            assert after == before + 1

    asyncio.run(run())


NUM_DISCONNECTS = 100  # half of them cut during the prefill, half during the decode


def test_client_disconnects_in_either_phase_leave_no_used_kv_blocks(pods):
    (p_url, _), (d_url, _) = pods
    rng = random.Random(7)

    cut_in: dict[str, int] = {"prefill": 0, "decode": 0, "none": 0}
    slots = asyncio.Semaphore(4)  # four clients at a time: 2 loaded cores

    async def one(s, i: int) -> None:
        prompt = f"Request {i}: " + PROMPTS[i % 3]
        phase = "prefill"
        async with slots:
            try:
                # Even requests hang up early (during the prefill), odd ones at a random point of the decode.
                cut = rng.uniform(0.01, 0.2) if i % 2 == 0 else None
                first = await asyncio.wait_for(_prefill(s, p_url, prompt, hold_seconds=3.0), timeout=cut)
                phase = "decode"
                decode = _decode(s, d_url, prompt, first["kv_transfer_params"], max_tokens=24)
                await asyncio.wait_for(decode, timeout=rng.uniform(0.01, 1.5))
                phase = "none"
            except TimeoutError:
                pass
        cut_in[phase] += 1

    async def run():
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*(one(s, i) for i in range(NUM_DISCONNECTS)))
            assert cut_in["prefill"] and cut_in["decode"], cut_in  # both phases were interrupted
            # Aborted requests free at once; unfetched holds at their deadline (3 s).
            assert await _until_idle(s, [p_url, d_url], timeout=30) == [0.0, 0.0]

    asyncio.run(run())


def test_prefill_pod_killed_between_prefill_and_transfer_still_gives_the_right_completion(pods):
    (p_url, p_proc), (d_url, _) = pods
    prompt = "Explain in two sentences why the sky looks blue at noon and red at sunset. " * 2

    async def run():
        async with aiohttp.ClientSession() as s:
            _, plain = await _post(s, d_url, _body(prompt))
            first = await _prefill(s, p_url, prompt)
            p_proc.send_signal(signal.SIGKILL)
            p_proc.wait(timeout=30)
            # A fresh decode pod cache would not matter: the decode pod must recompute what it lacks.
            before = await _metric(s, d_url, "tokenfleet:kv_transfer_fallbacks_total", 'reason="unreachable"')
            out = await _decode(s, d_url, prompt + " ", first["kv_transfer_params"])
            _, plain2 = await _post(s, d_url, _body(prompt + " "))
            assert out["choices"][0]["text"] == plain2["choices"][0]["text"]
            assert plain["choices"][0]["text"]  # the plain pod answered too
            after = await _metric(s, d_url, "tokenfleet:kv_transfer_fallbacks_total", 'reason="unreachable"')
            assert after == before + 1
            assert await _until_idle(s, [d_url]) == [0.0]

    asyncio.run(run())
