"""The router authenticates to pods with the deployment's internal key and learns tokenizers from them.

Pods here require the internal key on every /v1 path and serve their tokenizer on /v1/tokenizer with its
digest on /load (as real pods do with `server.internal_api_key_file`); the router checks its clients' own
keys and never forwards them. A router lacking the key says so on /v1/config and in its log.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web
from tokenfleet.runtime.kv_wire import LoadReport
from tokenfleet.runtime.openai.tokenizer_wire import TOKENIZER_PATH
from tokenfleet.runtime.server.tokenizer_endpoint import tokenizer_payload

from .conftest import CHATML, FakePod

SYSTEM = " ".join(f"w{i}" for i in range(64))  # 4 full blocks


class KeyedPod(FakePod):
    def __init__(self, *a, keys=("internal",), **kw):
        super().__init__(*a, **kw)
        self.keys = set(keys)
        self.seen_auth: list[str | None] = []
        self.payload = tokenizer_payload(self.model, self.tokenizer)

    def app(self) -> web.Application:
        app = super().app()
        app.middlewares.insert(0, self._auth)
        app.router.add_get(TOKENIZER_PATH, self.serve_tokenizer)
        return app

    @web.middleware
    async def _auth(self, request, handler):
        if request.path.startswith("/v1/"):
            auth = request.headers.get("Authorization")
            self.seen_auth.append(auth)
            if auth not in {f"Bearer {k}" for k in self.keys}:
                return web.json_response(
                    {"error": {"message": "no", "code": "internal_key_required"}}, status=401
                )
        if request.path == "/load":
            return web.json_response(LoadReport(self.running, 0, 0.0, self.payload.digest).to_json())
        return await handler(request)

    async def serve_tokenizer(self, request):
        return web.Response(text=self.payload.model_dump_json(), content_type="application/json")


def chat(user: str) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    }


async def post(url: str, body: dict, key: str | None) -> tuple[int, str | None]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        await r.read()
        return r.status, r.headers.get("x-tokenfleet-route")


async def config_of(url: str, key: str) -> dict:
    async with (
        aiohttp.ClientSession() as s,
        s.get(url + "/v1/config", headers={"Authorization": f"Bearer {key}"}) as r,
    ):
        return await r.json()


async def test_router_calls_pods_with_the_internal_key_and_routes_exactly(
    serve_app, start_router, tokenizer, kubelet_mount, wait_until
):
    mount = kubelet_mount({"key": "internal\n"})
    pod = KeyedPod("m", tokenizer)
    async with serve_app(pod.app()) as pod_url:
        backends = [{"name": "p0", "model": "m", "url": pod_url, "internalKeyFile": str(mount.path("key"))}]
        async with start_router(backends, {"strategy": "prefix-affinity"}, apiKeys=["client"]) as (
            url,
            router,
        ):
            await wait_until(lambda: all(router.fleet.kv_events_live().values()))
            state = (await config_of(url, "client"))["tokenizers"]["p0"]
            assert state == {"state": "ok", "source": "pods", "digest": pod.payload.digest, "reason": None}
            assert await post(url, chat("w1999"), None) == (401, None)  # the router checks client keys
            assert (await post(url, chat("w1999"), "client"))[0] == 200
            await wait_until(lambda: router.fleet.exact.num_blocks(pod_url) == len(pod.cached))
            assert await post(url, chat("w1998"), "client") == (200, "prefix_hit")  # exact index, pod tokens
            assert pod.requests[-1]["headers"]["Authorization"] == "Bearer internal"  # never the client's
            assert set(pod.seen_auth) == {"Bearer internal"}

            # Rotation: the Secret changes in place and the pods take only the new key; no restart.
            pod.keys = {"internal", "rotated"}
            mount.swap({"key": "rotated\n"})
            await wait_until(lambda: pod.seen_auth[-1] == "Bearer rotated", timeout=5.0)
            pod.keys = {"rotated"}
            assert (await post(url, chat("w1997"), "client"))[0] == 200
            assert (await config_of(url, "client"))["pod_auth"]["unauthorized"] == []


async def test_a_router_without_the_key_reports_the_pods_401s(
    serve_app, start_router, tokenizer, wait_until, caplog
):
    pod = KeyedPod("m", tokenizer)
    caplog.set_level(logging.WARNING)
    async with serve_app(pod.app()) as pod_url:
        backends = [{"name": "p0", "model": "m", "url": pod_url}]
        async with start_router(backends, {"strategy": "prefix-affinity"}) as (url, router):
            await wait_until(lambda: router.pod_auth.unauthorized(pod_url))
            config = await config_of(url, "any")
            tok = config["tokenizers"]["p0"]
            assert tok["state"] == "error" and "401" in tok["reason"] and "internal key" in tok["reason"]
            await wait_until(lambda: len(router.pod_auth.state()["unauthorized"]) >= 2)
            refused = {r["path"]: r["reason"] for r in router.pod_auth.state()["unauthorized"]}
            assert "/v1/kv-events" in refused and "sets no internalKeyFile" in refused["/v1/kv-events"]
            assert any("answered 401 to GET /v1/kv-events" in r.message for r in caplog.records)
            assert not router.fleet.kv_events_live()[pod_url]


async def test_a_new_tokenizer_digest_is_fetched_again(
    serve_app, start_router, tokenizer, kubelet_mount, wait_until
):
    mount = kubelet_mount({"key": "internal\n"})
    pod = KeyedPod("m", tokenizer)
    async with serve_app(pod.app()) as pod_url:
        backends = [{"name": "p0", "model": "m", "url": pod_url, "internalKeyFile": str(mount.path("key"))}]
        async with start_router(backends) as (_, router):
            first = pod.payload.digest
            assert router.tokenizer_states()["p0"]["digest"] == first
            # The pod now serves another model whose chat template differs: a new digest on /load.
            pod.payload = pod.payload.model_copy(update={"chat_template": CHATML + "{{ '' }}"}).with_digest()
            await wait_until(lambda: router.tokenizer_states()["p0"]["digest"] == pod.payload.digest)
            assert router.tokenizers["m"].chat_template.endswith("{{ '' }}")
