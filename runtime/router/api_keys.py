"""The router's API keys: `KEY` or `KEY:TIER`, from the config and a key file (a mounted Secret), live.

Kubernetes updates a mounted Secret in place (a new directory, the `..data` symlink swapped), so the file
is re-read when its resolved target, mtime or size changes, checked at most once per `recheck_seconds`.
An unreadable file keeps the last good keys: failing open would expose the fleet, failing closed on a
transient swap would drop all traffic. The configured keys themselves change with a config reload
(`update`). Comparison is constant-time per key and visits every key, so timing reveals nothing.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable, Iterable

from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.router.config import parse_key_lines

log = logging.getLogger(__name__)


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
        self._file: str | None = None
        self._file_keys: dict[str, str] = {}
        self._file_sig: tuple[str, int, int] | None = None
        self._next_check = 0.0
        self.update(keys, key_file)

    def update(self, keys: Iterable[str], key_file: str | None) -> None:
        """New configured keys and key file (a config reload); the file is read now."""
        self._static = parse_key_lines(keys)
        if key_file != self._file:
            self._file, self._file_sig, self._file_keys = key_file, None, {}
            if key_file is not None:
                try:
                    self._reload()
                except OSError as e:
                    raise ConfigError(f"cannot read api_key_file {key_file}: {e}") from e

    @property
    def enabled(self) -> bool:
        return bool(self._static) or self._file is not None

    def _reload(self) -> None:
        assert self._file is not None
        st = os.stat(self._file)
        sig = (os.path.realpath(self._file), st.st_mtime_ns, st.st_size)
        if sig != self._file_sig:
            with open(self._file, encoding="utf-8") as f:
                self._file_keys = parse_key_lines(f.read().splitlines())
            self._file_sig = sig
            log.info("loaded %d API key(s) from %s", len(self._file_keys), self._file)

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
            log.warning("API key file %s unreadable, keeping the previous keys: %s", self._file, e)

    def tier_of(self, token: str | None) -> str | None:
        """The key's tier, or None when the key is unknown (or missing)."""
        self._maybe_reload()
        if token is None:
            return None
        given = token.encode()
        found: str | None = None
        for key, tier in (*self._static.items(), *self._file_keys.items()):
            if hmac.compare_digest(given, key.encode()) and found is None:
                found = tier
        return found
