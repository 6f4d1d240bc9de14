"""Bearer API-key check for /v1/*: keys from the command line, the config, and a file (a mounted Secret).

The file is re-read when its mtime/size changes (Kubernetes updates mounted Secrets in place by swapping a
symlink), checked at most once per `recheck_seconds` so a busy server does not stat on every request.
If the file vanishes or becomes unreadable the last good key set stays in force: failing open would
expose the server, failing closed on a transient swap would drop all traffic.
Comparison is constant-time per key and never stops at the first match, so timing reveals nothing.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable, Iterable

from tokenfleet.runtime.errors import ConfigError

logger = logging.getLogger(__name__)


def read_key_file(path: str) -> tuple[str, ...]:
    """One key per line; blank lines and `#` comments ignored."""
    with open(path, encoding="utf-8") as f:
        lines = (line.strip() for line in f)
        return tuple(line for line in lines if line and not line.startswith("#"))


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeys:
    def __init__(
        self,
        keys: Iterable[str] = (),
        key_file: str | None = None,
        recheck_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._static = tuple(k for k in keys if k)
        self._file = key_file
        self._recheck = recheck_seconds
        self._clock = clock
        self._file_keys: tuple[str, ...] = ()
        self._file_sig: tuple[float, int, int] | None = None
        self._next_check = 0.0
        if key_file is not None:
            try:
                self._reload(force=True)
            except OSError as e:
                raise ConfigError(f"cannot read server.api_key_file {key_file}: {e}") from e

    @property
    def enabled(self) -> bool:
        return bool(self._static) or self._file is not None

    def _reload(self, force: bool = False) -> None:
        assert self._file is not None
        st = os.stat(self._file)
        sig = (st.st_mtime, st.st_size, st.st_ino)
        if force or sig != self._file_sig:
            self._file_keys = read_key_file(self._file)
            self._file_sig = sig
            logger.info("loaded %d API key(s) from %s", len(self._file_keys), self._file)

    def _maybe_reload(self) -> None:
        if self._file is None:
            return
        now = self._clock()
        if now < self._next_check:
            return
        self._next_check = now + self._recheck
        try:
            self._reload()
        except OSError as e:
            logger.warning("API key file %s unreadable, keeping the previous keys: %s", self._file, e)

    def check(self, authorization: str | None) -> bool:
        """True when auth is off or the header carries a valid key."""
        if not self.enabled:
            return True
        self._maybe_reload()
        token = bearer_token(authorization)
        if token is None:
            return False
        given = token.encode()
        ok = False
        for key in (*self._static, *self._file_keys):
            ok |= hmac.compare_digest(given, key.encode())
        return ok
