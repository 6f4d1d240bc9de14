"""`tokenfleet fetch`: download an hf:// model into a verified cache (run by a pod's init container).

Exit 0 with PATH pointing at the model; exit 1 after writing one short reason to --termination-log (what
`kubectl describe pod` shows) and to stderr. The kubelet restarts a failed init container with its own
back-off, so the attempts here only cover blips.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import suppress
from pathlib import Path

from tokenfleet.runtime.model.fetch import FetchError, fetch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenfleet fetch", description=__doc__.splitlines()[0])
    p.add_argument(
        "source", help="hf://ORG/NAME[@REVISION] (REVISION: a branch, tag or commit; default main)"
    )
    p.add_argument(
        "--cache-dir", required=True, type=Path, help="the cache; entries go to hf/ORG/NAME/COMMIT"
    )
    p.add_argument("--link", required=True, type=Path, help="made a symlink to the entry")
    p.add_argument("--attempts", type=int, default=5, help="tries of a transient failure (default 5)")
    p.add_argument(
        "--backoff-seconds", type=float, default=2.0, help="wait after the first failure; doubles, at most 60"
    )
    p.add_argument(
        "--termination-log",
        default="/dev/termination-log",
        help="where the failure reason goes (skipped if it cannot be written)",
    )
    return p


def write_termination_log(path: str, reason: str) -> None:
    # Outside Kubernetes the default path does not exist: the reason is on stderr anyway.
    if path:
        with suppress(OSError):
            Path(path).write_text(reason + "\n")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        fetch(args.source, args.cache_dir, args.link, args.attempts, args.backoff_seconds)
    except FetchError as e:
        write_termination_log(args.termination_log, e.reason)
        print(f"tokenfleet fetch: {e.reason}", file=sys.stderr, flush=True)
        return 1
    return 0
