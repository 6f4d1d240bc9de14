"""`status.adapters` and `status.adaptersReady`, kept current for ModelDeployments that list LoRA adapters.

A kopf timer per ModelDeployment every ADAPTERS_INTERVAL_SECONDS, only while `spec.adapters` lists some
(or the status still shows some to clear): a deployment without adapters costs nothing. Each tick lists the
deployment's runtime pods, asks every Ready one for its /load at once (bounded time and size), and writes
the two fields when they changed (adapter_status.py says what the answers mean). Adapters with a
`minCopies` are then pinned, for a lease of a few ticks, on the pods adapter_copies.py chooses from the same
answers (`POST /v1/pin_lora_adapter` with the deployment's internal key): each tick renews them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf
from tokenfleet.operator.adapter_copies import PIN_TICKS, PodLoad, pins
from tokenfleet.operator.adapter_status import adapter_status, adapter_targets
from tokenfleet.operator.api import GROUP, VERSION, parse_model_deployment
from tokenfleet.operator.builders import RUNTIME_PORT, host_places
from tokenfleet.operator.internal_key import read_internal_key
from tokenfleet.operator.loading_report import ASK_TIMEOUT_SECONDS, read_json
from tokenfleet.runtime.errors import ConfigError

ADAPTERS_INTERVAL_SECONDS = 5.0
PIN_PATH = "/v1/pin_lora_adapter"
# A pin may load the adapter (files, even a download) before it answers: longer than a /load question. One
# that takes longer goes on in the pod; the next tick's pin finds it loaded.
PIN_TIMEOUT_SECONDS = 10.0

log = logging.getLogger(__name__)


async def report_adapters(
    kube: Any,
    namespace: str,
    name: str,
    session: aiohttp.ClientSession,
    interval_seconds: float = ADAPTERS_INTERVAL_SECONDS,
) -> None:
    body = await asyncio.to_thread(kube.get, "ModelDeployment", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    listed = [a.get("name") for a in (body.get("spec") or {}).get("adapters") or [] if isinstance(a, dict)]
    pods = await asyncio.to_thread(kube.list, "Pod", namespace, f"{GROUP}/model-deployment={name}")
    targets = adapter_targets(pods, RUNTIME_PORT)
    answers = await asyncio.gather(*(read_json(session, url) for _, url in targets))
    entries, ready = adapter_status([n for n in listed if isinstance(n, str)], answers)
    status = body.get("status") or {}
    if (status.get("adapters"), status.get("adaptersReady")) != (entries, ready):
        patch = {"adapters": entries, "adaptersReady": ready}
        await asyncio.to_thread(kube.patch_status, "ModelDeployment", namespace, name, patch)
    await _pin_min_copies(kube, body, targets, answers, session, PIN_TICKS * interval_seconds)


async def _pin_min_copies(
    kube: Any,
    body: dict[str, Any],
    targets: list[tuple[str, str]],
    answers: list[dict[str, Any] | None],
    session: aiohttp.ClientSession,
    seconds: float,
) -> None:
    """Pin each adapter with a `minCopies` on the pods chosen from their answers (best effort: a pod that
    refuses or does not answer is chosen again, or another is, on the next tick)."""
    try:
        spec = parse_model_deployment(body.get("spec"))
    except (ConfigError, ValueError):  # an invalid spec reports itself elsewhere; nothing is pinned for it
        return
    least = {a.name: a.min_copies for a in spec.adapters if a.min_copies}
    if not least:
        return
    pods = [p for (pod, _), a in zip(targets, answers, strict=True) if (p := PodLoad.of(pod, a)) is not None]
    chosen = pins(least, pods, host_places(spec), len(spec.adapters))
    if not chosen:
        return
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    key = await asyncio.to_thread(read_internal_key, kube, namespace, name)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    urls = {pod: url.removesuffix("/load") for pod, url in targets}
    timeout = aiohttp.ClientTimeout(total=PIN_TIMEOUT_SECONDS)

    async def pin(pod: str, adapter: str) -> None:
        try:
            async with session.post(
                urls[pod] + PIN_PATH,
                json={"lora_name": adapter, "seconds": seconds},
                headers=headers,
                timeout=timeout,
            ) as resp:
                if resp.status != 200:
                    text = (await resp.content.read(300)).decode(errors="replace")
                    log.info("adapters: pod %s did not pin %s (HTTP %d: %s)", pod, adapter, resp.status, text)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.info("adapters: pod %s did not pin %s: %s", pod, adapter, type(e).__name__)

    await asyncio.gather(*(pin(pod, adapter) for pod, adapter in chosen))


def _wanted(spec: Mapping[str, Any], status: Mapping[str, Any], **_: Any) -> bool:
    return bool(spec.get("adapters")) or bool((status or {}).get("adapters"))


def register(registry: kopf.OperatorRegistry, interval_seconds: float = ADAPTERS_INTERVAL_SECONDS) -> None:
    @kopf.timer(GROUP, VERSION, "modeldeployments", interval=interval_seconds, when=_wanted,
                id="model-deployment-adapters", registry=registry)  # fmt: skip
    async def adapters_tick(
        memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **_: Any
    ) -> None:
        timeout = aiohttp.ClientTimeout(total=ASK_TIMEOUT_SECONDS)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                await report_adapters(memo.ctx.kube, namespace, name, session, interval_seconds)
            except Exception as e:  # an API hiccup: the next tick reports again
                logger.info("adapters: not reported this tick: %s", e)
