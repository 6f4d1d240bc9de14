"""A RoutingPolicy edit reaches a running router through its mounted config file, without a restart.

The kubelet swaps the ConfigMap's `..data` symlink; the router notices, applies the live fields (strategy,
weights, classes, backends, keys, generation) and keeps its endpoints, prefix index and in-flight streams;
restart-only fields are reported at `/v1/config`, not applied. API keys from a mounted Secret rotate live.
"""

from __future__ import annotations

import asyncio

import aiohttp
import yaml

TIMEOUT = aiohttp.ClientTimeout(total=10)


def router_file(backends, generation, port=0, **routing) -> str:
    return yaml.safe_dump(
        {
            "port": port,
            "generation": generation,
            "backends": backends,
            "routing": routing,
            "discovery": {"probeIntervalSeconds": 0.05, "healthEvery": 1},
        }
    )


def chat(system: int, user: str) -> dict:
    system_text = " ".join(f"w{system * 100 + i}" for i in range(64))
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system_text}, {"role": "user", "content": user}],
        "max_tokens": 3,
    }


async def send(s: aiohttp.ClientSession, url: str, body: dict, headers=None):
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
        await r.read()
        return r.status, r.headers.get("x-tokenfleet-endpoint"), r.headers.get("x-tokenfleet-route")


async def get_config(s: aiohttp.ClientSession, url: str, headers=None) -> dict:
    async with s.get(url + "/v1/config", headers=headers or {}) as r:
        assert r.status == 200
        return await r.json()


async def test_policy_edit_applies_live_and_keeps_index_and_streams(
    serve_app, start_router, make_pod, kubelet_mount, wait_until
):
    a, b = make_pod(), make_pod()
    async with serve_app(a.app()) as ua, serve_app(b.app()) as ub:
        backend_a = {"name": "a", "model": "m", "url": ua}
        backend_b = {"name": "b", "model": "m", "url": ub}
        mount = kubelet_mount({"router.yaml": router_file([backend_a], 1, strategy="prefix-affinity")})
        cfg = yaml.safe_load(mount.path("router.yaml").read_text())
        async with (
            start_router(
                cfg["backends"], cfg["routing"], config_path=mount.path("router.yaml"), generation=1
            ) as (url, router),
            aiohttp.ClientSession(timeout=TIMEOUT) as s,
        ):
            fleet = router.fleet
            assert (await get_config(s, url))["generation"] == 1
            assert (await send(s, url, chat(0, "w1")))[:2] == (200, ua)
            await wait_until(lambda: fleet.exact.num_blocks(ua) > 0)
            endpoint_a = fleet.endpoints.by_id[ua]

            # A stream in flight on pod a across the edit.
            a.tokens, a.gate = 3, asyncio.Event()
            body = {"model": "m", "prompt": "w5 w6", "max_tokens": 3, "stream": True}
            stream = await s.post(url + "/v1/completions", json=body)
            assert (await stream.content.readuntil(b"\n\n")).startswith(b"data: ")

            # The edit: a second backend, round-robin, a priority class, generation 2.
            mount.swap(
                {
                    "router.yaml": router_file(
                        [backend_a, backend_b],
                        2,
                        strategy="round-robin",
                        priorityClasses=[{"name": "interactive", "priority": -10}],
                    )
                }
            )
            await wait_until(lambda: router.config.generation == 2, timeout=5.0)
            await wait_until(
                lambda: ub in fleet.endpoints.by_id and fleet.available(fleet.endpoints.by_id[ub])
            )
            snap = await get_config(s, url)
            assert snap["generation"] == 2 and snap["effective"]["routing"]["strategy"] == "round-robin"
            assert snap["restart_required"] is False and snap["reloads"] == 1
            assert "routing" in snap["live_fields"] and "port" in snap["restart_fields"]

            # Same endpoint object, same prefix index; the stream finishes normally.
            assert fleet.endpoints.by_id[ua] is endpoint_a and fleet.exact.num_blocks(ua) > 0
            a.gate.set()
            rest = await stream.read()
            stream.release()
            assert rest.rstrip().endswith(b"data: [DONE]")
            a.gate = None

            # New behaviour: round-robin over both pods, and the new class is known.
            seen = {(await send(s, url, chat(0, f"w{i}"), {"x-priority-class": "interactive"}))[1]
                    for i in range(4)}  # fmt: skip
            assert seen == {ua, ub}
            assert b.requests[-1]["headers"]["x-tokenfleet-priority"] == "-10"

            # A restart-only change is reported, not applied; an invalid file changes nothing.
            mount.swap(
                {"router.yaml": router_file([backend_a, backend_b], 3, port=1, strategy="round-robin")}
            )
            await wait_until(lambda: router.config.generation == 3, timeout=5.0)
            snap = await get_config(s, url)
            assert snap["restart_required"] is True
            assert [c["path"] for c in snap["pending_restart"]] == ["port"]
            mount.swap({"router.yaml": "routing: {strategy: nope}\n"})
            await wait_until(lambda: router.watcher.last_error is not None, timeout=5.0)
            assert router.config.generation == 3 and router.config.routing.strategy == "round-robin"


async def test_keys_from_a_mounted_secret_rotate_live(
    serve_app, start_router, make_pod, kubelet_mount, wait_until
):
    pod = make_pod()
    secret = kubelet_mount({"keys": "old-key:gold\n"}, name="secret")
    async with (
        serve_app(pod.app()) as pod_url,
        start_router(
            [{"name": "a", "model": "m", "url": pod_url}], api_key_file=str(secret.path("keys"))
        ) as (url, _),
        aiohttp.ClientSession(timeout=TIMEOUT) as s,
    ):
        old = {"Authorization": "Bearer old-key"}
        new = {"Authorization": "Bearer new-key"}
        assert (await send(s, url, chat(0, "w1"), old))[0] == 200
        assert (await send(s, url, chat(0, "w1"), new))[0] == 401
        secret.swap({"keys": "new-key:gold\n"})

        async def status_with(headers):
            return (await send(s, url, chat(0, "w1"), headers))[0]

        deadline = asyncio.get_running_loop().time() + 5
        while await status_with(new) != 200:
            assert asyncio.get_running_loop().time() < deadline, "rotation not applied"
            await asyncio.sleep(0.2)
        assert await status_with(old) == 401
        # The key's value never shows at /v1/config.
        snap = await get_config(s, url, new)
        assert "new-key" not in str(snap) and "old-key" not in str(snap)
