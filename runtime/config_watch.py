"""Live reload of the runtime config file: what changed, what applies now, what needs a restart.

Kubernetes updates a mounted ConfigMap in place by writing a new timestamped directory and swapping the
`..data` symlink to it; the file's path never changes, its resolved target does, and the new file's
mtime may even equal the old one's. So the watcher polls (once a second) the resolved target and its
mtime and size, and re-reads the file when any of them moved; it acts only when the content hash
differs from what it last acted on. inotify on the path would miss the swap (it watches the old inode).

A changed file is validated whole (an invalid file is logged and ignored: the pod keeps its config);
then `diff_config` splits the changes by `LIVE_FIELDS`. Live changes become the new *effective* config
and go to `on_change(old_effective, new_effective)` (sync or async); restart-only changes are refused
with a log line and kept as `pending_restart` for `/v1/config`, so the operator (or a person) can roll
the pod. The effective config keeps the running values of every restart-only field.

The watcher is schema-agnostic: the pod watches a `RuntimeConfig` with `LIVE_FIELDS`, the router a
`RouterConfig` with its own live set. A live field names a leaf or a whole subtree ("routing" covers
"routing.weights.prefix").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import os
from collections.abc import Awaitable, Callable, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from tokenfleet.runtime.config import LIVE_FIELDS, RuntimeConfig
from tokenfleet.runtime.config_file import parse_config
from tokenfleet.runtime.errors import ConfigError

logger = logging.getLogger(__name__)

OnChange = Callable[[Any, Any], Awaitable[None] | None]


class _Absent:
    """A leaf that one side of a diff lacks (a key of a free-form map, e.g. a rate-limit tier)."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT: Any = _Absent()


@dataclass(frozen=True, slots=True)
class ConfigChange:
    path: str  # dotted, e.g. "cache.ttl_seconds"
    old: Any
    new: Any  # ABSENT when the file dropped the key


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_leaves(value, path + "."))
        else:
            out[path] = value
    return out


def is_live(path: str, live_fields: Set[str]) -> bool:
    """Is the dotted `path` a live field, or inside a live subtree?"""
    return any(path == f or path.startswith(f + ".") for f in live_fields)


def diff_config(
    old: BaseModel, new: BaseModel, live_fields: Set[str] = LIVE_FIELDS
) -> tuple[tuple[ConfigChange, ...], tuple[ConfigChange, ...]]:
    """(live changes, restart-only changes) from `old` to `new`, in field order."""
    before, after = _leaves(old.model_dump(mode="json")), _leaves(new.model_dump(mode="json"))
    live: list[ConfigChange] = []
    restart: list[ConfigChange] = []
    for path in {**before, **after}:
        was, now = before.get(path, ABSENT), after.get(path, ABSENT)
        if was != now:  # ABSENT differs from None: a removed key is a change
            change = ConfigChange(path, was, now)
            (live if is_live(path, live_fields) else restart).append(change)
    return tuple(live), tuple(restart)


def with_changes(config: BaseModel, changes: tuple[ConfigChange, ...]) -> Any:
    """`config` with the given (dotted-path) changes applied, validated again."""
    tree = config.model_dump(mode="json")
    for change in changes:
        *parents, leaf = change.path.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        if change.new is ABSENT:
            node.pop(leaf, None)
        else:
            node[leaf] = change.new
    return type(config).model_validate(_prune(tree))


def _json(value: Any) -> Any:
    return None if value is ABSENT else value


def _prune(tree: dict[str, Any]) -> dict[str, Any]:
    """Drop empty maps: a tier whose leaves were all removed must vanish, not stay as an empty entry (an
    empty map holds no leaves, so dropping one the file kept falls back to the field's empty default)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            value = _prune(value)
            if not value:
                continue
        out[key] = value
    return out


class ConfigWatcher:
    def __init__(
        self,
        path: str | Path,
        on_change: OnChange,
        initial: BaseModel | None = None,
        interval_s: float = 1.0,
        schema: type[BaseModel] = RuntimeConfig,
        live_fields: Set[str] = LIVE_FIELDS,
        what: str = "runtime config",
    ):
        self.path = Path(path)
        self.on_change = on_change
        self.interval_s = interval_s
        self.schema = schema
        self.live_fields = live_fields
        self.what = what
        self._stat_key: tuple[str, int, int] | None = None
        text = self.path.read_text()
        self._content_hash = hashlib.sha256(text.encode()).hexdigest()
        self._stat_key = self._stat()
        self.effective: Any = initial if initial is not None else parse_config(schema, text, self.path, what)
        self.pending_restart: tuple[ConfigChange, ...] = ()
        self.last_error: str | None = None
        self.num_reloads = 0
        self._task: asyncio.Task | None = None

    def _stat(self) -> tuple[str, int, int] | None:
        try:
            st = os.stat(self.path)  # follows the ..data symlink chain
        except OSError:
            return None  # mid-swap, or the mount is gone: keep what we have
        return (os.path.realpath(self.path), st.st_mtime_ns, st.st_size)

    async def check_once(self) -> bool:
        """Poll once; True when live changes were applied."""
        key = self._stat()
        if key is None or key == self._stat_key:
            return False
        try:
            text = self.path.read_text()
        except OSError:
            return False
        self._stat_key = key
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest == self._content_hash:
            return False
        self._content_hash = digest
        try:
            new = parse_config(self.schema, text, self.path, self.what)
        except ConfigError as e:
            self.last_error = str(e)
            logger.error("config reload ignored, the running config stays: %s", e)
            return False
        # Restart-only changes are measured against what runs, so reverting the file clears them.
        live, restart = diff_config(self.effective, new, self.live_fields)
        self.pending_restart = restart
        for c in restart:
            logger.warning("config reload: %s %r -> %r needs a restart; not applied", c.path, c.old, c.new)
        if not live:
            self.last_error = None
            return False
        old, updated = self.effective, with_changes(self.effective, live)
        try:
            result = self.on_change(old, updated)
            if inspect.isawaitable(result):
                await result
        except Exception as e:  # the old config stays effective; the next file change retries
            self.last_error = f"applying {[c.path for c in live]} failed: {e!r}"
            logger.exception("config reload: applying live changes failed")
            return False
        self.effective = updated
        self.last_error = None
        self.num_reloads += 1
        for c in live:
            logger.info("config reload: %s %r -> %r applied", c.path, c.old, c.new)
        return True

    def snapshot(self) -> dict[str, Any]:
        """What `/v1/config` returns: the effective config and the changes waiting for a restart."""
        return {
            "effective": self.effective.model_dump(mode="json"),
            "pending_restart": [
                {"path": c.path, "running": _json(c.old), "file": _json(c.new)} for c in self.pending_restart
            ],
            "restart_required": bool(self.pending_restart),
            "reloads": self.num_reloads,
            "last_error": self.last_error,
        }

    # ---- the polling task -------------------------------------------------------------------------------

    def start(self) -> asyncio.Task:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="tokenfleet-config-watch")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except Exception:  # never let one bad poll end live reload for the pod's lifetime
                logger.exception("config watch poll failed")
