"""While a pod downloads its model, the pod's HTTP port says how far the download is.

The download runs in the pod's init container, before the server, on the port the server will take: `GET
/ready` (and `/health`) answer 503 with `{"status": "fetching", "progress": {...}}`, the latest progress
line's fields (fetch_progress.py) — the same shape the server answers while it loads (`"status":
"loading"`), so the operator reads one endpoint for the whole cold start and puts it in the
ModelDeployment's `status.loading`. Standard library only (the fetch has no event loop): a threading HTTP
server on a daemon thread, closed before the fetch exits so the server can bind the port.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FetchStatusServer:
    def __init__(self, host: str, port: int):
        self._lock = threading.Lock()
        self._progress: dict[str, Any] = {"phase": "resolve"}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] not in ("/ready", "/health"):
                    self._answer(
                        404, {"error": "the model is being downloaded; only /ready and /health answer"}
                    )
                    return
                self._answer(503, {"status": "fetching", "progress": owner.progress()})

            def _answer(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the operator asks every few seconds: its requests are not worth a log line each

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fetch-status", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def update(self, fields: dict[str, Any]) -> None:
        with self._lock:
            self._progress = dict(fields)

    def progress(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._progress)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
