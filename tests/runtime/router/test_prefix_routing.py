"""Cache-aware routing against pods that publish real KV events, verified from the pods' own hit counts."""

from __future__ import annotations

import asyncio

import aiohttp

CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=10)
SYSTEM = {k: " ".join(f"w{k * 100 + i}" for i in range(64)) for k in range(3)}  # 64 tokens = 4 blocks each


def chat(system: int, user: str) -> dict:
    msgs = [{"role": "system", "content": SYSTEM[system]}, {"role": "user", "content": user}]
    return {"model": "m", "messages": msgs, "max_tokens": 2}


async def send(url, body):
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s,
        s.post(url + "/v1/chat/completions", json=body) as r,
    ):
        await r.read()
        return r.status, r.headers["x-tokenfleet-endpoint"], r.headers["x-tokenfleet-route"]


def backends(urls):
    return [{"name": f"p{i}", "model": "m", "url": u} for i, u in enumerate(urls)]


async def test_shared_prefixes_land_on_the_pod_holding_them(serve_app, start_router, make_pod, wait_until):
    pods = [make_pod() for _ in range(3)]
    async with serve_app(pods[0].app()) as u0, serve_app(pods[1].app()) as u1, serve_app(pods[2].app()) as u2:
        urls = [u0, u1, u2]
        async with start_router(backends(urls), {"strategy": "prefix-affinity"}) as (url, router):
            await wait_until(lambda: all(router.fleet.kv_events_live().values()))
            # The first turns arrive together: the router's in-flight counts spread them over the pods.
            for p in pods:
                p.delay = 0.2
            first = await asyncio.gather(*(send(url, chat(k, "w1999")) for k in range(3)))
            home = {k: ep for k, (_, ep, _) in enumerate(first)}
            for p in pods:
                p.delay = 0.0
            for ep in home.values():
                pod = pods[urls.index(ep)]
                # Wait until the router's exact index has the pod's stored events.
                await wait_until(lambda ep=ep, pod=pod: router.fleet.exact.num_blocks(ep) == len(pod.cached))
            assert len(set(home.values())) == 3  # least-loaded spread for new prefixes
            for turn in range(4):
                for k in range(3):
                    status, ep, reason = await send(url, chat(k, f"w{1990 + turn}"))
                    assert (status, ep, reason) == (200, home[k], "prefix_hit")
            # The pods' own counters: every follow-up request reused its system prompt's 4 full blocks.
            assert sum(p.hit_blocks for p in pods) == 3 * 4 * 4
            async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
                text = await r.text()
            assert 'tokenfleet:router_decisions_total{reason="prefix_hit"} 12.0' in text
            assert "tokenfleet:router_prefix_match_blocks_count 15.0" in text
            # Every request was picked once (no retries here), each pick timed.
            assert "tokenfleet:router_pick_seconds_count 15.0" in text
            assert 'tokenfleet:router_pick_seconds_bucket{le="+Inf"} 15.0' in text


async def test_eviction_seen_through_events_stops_the_affinity(serve_app, start_router, make_pod, wait_until):
    pods = [make_pod() for _ in range(2)]
    async with serve_app(pods[0].app()) as u0, serve_app(pods[1].app()) as u1:
        urls = [u0, u1]
        # Affinity unbounded: this is about what the index knows, not about spreading load.
        routing = {"strategy": "prefix-affinity", "balance": {"maxRatio": None}}
        async with start_router(backends(urls), routing) as (url, router):
            await wait_until(lambda: all(router.fleet.kv_events_live().values()))
            _, ep, _ = await send(url, chat(0, "w1"))
            pod = pods[urls.index(ep)]
            await wait_until(lambda: router.fleet.exact.num_blocks(ep) > 0)
            assert (await send(url, chat(0, "w2")))[2] == "prefix_hit"
            pod.evict_all()  # the pod reuses those blocks for something else and says so
            await wait_until(lambda: router.fleet.exact.num_blocks(ep) == 0)
            # An approximate index would still believe the pod holds the prefix; the exact one knows better.
            assert (
                router.fleet.approx.match(
                    router.fleet._prefix_matches(
                        [router.fleet.endpoints.by_id[ep]], _key(router, chat(0, "w3")), "m"
                    )[2][ep],
                    [ep],
                )[ep]
                > 0
            )
            assert (await send(url, chat(0, "w3")))[2] == "load"


def _key(router, body):
    import json

    from tokenfleet.runtime.router.fleet import PromptKey
    from tokenfleet.runtime.router.prompt_blocks import prompt_token_ids

    ids = prompt_token_ids("/v1/chat/completions", json.dumps(body).encode(), router.tokenizers["m"])
    return PromptKey(tuple(ids), "", None)


async def test_without_events_the_approximate_index_keeps_affinity(serve_app, start_router, make_pod):
    pods = [make_pod() for _ in range(3)]
    async with serve_app(pods[0].app()) as u0, serve_app(pods[1].app()) as u1, serve_app(pods[2].app()) as u2:
        urls = [u0, u1, u2]
        routing = {"strategy": "prefix-affinity", "balance": {"maxRatio": None}}
        async with start_router(backends(urls), routing, discovery={"kvEvents": False}) as (url, _):
            _, home, _ = await send(url, chat(1, "w5"))
            for turn in range(3):
                assert (await send(url, chat(1, f"w{turn}")))[1:] == (home, "prefix_hit")
    assert pods[urls.index(home)].hit_blocks == 3 * 4
