"""A file of API keys (a mounted Secret) re-read when it changes; shared by the pod server and the router.

Kubernetes updates a mounted Secret in place (a new directory, the `..data` symlink swapped), so the file is
re-read when its resolved target, mtime, size or inode changes, checked at most once per `recheck_seconds`
so a busy process does not stat on every request. An unreadable file keeps the last good keys: failing open
would expose the fleet, failing closed on a transient swap would drop all traffic.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from tokenfleet.runtime.errors import ConfigError

logger = logging.getLogger(__name__)

K = TypeVar("K")


def key_lines(text: str) -> list[str]:
    """The file's keys, one per line; blank lines and `#` comments skipped."""
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


class WatchedKeyFile(Generic[K]):
    """`current()` is the parsed content of `path`, as of the last check that could read it."""

    def __init__(
        self,
        path: str,
        parse: Callable[[list[str]], K],
        setting: str,
        recheck_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._parse = parse
        self._recheck = recheck_seconds
        self._clock = clock
        self._signature: tuple[str, int, int, int] | None = None
        self._next_check = clock() + recheck_seconds
        try:
            self._keys = self._read()
        except OSError as e:  # at start-up a missing file is a configuration error, not a transient one
            raise ConfigError(f"cannot read {setting} {path}: {e}") from e

    def _read(self) -> K:
        with open(self.path, encoding="utf-8") as f:
            st = os.fstat(f.fileno())
            keys = self._parse(key_lines(f.read()))
        self._signature = (os.path.realpath(self.path), st.st_mtime_ns, st.st_size, st.st_ino)
        logger.info("loaded %d API key(s) from %s", len(keys), self.path)  # type: ignore[arg-type]
        return keys

    def current(self) -> K:
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + self._recheck
            try:
                st = os.stat(self.path)
                signature = (os.path.realpath(self.path), st.st_mtime_ns, st.st_size, st.st_ino)
                if signature != self._signature:
                    self._keys = self._read()
            except OSError as e:
                logger.warning("API key file %s unreadable, keeping the previous keys: %s", self.path, e)
        return self._keys
