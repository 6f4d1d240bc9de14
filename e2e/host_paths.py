"""Mount points on the host for paths a pod spec mounts (`/etc/tokenfleet`, the ServiceAccount dir, ...).

A bind mount needs its target to exist, and a pod's mount namespace sees the host's filesystem: so the
kubelet creates each missing target on the host (an empty directory, or an empty file for a file mount),
and the session removes them at teardown. Several test sessions may share one machine and the same
targets, so every path made is recorded with the pid of the session that needs it, under a file lock;
a path goes away when no live session holds it any more (and only if it is still empty: nothing a
person put there is ever removed).
"""

from __future__ import annotations

from pathlib import Path

from session_registry import alive, locked

REGISTRY = "host-paths"


def ensure_target(target: str, is_dir: bool, owner_pid: int) -> None:
    """Make `target` exist (a dir, or an empty file); every component created is recorded for `owner_pid`."""
    path = Path(target)
    with locked(REGISTRY) as entries:
        missing = []
        for p in [*reversed(path.parents), path]:
            if not p.exists() and not p.is_symlink():
                missing.append(p)
        for p in missing:
            if p == path and not is_dir:
                p.touch()
            else:
                p.mkdir()
        for p in [*missing, *(Path(k) for k in entries if path == Path(k) or Path(k) in path.parents)]:
            holders = entries.setdefault(str(p), [])
            if owner_pid not in holders:
                holders.append(owner_pid)


def release(owner_pid: int) -> list[str]:
    """Drop `owner_pid` (and dead sessions) from every path; remove paths nobody holds. Returns them."""
    removed = []
    with locked(REGISTRY) as entries:
        for key in sorted(entries, key=len, reverse=True):  # deepest first
            holders = [p for p in entries[key] if p != owner_pid and alive(p)]
            if holders:
                entries[key] = holders
                continue
            path = Path(key)
            try:
                if path.is_dir() and not path.is_symlink():
                    path.rmdir()  # only when empty
                elif path.exists() and path.stat().st_size == 0:
                    path.unlink()
            except OSError:
                pass  # in use (mounted in a live namespace) or not empty: leave it
            if not path.exists():
                removed.append(key)
            del entries[key]
    return removed
