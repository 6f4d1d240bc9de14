"""`status.loading`, kept current while a ModelDeployment's pods download and load their model.

A kopf timer per ModelDeployment, every LOADING_INTERVAL_SECONDS, but only while its status says a pod is
on its way (`replicas` above `readyReplicas`, or entries from the last tick to clear): a fleet at rest costs
nothing. Each tick lists the deployment's runtime pods (both roles of a disaggregated one), asks each pod
that is not Ready for its /ready answer, all at once with a bounded time and size (model_loading.py says
which pods and what the answers mean), and writes `status.loading` when it changed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf
from tokenfleet.operator.api import GROUP, VERSION
from tokenfleet.operator.builders import RUNTIME_PORT
from tokenfleet.operator.model_loading import MAX_BODY_BYTES, loading_entry, loading_status, loading_targets

LOADING_INTERVAL_SECONDS = 5.0
# A pod that does not answer within this is reported as starting; the tick must not wait on one pod.
ASK_TIMEOUT_SECONDS = 2.0


def loading_wanted(status: Mapping[str, Any] | None) -> bool:
    """Whether a tick has anything to do: some pod is not Ready yet (of either role of a disaggregated
    deployment), or the last tick's entries must go."""
    status = status or {}
    counts = [status, *((status.get("roles") or {}).values())]
    behind = any(int(c.get("replicas") or 0) > int(c.get("readyReplicas") or 0) for c in counts if c)
    return behind or bool(status.get("loading"))


async def read_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    """The JSON object a pod answers at `url` (its /ready, whatever the status code: 503 while loading; its
    /load), read with a bounded size; None when the pod does not answer, or answers something else."""
    try:
        async with session.get(url) as resp:
            raw = await resp.content.read(MAX_BODY_BYTES + 1)
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    if len(raw) > MAX_BODY_BYTES:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def report_loading(kube: Any, namespace: str, name: str, session: aiohttp.ClientSession) -> None:
    pods = await asyncio.to_thread(kube.list, "Pod", namespace, f"{GROUP}/model-deployment={name}")
    targets = loading_targets(pods, RUNTIME_PORT)
    bodies = await asyncio.gather(*(read_json(session, url) for _, url in targets))
    loading = loading_status(
        [loading_entry(pod, body) for (pod, _), body in zip(targets, bodies, strict=True)]
    )
    body = await asyncio.to_thread(kube.get, "ModelDeployment", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    if (body.get("status") or {}).get("loading") != loading:
        await asyncio.to_thread(kube.patch_status, "ModelDeployment", namespace, name, {"loading": loading})


def _wanted(status: Mapping[str, Any], **_: Any) -> bool:
    return loading_wanted(status)


def register(registry: kopf.OperatorRegistry, interval_seconds: float = LOADING_INTERVAL_SECONDS) -> None:
    @kopf.timer(GROUP, VERSION, "modeldeployments", interval=interval_seconds, when=_wanted,
                id="model-deployment-loading", registry=registry)  # fmt: skip
    async def loading_tick(
        memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **_: Any
    ) -> None:
        timeout = aiohttp.ClientTimeout(total=ASK_TIMEOUT_SECONDS)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                await report_loading(memo.ctx.kube, namespace, name, session)
            except Exception as e:  # an API hiccup: the next tick reports again
                logger.info("loading: not reported this tick: %s", e)
