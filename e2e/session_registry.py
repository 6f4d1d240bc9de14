"""What test sessions on this machine made on the host, keyed by the pid of the session that made it.

Several sessions may share one machine, and a session killed outright (SIGKILL, out of memory) never runs
its teardown. So what a session makes outside its own temp dir (mount targets, bridges) is recorded here
under a file lock with its owner's pid, and the next session to look removes what only dead sessions held.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path("/run/tokenfleet-e2e")


@contextlib.contextmanager
def locked(name: str) -> Iterator[dict[str, Any]]:
    """The registry `name` (a JSON object), held under an exclusive lock; written back on exit, also when
    the body raised (what it changed on the host before that is recorded)."""
    ROOT.mkdir(parents=True, exist_ok=True)
    path = ROOT / f"{name}.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        try:
            yield entries
        finally:
            path.write_text(json.dumps(entries, indent=1, sort_keys=True))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
