"""One quota across two active-active routers on loopback: each charges what the other admitted."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from tokenfleet.runtime.router.app import ROUTER, build_app
from tokenfleet.runtime.router.config import RouterConfig
from tokenfleet.runtime.router.quota_peers import QuotaPeers
from tokenfleet.runtime.router.ratelimit import RateLimiter

from .conftest import free_port, serve
from .test_proxy import backend, completion, post


async def _two_routers(pod_url: str, tokenizer, share: bool):
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    apps = []
    for port in ports:
        cfg = RouterConfig.model_validate(
            {
                "port": port,
                "backends": [backend("a", pod_url)],
                "routing": {"rateLimits": {"requestsPerMinute": 10}},
                "discovery": {"probeIntervalSeconds": 0.05, "healthEvery": 1},
                "apiKeys": ["k1"],
                "peers": {"urls": urls if share else [], "intervalSeconds": 0.05},
            }
        )
        apps.append(build_app(cfg, lambda source: tokenizer))
    return urls, apps


@pytest.mark.parametrize("share", [True, False])
async def test_two_routers_hold_one_quota(serve_app, make_pod, tokenizer, share):
    pod = make_pod()
    async with serve_app(pod.app()) as pod_url:
        urls, apps = await _two_routers(pod_url, tokenizer, share)
        async with (
            serve(apps[0], int(urls[0].rsplit(":", 1)[1])),
            serve(apps[1], int(urls[1].rsplit(":", 1)[1])),
        ):
            for app in apps:
                await app[ROUTER].tokenizers_loaded()
            statuses = []
            for i in range(24):
                status, headers, _ = await post(urls[i % 2], completion(), {"Authorization": "Bearer k1"})
                statuses.append(status)
                assert "x-ratelimit-remaining-requests" in headers  # on 200s and 429s alike
                await asyncio.sleep(0.12)  # a couple of exchange intervals
            if share:
                assert all(app[ROUTER].quota_peers.reads > 0 for app in apps)
    admitted = statuses.count(200)
    # 10 a minute fleet-wide (+1 refilled over the ~3 s); each router alone would admit 10, 20 in all.
    assert (10 <= admitted <= 11) if share else admitted == 20, statuses
    assert set(statuses) == {200, 429}


async def test_only_peers_read_the_usage():
    async with aiohttp.ClientSession() as session:
        peers = QuotaPeers(RateLimiter(RouterConfig().routing.rate_limits), session, 1.0)
        peers.set_urls(["http://10.0.0.7:8080/", "http://10.0.0.8:8080"])
    assert peers.urls == ["http://10.0.0.7:8080", "http://10.0.0.8:8080"]
    assert peers.may_read("10.0.0.8") and peers.may_read("127.0.0.1")
    assert not peers.may_read("10.0.0.9") and not peers.may_read(None)


async def test_a_restarted_peer_is_a_baseline_and_a_dropped_key_counts_again(serve_app):
    from aiohttp import web

    reports = [
        {"router": "r1", "usage": {"d": {"tier": "default", "requests": 5, "tokens": 50}}},
        {"router": "r1", "usage": {"d": {"tier": "default", "requests": 7, "tokens": 80}}},
        {"router": "r1", "usage": {"d": {"tier": "default", "requests": 2, "tokens": 10}}},  # dropped, back
        {"router": "r2", "usage": {"d": {"tier": "default", "requests": 9, "tokens": 99}}},  # restarted
        {"router": "r2", "usage": "garbage"},
    ]

    async def usage(request):
        return web.json_response(reports.pop(0))

    app = web.Application()
    app.router.add_get("/v1/ratelimit/usage", usage)
    charged = []

    class Recorder(RateLimiter):
        def charge_remote(self, digest, tier, requests, tokens, now):
            charged.append((digest, requests, tokens))

    async with serve_app(app) as url, aiohttp.ClientSession() as session:
        peers = QuotaPeers(Recorder(RouterConfig().routing.rate_limits), session, 1.0)
        peers.set_urls([url])
        for _ in range(5):
            await peers.poll_once()
    assert charged == [("d", 2.0, 30.0), ("d", 2.0, 10.0)]
    assert peers.failures == 1
