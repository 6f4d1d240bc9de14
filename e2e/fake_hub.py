"""A stand-in for the Hugging Face Hub: what huggingface_hub 2.4.0 asks for when `tokenfleet fetch` downloads
a model, served from memory, every request counted.

`GET /api/models/REPO/revision/REV?blobs=true` (model_info with files metadata: the commit, each file's
size, blob id and LFS sha256) and `HEAD`/`GET /REPO/resolve/REV/FILE` (hf_hub_download: the HEAD's
X-Repo-Commit, ETag / X-Linked-Etag and X-Linked-Size, then the body, ranges honoured). A private repository
answers 401 without the right bearer token, as the Hub does for a repository it will not admit exists.

Used by tests/runtime/test_fetch.py (on loopback, loaded by path) and e2e/test_model_fetch.py (on the
session's bridge, where pods reach it): no test ever talks to the real Hub.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class FakeRepo:
    commit: str
    files: dict[str, bytes]
    lfs: frozenset[str]
    private: bool = False

    def sibling(self, name: str) -> dict[str, object]:
        data = self.files[name]
        entry: dict[str, object] = {"rfilename": name, "size": len(data), "blobId": _blob_id(data)}
        if name in self.lfs:
            sha = hashlib.sha256(data).hexdigest()
            entry["lfs"] = {"size": len(data), "sha256": sha, "pointerSize": 134}
            entry["blobId"] = "f" * 40  # the pointer file's blob id, not the content's
        return entry

    def etag(self, name: str) -> str:
        data = self.files[name]
        return hashlib.sha256(data).hexdigest() if name in self.lfs else _blob_id(data)


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    token: str | None = None
    fail_gets: Counter[str] = field(default_factory=Counter)  # file -> GETs still to answer 500
    get_delay_s: float = 0.0  # before each LFS file's body
    rate_bytes_per_s: float = 0.0  # 0: as fast as the socket takes it
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)  # (method, file or "api")
    auth_seen: list[str | None] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # every request's path, in order
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def gets(self, name: str) -> int:
        return self.requests["GET", name]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def _reply(self, status: int, headers: dict[str, str], data: bytes = b"", body: bool = True) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", headers.get("Content-Length", str(len(data))))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str, body: bool = True) -> None:
            self._reply(status, {"X-Error-Code": code}, json.dumps({"error": code}).encode(), body)

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            api = path.startswith("/api/models/")
            parts = path.removeprefix("/api/models/" if api else "/").split("/")
            repo_id = "/".join(parts[:2])
            repo = hub.repos.get(repo_id)
            name = "api" if api else "/".join(parts[4:])
            with hub.lock:
                hub.requests[self.command, name] += 1
                hub.auth_seen.append(self.headers.get("Authorization"))
                hub.paths.append(f"{self.command} {path}")
            if repo is None:
                return self._error(404, "RepoNotFound", body)
            if repo.private and self.headers.get("Authorization") != f"Bearer {hub.token}":
                return self._error(401, "RepoNotFound", body)  # as the Hub: no telling private from missing
            if parts[3] not in ("main", repo.commit):
                return self._error(404, "RevisionNotFound", body)
            if api:
                info = {"id": repo_id, "sha": repo.commit, "private": repo.private}
                info["siblings"] = [repo.sibling(n) for n in sorted(repo.files)]
                return self._reply(200, {"Content-Type": "application/json"}, json.dumps(info).encode(), body)
            if name not in repo.files:
                return self._error(404, "EntryNotFound", body)
            if body:
                with hub.lock:
                    failing = hub.fail_gets[name] > 0
                    hub.fail_gets[name] -= failing
                if failing:
                    return self._reply(500, {}, b"internal error")
                time.sleep(hub.get_delay_s if name in repo.lfs else 0.0)
            data = repo.files[name]
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.etag(name)}"', "Accept-Ranges": "bytes"}
            if name in repo.lfs:
                headers |= {"X-Linked-Etag": f'"{repo.etag(name)}"', "X-Linked-Size": str(len(data))}
            status, ranged = 200, self.headers.get("Range", "")
            if ranged.startswith("bytes=") and body:
                start = int(ranged.removeprefix("bytes=").split("-")[0])
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                status, data = 206, data[start:]
            headers["Content-Length"] = str(len(data))
            if hub.rate_bytes_per_s and body:
                self._reply(status, headers, b"", False)
                self._trickle(data)
                return
            self._reply(status, headers, data, body)

        def _trickle(self, data: bytes) -> None:
            """The body at about `rate_bytes_per_s`, in 64 KiB writes: a download that takes seconds."""
            chunk, started = 64 << 10, time.monotonic()
            for offset in range(0, len(data), chunk):
                self.wfile.write(data[offset : offset + chunk])
                ahead = (offset + chunk) / hub.rate_bytes_per_s - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)

    return Handler


def serve_hub(hub: FakeHub, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serve `hub` on a free port of `host` from a daemon thread; sets `hub.url`. Stop it with
    `shutdown()` and `server_close()`."""
    server = ThreadingHTTPServer((host, 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://{host}:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, name="fake-hub", daemon=True).start()
    return server
