"""A deployment as it really runs, on loopback: models that are NOT built in, keys on, two routers.

Two real `tokenfleet serve` processes — a tiny random Llama as an HF directory and the same weights as a
GGUF file — each with client keys and the deployment's internal key; two routers (active-active) holding
the internal key and no local tokenizer at all, so exact routing works only if they learn the tokenizers
from the pods. Checked: both routers get both tokenizers from the pods; a request through one router is
announced (`scheduled`) and stored on the pod, and the other router, which never routed that prefix,
matches it in its exact index and routes the follow-up as a prefix hit the pod confirms (cached tokens);
a third router without the internal key says clearly that the pods refuse it. And a disaggregated model
(a third pod decoding what the HF pod prefilled): the decode pod fetches the KV from the prefill pod with
the internal key the router gave it.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web
from tokenfleet.runtime.router.app import ROUTER, build_app
from tokenfleet.runtime.router.config import RouterConfig
from tokenfleet.runtime.router.prompt_blocks import prompt_token_ids, token_block_hashes
from tokenfleet.sim.real_pod import wait_ready

from ..tiny_checkpoints import write_gguf, write_hf_dir
from .conftest import free_port, serve, until

pytestmark = pytest.mark.slow

CLIENT = "client-key"
INTERNAL = "internal-key"
SYSTEM = "You are a terse assistant. " + " ".join(f"Rule {i}: answer in one word." for i in range(12))


@pytest.fixture(scope="module")
def pods(tmp_path_factory, default_model_path):
    tmp = tmp_path_factory.mktemp("keyed-pods")
    hf = write_hf_dir(tmp / "tiny-hf", default_model_path)
    gguf = write_gguf(tmp / "tiny.gguf", hf, default_model_path)
    (tmp / "internal").write_text(INTERNAL + "\n")
    procs, urls = {}, {}
    for name, model, served in (
        ("tiny-hf", hf, "tiny-hf"),
        ("tiny-gguf", gguf, "tiny-gguf"),
        ("decode", hf, "tiny-hf"),
    ):
        port = free_port()
        cfg = {
            "model": {"model": str(model), "served_name": served, "max_model_len": 1024},
            "cache": {"num_blocks": 128},
            "server": {
                "host": "127.0.0.1",
                "port": port,
                "api_keys": [CLIENT],
                "internal_api_key_file": str(tmp / "internal"),
            },
        }
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        with open(tmp / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tokenfleet.runtime.cli", "serve", "--config", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp,
            )
        urls[name] = f"http://127.0.0.1:{port}"
    try:

        async def ready() -> None:
            async with aiohttp.ClientSession() as s:
                await asyncio.gather(*(wait_ready(s, urls[n], procs[n], 300.0) for n in urls))

        asyncio.run(ready())
        decode = urls.pop("decode")
        yield urls, tmp / "internal", decode
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=30)


def router_app(urls: dict[str, str], key_file: Path | None) -> web.Application:
    backend = {} if key_file is None else {"internalKeyFile": str(key_file)}
    cfg = RouterConfig.model_validate(
        {
            "apiKeys": [CLIENT],
            "backends": [{"name": n, "model": n, "url": u, **backend} for n, u in urls.items()],
            "routing": {"strategy": "prefix-affinity"},
            "discovery": {"probeIntervalSeconds": 0.2},
        }
    )
    return build_app(cfg, tokenizer_loader=None)  # no local tokenizers: only what the pods serve


def chat(model: str, user: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0}


async def send(url: str, body: dict) -> tuple[int, str | None, int]:
    headers = {"Authorization": f"Bearer {CLIENT}"}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s,
        s.post(url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        data = await r.json()
        cached = ((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return r.status, r.headers.get("x-tokenfleet-route"), cached


def exact_hashes(router, model: str, pod_url: str, body: dict) -> list[bytes]:
    """The prompt's block hashes as the router computes them with the tokenizer it fetched."""
    tok = router.tokenizers[model]
    pos = router.fleet._followers[pod_url].position
    ids = prompt_token_ids("/v1/chat/completions", json.dumps(body).encode(), tok)
    return token_block_hashes(ids, pos.block_size, pos.hash_extra, None)


async def test_keys_on_and_exact_routing_for_models_that_are_not_built_in(pods):
    urls, key_file, _ = pods
    app_a, app_b, app_c = router_app(urls, key_file), router_app(urls, key_file), router_app(urls, None)
    async with serve(app_a) as url_a, serve(app_b) as url_b, serve(app_c) as _:
        a, b, c = app_a[ROUTER], app_b[ROUTER], app_c[ROUTER]
        for r in (a, b):
            await until(lambda r=r: all(s["state"] == "ok" for s in r.tokenizer_states().values()), 60)
            await until(
                lambda r=r: len(r.fleet.kv_events_live()) == 2 and all(r.fleet.kv_events_live().values()), 30
            )
            assert {s["source"] for s in r.tokenizer_states().values()} == {"pods"}
        # The HF directory and the GGUF file carry the same tokenizer: one digest, as the pods' /load says.
        assert len({s["digest"] for s in a.tokenizer_states().values()}) == 1
        async with aiohttp.ClientSession() as s:
            for name, pod_url in urls.items():
                async with s.get(pod_url + "/load") as r:  # open: no key
                    load = await r.json()
                assert load["tokenizer_digest"] == a.tokenizer_states()[name]["digest"]
                assert load["access"]["/v1/tokenizer"]["needs"] == "internal_key"
                client = {"Authorization": f"Bearer {CLIENT}"}
                async with s.get(pod_url + "/v1/tokenizer", headers=client) as r:
                    assert r.status == 401  # a tenant's key does not open router endpoints

        for model, pod_url in urls.items():
            first = chat(model, "Say one.")
            assert (await send(url_a, first))[0] == 200
            hashes = exact_hashes(b, model, pod_url, first)
            assert len(hashes) >= 4
            # Router B never routed this prompt: it knows from the pod's own events.
            await until(lambda h=hashes, p=pod_url: b.fleet.scheduled.match(h, [p])[p] == len(h), 10)
            await until(lambda h=hashes, p=pod_url: b.fleet.exact.match(h, [p])[p] == len(h), 10)
            status, route, cached = await send(url_b, chat(model, "Say two."))
            assert (status, route) == (200, "prefix_hit")
            assert cached >= 16 * (len(hashes) - 1)  # the pod confirms: the shared prefix was reused

        # A router without the internal key: every pod refuses it, and it says so.
        await until(lambda: all(c.pod_auth.unauthorized(u) for u in urls.values()), 10)
        await until(lambda: all(s["state"] == "error" for s in c.tokenizer_states().values()), 10)
        assert all("401" in s["reason"] for s in c.tokenizer_states().values())
        refused = {(r["endpoint"], r["path"]) for r in c.pod_auth.state()["unauthorized"]}
        assert all((u, "/v1/kv-events") in refused for u in urls.values())


async def _metric(url: str, name: str, labels: str = "") -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(m.group(2))
        for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.e+-]+)$", text, re.M)
        if labels in (m.group(1) or "")
    )


async def test_disaggregation_hand_off_carries_the_internal_key(pods):
    urls, key_file, decode_url = pods
    cfg = RouterConfig.model_validate(
        {
            "apiKeys": [CLIENT],
            "backends": [
                {"name": "p", "model": "tiny-hf", "url": urls["tiny-hf"], "role": "prefill",
                 "internalKeyFile": str(key_file)},
                {"name": "d", "model": "tiny-hf", "url": decode_url, "role": "decode",
                 "internalKeyFile": str(key_file)},
            ],
            "discovery": {"probeIntervalSeconds": 0.2},
        }
    )  # fmt: skip
    app = build_app(cfg, tokenizer_loader=None)
    async with serve(app) as url:
        router = app[ROUTER]
        await until(lambda: router.fleet.in_rotation(2), 30)
        received = 'direction="received"'
        before = await _metric(decode_url, "tokenfleet:kv_transfer_blocks_total", received)
        status, _, _ = await send(url, chat("tiny-hf", "Say three."))
        assert status == 200
        # The KV came over (/v1/kv/fetch takes only the internal key): nothing recomputed, no fallback.
        assert await _metric(decode_url, "tokenfleet:kv_transfer_blocks_total", received) > before
        assert await _metric(decode_url, "tokenfleet:kv_transfer_fallbacks_total") == 0
        assert router.pod_auth.state()["unauthorized"] == []
