"""Two router replicas behind one Service route as well as one: every router follows every pod's KV
events, and the pods announce the prefills they schedule, so a prefix sent to a pod by one router
attracts its followers there through the other router too, before the pod has stored it. A router that
(re)starts gets each pod's whole cached set in its first poll: its index is warm at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import aiohttp
import pytest

TIMEOUT = aiohttp.ClientTimeout(total=30)
WEIGHTS = (6, 4, 3, 2, 2, 1)


def tenant_mix(weights: tuple[int, ...]) -> list[int]:
    """Tenants in a fixed interleaving, tenant t appearing weights[t] times."""
    return [t for rnd in range(max(weights)) for t, n in enumerate(weights) if rnd < n]


# Six tenants, uneven (weights 6:4:3:2:2:1).
TENANTS = tenant_mix(WEIGHTS)


def chat(tenant: int, user: str) -> dict:
    system = " ".join(f"w{tenant * 100 + i}" for i in range(96))  # 6+ full blocks per tenant
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
    }


async def _run(
    router_urls: list[str], rounds: int = 3, spacing: float = 0.1, tenants: list[int] = TENANTS
) -> None:
    """Send the tenant mix `rounds` times, alternating over the routers, a request every `spacing` s (far
    less than a prefill takes, so the pods' stored blocks always lag behind the routing; far more than a
    loopback event poll takes, so what is announced is known before the next request)."""
    urls = itertools.cycle(router_urls)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:

        async def one(url: str, body: dict) -> None:
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()

        tasks = []
        for k in range(rounds):
            for i, tenant in enumerate(tenants):
                tasks.append(asyncio.create_task(one(next(urls), chat(tenant, f"w{1000 + k * 100 + i}"))))
                await asyncio.sleep(spacing)
        await asyncio.gather(*tasks)


async def _hit_rate(
    serve_app,
    start_router,
    make_pod,
    wait_until,
    num_routers: int,
    announce: bool,
    tenants: list[int] = TENANTS,
) -> float:
    pods = [make_pod() for _ in range(3)]
    for p in pods:
        p.prefill_seconds, p.announce_prefills = 0.8, announce
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve_app(p.app())) for p in pods]
        backends = [{"name": f"p{i}", "model": "m", "url": u} for i, u in enumerate(urls)]
        routers = [await stack.enter_async_context(start_router(backends)) for _ in range(num_routers)]
        for _, r in routers:
            await wait_until(lambda r=r: all(r.fleet.kv_events_live().values()))
        await _run([url for url, _ in routers], tenants=tenants)
    return sum(p.hit_blocks for p in pods) / sum(p.query_blocks for p in pods)


@pytest.mark.slow
async def test_two_routers_hit_the_cache_as_well_as_one(serve_app, start_router, make_pod, wait_until):
    one = await _hit_rate(serve_app, start_router, make_pod, wait_until, 1, announce=True)
    two = await _hit_rate(serve_app, start_router, make_pod, wait_until, 2, announce=True)
    assert one > 0.6, one
    assert two >= one - 0.02, (one, two)


@pytest.mark.slow
async def test_without_announced_prefills_two_routers_lose_hits(
    serve_app, start_router, make_pod, wait_until
):
    """The control: the same run, pods that store blocks only after the prefill and announce nothing.

    Without announcements a router that has not seen a tenant yet still picks the pod the other one
    picked whenever their load views agree (ties go by the prompt's hash), so the loss depends on how the
    probes and requests interleave: with six tenants it lost 2 to 13 points, once 1.8 on a loaded machine.
    Twice the tenants (the mix twice) gives twice the first-round decisions that can go apart: it lost
    10 to 13 points in four runs.
    """
    tenants = tenant_mix(WEIGHTS * 2)
    announced = await _hit_rate(serve_app, start_router, make_pod, wait_until, 2, True, tenants)
    silent = await _hit_rate(serve_app, start_router, make_pod, wait_until, 2, False, tenants)
    assert silent < announced - 0.02, (announced, silent)


async def test_a_restarted_router_is_warm_within_a_second(serve_app, start_router, make_pod, wait_until):
    pods = [make_pod() for _ in range(3)]
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve_app(p.app())) for p in pods]
        backends = [{"name": f"p{i}", "model": "m", "url": u} for i, u in enumerate(urls)]
        first_url, first = await stack.enter_async_context(start_router(backends))
        await wait_until(lambda: all(first.fleet.kv_events_live().values()))
        await _run([first_url], rounds=1)
        held = {u: len(p.cached) for u, p in zip(urls, pods, strict=True)}
        assert sum(held.values()) > 0
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with start_router(backends, wait_ready=False) as (_, second):
            await wait_until(lambda: all(second.fleet.exact.num_blocks(u) == n for u, n in held.items()), 1.0)
            assert loop.time() - started < 1.0
