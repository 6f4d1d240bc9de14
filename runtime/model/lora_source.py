"""Where a LoRA adapter's files are: a local folder as given, or an `hf://ORG/NAME[@REVISION]` repository the
pod downloads itself, when the adapter is first needed, into a cache verified by digest (fetch.py's).

A model is downloaded by an init container before the server starts; an adapter cannot be: adapters are
listed and unlisted while the pod runs (a ModelDeployment edit, `POST /v1/load_lora_adapter`), so the server
downloads one on the thread that loads it. A source is resolved to its commit and downloaded once per
process: an adapter evicted from host memory and asked for again is read from the entry, with no Hub
request — a Hub outage does not take away adapters this pod already fetched, and the weights under a name
do not change because a branch moved (pin a commit for identical weights on every pod).

A failed download changes nothing: the Hub unreachable or failing is a 503 with Retry-After
(`AdapterUnavailable`, the next request tries again); a repository that does not exist, is gated without a
token or names a bad revision is a 400 naming the reason, like any adapter that cannot be served.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from tokenfleet.runtime.errors import AdapterUnavailable
from tokenfleet.runtime.model import fetch
from tokenfleet.runtime.model.lora_adapter import InvalidAdapter

logger = logging.getLogger(__name__)

HF_PREFIX = "hf://"
# A request waits for the download: one retry after a short pause, then the client hears 503 and retries
# itself (the init container's five attempts with back-off up to a minute suit a pod start, not a request).
ATTEMPTS = 2
BACKOFF_S = 1.0
RETRY_AFTER_S = 5.0
FIELDS = fetch.Fields(token="lora.hfTokenSecret", source="the adapter's source")

Fetch = Callable[..., fetch.Fetched]


def default_download_dir() -> Path:
    return Path(tempfile.gettempdir()) / "tokenfleet-adapters"


class AdapterSources:
    """Turns an adapter source into the local folder its files are in (`local`); thread-safe."""

    def __init__(self, download_dir: str | Path | None = None, fetch_fn: Fetch = fetch.fetch):
        self._dir = Path(download_dir) if download_dir else default_download_dir()
        self._fetch = fetch_fn
        self._lock = threading.Lock()
        self._fetched: dict[str, Path] = {}  # hf:// source -> its verified entry
        self._busy: dict[str, threading.Lock] = {}  # one download per source at a time
        self.num_downloads = 0  # sources fetched (cache entries made or found intact)

    @staticmethod
    def is_remote(source: str) -> bool:
        return source.startswith(HF_PREFIX)

    def local(self, source: str) -> str:
        """The folder to read `source` from: as given, or its downloaded entry (fetched now if this process
        has not yet). Raises InvalidAdapter (400) or AdapterUnavailable (503, retry)."""
        if not self.is_remote(source):
            return source
        with self._lock:
            entry = self._fetched.get(source)
            busy = self._busy.setdefault(source, threading.Lock())
        if entry is not None:
            return str(entry)
        with busy:  # a second request for the same adapter waits for the first one's download
            with self._lock:
                entry = self._fetched.get(source)
            if entry is None:
                entry = self._download(source)
                with self._lock:
                    self._fetched[source] = entry
                    self.num_downloads += 1
        return str(entry)

    def _download(self, source: str) -> Path:
        link = self._dir / "links" / hashlib.sha256(source.encode()).hexdigest()[:16]
        try:
            fetched = self._fetch(
                source,
                self._dir,
                link,
                attempts=ATTEMPTS,
                backoff=BACKOFF_S,
                log=_log_progress,
                fields=FIELDS,
            )
        except fetch.FetchError as e:
            if e.transient:
                raise AdapterUnavailable(
                    f"the adapter source {source} cannot be downloaded now: {e.reason}", RETRY_AFTER_S
                ) from e
            raise InvalidAdapter(f"{source}: {e.reason}") from e
        logger.info(
            "LoRA adapter %s: commit %s (%s, %d bytes downloaded)",
            source,
            fetched.commit,
            "cache hit" if fetched.hit else "downloaded",
            fetched.downloaded,
        )
        return fetched.entry


def _log_progress(line: str) -> None:
    logger.debug("adapter fetch: %s", line)
