"""`status.adapters` and `status.adaptersReady`, kept current for ModelDeployments that list LoRA adapters.

A kopf timer per ModelDeployment every ADAPTERS_INTERVAL_SECONDS, only while `spec.adapters` lists some
(or the status still shows some to clear): a deployment without adapters costs nothing. Each tick lists the
deployment's runtime pods, asks every Ready one for its /load at once (bounded time and size), and writes
the two fields when they changed (adapter_status.py says what the answers mean).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf
from tokenfleet.operator.adapter_status import adapter_status, adapter_targets
from tokenfleet.operator.api import GROUP, VERSION
from tokenfleet.operator.builders import RUNTIME_PORT
from tokenfleet.operator.loading_report import ASK_TIMEOUT_SECONDS, read_json

ADAPTERS_INTERVAL_SECONDS = 5.0


async def report_adapters(kube: Any, namespace: str, name: str, session: aiohttp.ClientSession) -> None:
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
                await report_adapters(memo.ctx.kube, namespace, name, session)
            except Exception as e:  # an API hiccup: the next tick reports again
                logger.info("adapters: not reported this tick: %s", e)
