"""What the image ships, built without Docker: the wheel the Dockerfile's build stage makes, installed into a
venv of its own.

The build stage copies a few paths into its WORKDIR and runs `pip wheel .` there. A path it forgets is
missing from the image only: the checkout and its editable install still have it, so every test run from
the checkout passes. Hence the stage is read from the Dockerfile itself (the build stage's COPY lines, no
list kept here), staged into a directory, built the way the stage builds it (`pip wheel --no-deps`, here
without build isolation: no network), and installed with `--no-deps` into a fresh venv.

The venv borrows the pinned dependencies of the interpreter running this (torch alone is ~3 GB) through a
`.pth` file listing that interpreter's site directories — never the checkout: `tokenfleet` in the venv is
the wheel's. `tests/test_image_payload.py` runs the payload's entry points; the e2e session runs its pods
and the operator from `cached_payload()`, built once per content of the staged tree.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenfleet" / "payload"
BUILD_STAGE = "build"
DEPENDENCIES_PTH = "zz_image_dependencies.pth"
# A payload unused this long is removed by the next build (each use refreshes its stamp).
STALE_SECONDS = 3 * 24 * 3600
# Never part of a build context's meaning: caches the checkout accumulates (and Docker would copy too).
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


class PayloadError(RuntimeError):
    """The Dockerfile's build stage cannot be staged, or the wheel cannot be built or installed."""


@dataclass(frozen=True, slots=True)
class Copy:
    """One `COPY src... dest` of the build stage; `dest` is relative to the stage's WORKDIR."""

    sources: tuple[str, ...]
    dest: str

    @property
    def into_directory(self) -> bool:
        return len(self.sources) > 1 or self.dest.endswith("/") or self.dest in (".", "./")


def build_stage_copies(dockerfile: str, stage: str = BUILD_STAGE) -> list[Copy]:
    """The COPY instructions of the stage `FROM ... AS <stage>`, destinations relative to its WORKDIR."""
    lines: list[str] = []
    pending = ""
    for raw in dockerfile.splitlines():
        if raw.lstrip().startswith("#") or not (pending or raw.strip()):  # comments go, even mid-instruction
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        lines.append(pending + raw)
        pending = ""
    current, workdir, copies, found = None, PurePosixPath("/"), [], False
    for line in lines:
        op = line.split(None, 1)[0].upper()
        if op not in ("FROM", "WORKDIR", "COPY", "ADD"):
            continue
        args = shlex.split(line)[1:]
        if op == "FROM":
            current = args[2] if len(args) >= 3 and args[1].upper() == "AS" else None
            workdir = PurePosixPath("/")
            found = found or current == stage
        elif current != stage:
            continue
        elif op == "WORKDIR":
            workdir = workdir / args[0]
        elif op in ("COPY", "ADD"):
            if line.split(None, 1)[1].lstrip().startswith("["):
                raise PayloadError(f"{op} in JSON form is not supported here: {line!r}")
            flags = [a for a in args if a.startswith("--")]
            if any(f.startswith("--from") for f in flags) or op == "ADD":
                raise PayloadError(f"the build stage must take its files from the context by COPY: {line!r}")
            paths = [a for a in args if not a.startswith("--")]
            if len(paths) < 2:
                raise PayloadError(f"COPY needs a source and a destination: {line!r}")
            dest = PurePosixPath(paths[-1])
            if dest.is_absolute():
                if not dest.is_relative_to(workdir):
                    raise PayloadError(f"COPY outside the build's WORKDIR {workdir}: {line!r}")
                rel = str(dest.relative_to(workdir))
            else:
                rel = paths[-1]
            if paths[-1].endswith("/") and not rel.endswith("/"):
                rel += "/"
            copies.append(Copy(tuple(paths[:-1]), rel))
    if not found:
        raise PayloadError(f"the Dockerfile has no stage `FROM ... AS {stage}`")
    return copies


def stage_context(repo: Path, dest: Path, dockerfile: Path | None = None) -> list[Copy]:
    """Copy into `dest` exactly what the build stage's COPY lines put in its WORKDIR (Docker's rules: a
    directory's contents go into the destination; a file goes into a destination ending in `/`)."""
    if (repo / ".dockerignore").exists():
        # Docker would leave out what it names; staging everything would test another image.
        raise PayloadError(f"{repo / '.dockerignore'} exists: stage_context does not apply it yet")
    copies = build_stage_copies((dockerfile or repo / "Dockerfile").read_text())
    dest.mkdir(parents=True, exist_ok=True)
    for copy in copies:
        target = dest / copy.dest
        for pattern in copy.sources:
            matches = sorted(glob.glob(pattern, root_dir=repo))
            if not matches:
                raise PayloadError(f"COPY {pattern}: no such file in the build context {repo}")
            for match in matches:
                source = (repo / match).resolve()
                if not source.is_relative_to(repo.resolve()):
                    raise PayloadError(f"COPY {pattern}: outside the build context")
                if source.is_dir():
                    shutil.copytree(source, target, ignore=_IGNORED, dirs_exist_ok=True)
                elif copy.into_directory:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, target / source.name)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, target)
    return copies


def tree_digest(root: Path) -> str:
    """sha256 over every file's relative path and bytes, in a fixed order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _run(cmd: list[str], cwd: Path) -> str:
    # cwd is never the checkout or the context: Python puts it on sys.path, and a top-level `operator/`
    # there would shadow the stdlib module.
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise PayloadError(
            f"{shlex.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    return out.stdout


def build_wheel(context: Path, wheel_dir: Path, python: str = sys.executable) -> Path:
    """`pip wheel --no-deps` of the staged context, as the build stage runs it; returns the wheel."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    _run(
        [python, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(wheel_dir), str(context)],
        cwd=wheel_dir,
    )  # fmt: skip
    wheels = sorted(wheel_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise PayloadError(f"expected one wheel in {wheel_dir}, found {[w.name for w in wheels]}")
    return wheels[0]


def dependency_paths(python: str = sys.executable, exclude: Path = REPO) -> list[str]:
    """The site directories `python` adds to the bare interpreter's path (site-packages and what their
    .pth files add), in order, with anything inside `exclude` (the checkout) left out."""
    show = "import json, sys; print(json.dumps(sys.path))"
    neutral = Path(tempfile.gettempdir())
    with_site = json.loads(_run([python, "-c", show], cwd=neutral))
    bare = set(json.loads(_run([python, "-S", "-c", show], cwd=neutral)))
    root = exclude.resolve()
    return [
        p for p in with_site
        if p and p not in bare and Path(p).is_dir() and not Path(p).resolve().is_relative_to(root)
    ]  # fmt: skip


def install_payload(wheel: Path, venv: Path, python: str = sys.executable, exclude: Path = REPO) -> Path:
    """A new venv at `venv` holding `wheel` (no dependencies installed: a .pth lists `python`'s site
    directories, the checkout excluded). Returns the venv."""
    _run([python, "-m", "venv", "--without-pip", str(venv)], cwd=venv.parent)
    venv_python = str(venv / "bin" / "python")
    site = Path(_run([venv_python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=venv).strip())  # fmt: skip
    (site / DEPENDENCIES_PTH).write_text("".join(f"{p}\n" for p in dependency_paths(python, exclude)))
    # --ignore-installed: the borrowed site directories may hold another `tokenfleet` (an editable
    # install); pip must neither uninstall it nor skip installing the wheel because of it.
    _run(
        [venv_python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--ignore-installed",
         str(wheel)],
        cwd=venv,
    )  # fmt: skip
    return venv


def image_paths(venv: Path) -> list[str]:
    """What a container built from this payload would hold: the venv and the site directories it borrows."""
    site = next(venv.glob(f"lib/python*/site-packages/{DEPENDENCIES_PTH}"), None)
    borrowed = site.read_text().split() if site else []
    return [str(venv), *borrowed]


@contextlib.contextmanager
def _locked(path: Path, blocking: bool = True) -> Iterator[bool]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True


def _prune(cache: Path, keep: Path) -> None:
    """Remove payloads nobody used for STALE_SECONDS, and half-built ones (a build that was killed) older
    than an hour, unless a session holds their lock. The empty lock files stay: removing one while another
    session opens it would let two sessions hold "the" lock."""
    for entry in cache.iterdir():
        if not entry.is_dir() or entry == keep:
            continue
        stamp = entry / ".complete"
        complete = stamp.exists()
        age = time.time() - (stamp if complete else entry).stat().st_mtime
        if age < (STALE_SECONDS if complete else 3600):
            continue
        with _locked(cache / f"{entry.name}.lock", blocking=False) as mine:
            if mine:
                shutil.rmtree(entry, ignore_errors=True)


def cached_payload(repo: Path = REPO, cache: Path = CACHE, python: str = sys.executable) -> Path:
    """The payload venv for the checkout's current content, built once and reused while the staged tree,
    the interpreter and its dependency paths are unchanged. Safe against concurrent sessions (a file lock
    per key). A venv's scripts name its absolute path, so it is built in place, then marked complete."""
    with tempfile.TemporaryDirectory(prefix="tokenfleet-payload-") as tmp:
        context = Path(tmp) / "context"
        stage_context(repo, context)
        key_source = json.dumps([tree_digest(context), sys.version, python, dependency_paths(python, repo)])
        key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
        venv = cache / key
        with _locked(cache / f"{key}.lock"):
            stamp = venv / ".complete"
            if not stamp.exists():
                shutil.rmtree(venv, ignore_errors=True)
                venv.parent.mkdir(parents=True, exist_ok=True)
                install_payload(build_wheel(context, Path(tmp) / "wheels", python), venv, python, repo)
            stamp.touch()
        _prune(cache, keep=venv)
    return venv
