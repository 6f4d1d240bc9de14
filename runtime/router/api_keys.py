"""The router's API keys: `KEY` or `KEY:TIER`, from the config and a key file (a mounted Secret), live.

The file is watched by `runtime/key_file.py` (live rotation of a mounted Secret; the last good keys stay
in force while it is unreadable). The configured keys themselves change with a config reload (`update`).
Comparison is constant-time per key and visits every key, so timing reveals nothing.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterable

from tokenfleet.runtime.key_file import WatchedKeyFile
from tokenfleet.runtime.router.config import parse_key_lines


class KeyTiers:
    def __init__(
        self,
        keys: Iterable[str] = (),
        key_file: str | None = None,
        recheck_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._recheck = recheck_seconds
        self._clock = clock
        self._static: dict[str, str] = {}
        self._file: WatchedKeyFile[dict[str, str]] | None = None
        self.update(keys, key_file)

    def update(self, keys: Iterable[str], key_file: str | None) -> None:
        """New configured keys and key file (a config reload); the file is read now."""
        self._static = parse_key_lines(keys)
        if key_file != (self._file.path if self._file is not None else None):
            self._file = (
                WatchedKeyFile(key_file, parse_key_lines, "api_key_file", self._recheck, self._clock)
                if key_file is not None
                else None
            )

    @property
    def enabled(self) -> bool:
        return bool(self._static) or self._file is not None

    def tier_of(self, token: str | None) -> str | None:
        """The key's tier, or None when the key is unknown (or missing)."""
        file_keys = self._file.current() if self._file is not None else {}
        if token is None:
            return None
        given = token.encode()
        found: str | None = None
        for key, tier in (*self._static.items(), *file_keys.items()):
            if hmac.compare_digest(given, key.encode()) and found is None:
                found = tier
        return found
