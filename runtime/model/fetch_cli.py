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

from tokenfleet.runtime.model.fetch import FetchError, fetch, print_line
from tokenfleet.runtime.model.fetch_progress import parse_progress
from tokenfleet.runtime.model.fetch_status_server import FetchStatusServer


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
        "--status-port",
        type=int,
        default=None,
        help="answer GET /ready and /health on this port with 503 and the latest progress while fetching "
        "(the pod's HTTP port: the operator shows it in the ModelDeployment's status.loading)",
    )
    p.add_argument("--status-host", default="0.0.0.0", help="address for --status-port (default 0.0.0.0)")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="a directory inside the cache to create for the serving container (its converted weights "
        "and compile caches, mounted alone and writable there; this container alone writes the cache root)",
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


def make_work_dir(cache_dir: Path, work_dir: Path) -> Path:
    """`cache_dir/work_dir`, created with its parents by this (non-root) user, so that the kubelet finds it
    when it mounts it as a subPath (one it had to create itself would belong to root)."""
    if work_dir.is_absolute() or ".." in work_dir.parts:
        raise FetchError(
            f"--work-dir {work_dir}: a relative path inside the cache, without '..'", transient=False
        )
    path = cache_dir / work_dir
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(
            f"the cache's work directory {path} cannot be created: {e.strerror}", transient=False
        ) from None
    return path


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    status = FetchStatusServer(args.status_host, args.status_port) if args.status_port is not None else None

    def log(line: str) -> None:
        print_line(line)
        fields = parse_progress(line) if status is not None else None
        if fields is not None:
            status.update(fields)

    try:
        if args.work_dir is not None:
            make_work_dir(args.cache_dir, args.work_dir)
        fetch(args.source, args.cache_dir, args.link, args.attempts, args.backoff_seconds, log=log)
    except FetchError as e:
        write_termination_log(args.termination_log, e.reason)
        print(f"tokenfleet fetch: {e.reason}", file=sys.stderr, flush=True)
        return 1
    finally:
        if status is not None:
            status.close()  # the port is the server's next
    return 0
