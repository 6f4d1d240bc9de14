"""Bearer API-key check for /v1/*: keys from the command line, the config, and a file (a mounted Secret).

The file is watched by `runtime/key_file.py` (live rotation of a mounted Secret; the last good keys stay in
force while it is unreadable).
Comparison is constant-time per key and never stops at the first match, so timing reveals nothing.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterable

from tokenfleet.runtime.key_file import WatchedKeyFile


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
        self._file = (
            WatchedKeyFile(key_file, tuple, "server.api_key_file", recheck_seconds, clock)
            if key_file is not None
            else None
        )

    @property
    def enabled(self) -> bool:
        return bool(self._static) or self._file is not None

    def check(self, authorization: str | None) -> bool:
        """True when auth is off or the header carries a valid key."""
        if not self.enabled:
            return True
        file_keys = self._file.current() if self._file is not None else ()
        token = bearer_token(authorization)
        if token is None:
            return False
        given = token.encode()
        ok = False
        for key in (*self._static, *file_keys):
            ok |= hmac.compare_digest(given, key.encode())
        return ok


class InternalKey:
    """The deployment's internal key (`server.internal_api_key_file`, first line), re-read live.

    Routers and the other role's pods call with it; the endpoint table (access.py) decides where it is
    needed. Several lines are all accepted, so a rotation can overlap the old and the new key.
    """

    def __init__(
        self,
        key_file: str | None,
        recheck_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._file = (
            WatchedKeyFile(key_file, tuple, "server.internal_api_key_file", recheck_seconds, clock)
            if key_file is not None
            else None
        )

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def check(self, authorization: str | None) -> bool:
        """True only when set and the header carries the key (never True when unset)."""
        if self._file is None:
            return False
        keys = self._file.current()
        token = bearer_token(authorization)
        if token is None:
            return False
        given = token.encode()
        ok = False
        for key in keys:
            ok |= hmac.compare_digest(given, key.encode())
        return ok
