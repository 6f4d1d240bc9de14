"""Every router -> pod call authenticates with the backend's internal key; 401s from pods are reported.

The router checks its clients' keys itself (app.py `identity`); what it sends to a pod is its own
credential: `Authorization: Bearer <internal key>`, read from `Backend.internal_key_file` (the mounted
Secret, re-read live through runtime/key_file.py, so a rotation needs no restart). One aiohttp client
middleware on the router's session does it, so proxied requests, KV-event polls, /v1/models, /load, KV
holds, disaggregation hand-offs and the tokenizer fetch all carry it without each call site knowing.
A backend without an internal key forwards the client's Authorization, as before.

A pod that answers 401 is never silent: the first 401 per endpoint and path is logged with what to fix,
and `state()` (the router's /v1/config `pod_auth`) lists it until that path answers otherwise.
"""

from __future__ import annotations

import logging
import time

from aiohttp import ClientHandlerType, ClientRequest, ClientResponse
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.key_file import WatchedKeyFile
from tokenfleet.runtime.router.config import Backend
from yarl import URL

log = logging.getLogger(__name__)


def _first_key(lines: list[str]) -> str | None:
    return lines[0] if lines else None


def origin(url: str) -> str:
    return str(URL(url).origin())


class PodAuth:
    def __init__(self) -> None:
        self._keys: dict[str, WatchedKeyFile[str | None]] = {}  # backend name -> its internal key file
        self._key_errors: dict[str, str] = {}  # backend name -> why its key file cannot be read
        self._origins: dict[str, str] = {}  # pod origin -> backend name
        self._refused: dict[tuple[str, str], dict] = {}  # (origin, path) -> the last 401

    # --- configuration ------------------------------------------------------------------------------

    def set_backends(self, backends: list[Backend]) -> None:
        """The backends' key files (a live config change passes the new list; unchanged files are kept)."""
        keys: dict[str, WatchedKeyFile[str | None]] = {}
        self._key_errors = {}
        for b in backends:
            if b.internal_key_file is None:
                continue
            old = self._keys.get(b.name)
            if old is not None and old.path == b.internal_key_file:
                keys[b.name] = old
                continue
            try:
                keys[b.name] = WatchedKeyFile(
                    b.internal_key_file, _first_key, f"backend {b.name} internalKeyFile"
                )
            except ConfigError as e:  # pods of this backend will answer 401: said here and on /v1/config
                log.error("backend %s: %s; its pods will refuse this router", b.name, e)
                self._key_errors[b.name] = str(e)
        self._keys = keys

    def endpoint_added(self, url: str, backend: str) -> None:
        self._origins[origin(url)] = backend

    def endpoint_removed(self, url: str) -> None:
        o = origin(url)
        self._origins.pop(o, None)
        self._refused = {k: v for k, v in self._refused.items() if k[0] != o}

    def key_for(self, url: URL) -> str | None:
        backend = self._origins.get(str(url.origin()))
        watched = self._keys.get(backend) if backend is not None else None
        return watched.current() if watched is not None else None

    # --- the client middleware ----------------------------------------------------------------------

    async def middleware(self, req: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        key = self.key_for(req.url)
        if key is not None:
            req.headers["Authorization"] = f"Bearer {key}"
        resp = await handler(req)
        self._observe(req.url, req.method, resp.status, key is not None)
        return resp

    def _observe(self, url: URL, method: str, status: int, sent_internal: bool) -> None:
        o = str(url.origin())
        if o not in self._origins:
            return
        where = (o, url.path)
        if status != 401:
            if self._refused.pop(where, None) is not None:
                log.info("pod %s accepts %s %s again", o, method, url.path)
            return
        backend = self._origins[o]
        if sent_internal:
            reason = f"the pod refused this router's internal key (backend {backend} internalKeyFile is stale or wrong)"
        elif backend in self._key_errors:
            reason = f"no internal key: {self._key_errors[backend]}"
        else:
            reason = f"the pod needs a key and backend {backend} sets no internalKeyFile"
        if where not in self._refused:
            log.error(
                "pod %s answered 401 to %s %s: %s; exact routing and proxying to it fail",
                o,
                method,
                url.path,
                reason,
            )
        self._refused[where] = {
            "endpoint": o,
            "path": url.path,
            "reason": reason,
            "at": round(time.time(), 3),
        }

    def state(self) -> dict:
        """For /v1/config: per backend whether it has a key, and every pod path answering 401 now."""
        return {
            "internal_key": {name: "set" for name in self._keys}
            | {n: f"error: {e}" for n, e in self._key_errors.items()},
            "unauthorized": sorted(self._refused.values(), key=lambda r: (r["endpoint"], r["path"])),
        }

    def unauthorized(self, url: str) -> bool:
        o = origin(url)
        return any(k[0] == o for k in self._refused)
