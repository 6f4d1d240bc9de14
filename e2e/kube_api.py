"""The few Kubernetes API calls the process kubelet makes, over aiohttp with the admin kubeconfig's token.

Plain REST, not a client library: the kubelet lists pods, patches pod and node status, deletes pods, reads
ConfigMaps/Secrets, asks for ServiceAccount tokens and renews leases — nine small calls.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import aiohttp


class ApiError(RuntimeError):
    def __init__(self, status: int, text: str):
        super().__init__(f"{status}: {text[:500]}")
        self.status = status
        self.text = text


class KubeApi:
    def __init__(self, kubeconfig: Path):
        config = json.loads(Path(kubeconfig).read_text())
        cluster = config["clusters"][0]["cluster"]
        self.server = cluster["server"]
        self.token = config["users"][0]["user"]["token"]
        self.ssl = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeApi:
        self.session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=aiohttp.ClientTimeout(total=30),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> dict[str, Any] | None:
        """The decoded response; None on 404 (gone is a normal state for pods and their objects)."""
        assert self.session is not None
        data = json.dumps(body) if body is not None else None
        async with self.session.request(
            method,
            self.server + path,
            data=data,
            params=params,
            ssl=self.ssl,
            headers={"Content-Type": content_type},
        ) as resp:
            text = await resp.text()
            if resp.status == 404:
                return None
            if resp.status >= 400:
                raise ApiError(resp.status, text)
            return json.loads(text) if text else {}

    async def get(self, path: str, **params: str) -> dict[str, Any] | None:
        return await self.request("GET", path, params=params or None)

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        return await self.request("PATCH", path, body, "application/merge-patch+json")

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return await self.request("POST", path, body)
        except ApiError as e:
            if e.status != 409:  # already there (a restarted kubelet): fine
                raise
            return None

    async def delete(self, path: str, body: dict[str, Any] | None = None) -> None:
        try:
            await self.request("DELETE", path, body)
        except ApiError as e:
            if e.status != 409:  # a precondition (uid) failed: it is already another object
                raise
