"""Download an `hf://ORG/NAME[@REVISION]` model into a cache whose entries are verified by digest.

Layout under the cache directory (a node's hostPath, a claim, or an emptyDir):

    hf/ORG/NAME/<commit sha>/                       the repository's files at that commit
    hf/ORG/NAME/<commit sha>/.tokenfleet-manifest.json  every file's name, size and sha256; written last
    hf/ORG/NAME/<commit sha>.lock                   held for the whole check + download

An entry is complete only when its manifest exists; a directory without one is what a killed download
leaves, and is completed rather than started over. A complete entry is still re-hashed before each use: a
cache on a node outlives the pods that wrote it, and nothing else would notice a file damaged since.

huggingface_hub does the HTTP (it reads HF_ENDPOINT and HF_TOKEN itself) and is imported inside the
functions that need it: the operator's image, which imports nothing of this module, does not ship it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tokenfleet.runtime.model.fetch_progress import format_progress

MANIFEST = ".tokenfleet-manifest.json"
MANIFEST_VERSION = 1
# Where hf_hub_download keeps its per-file metadata inside a local_dir; removed once the entry is complete.
HF_LOCAL_METADATA = (".cache", "huggingface")
PROGRESS_INTERVAL_S = 2.0
MAX_BACKOFF_S = 60.0
LOCK_POLL_S = 0.2
HASH_CHUNK = 8 << 20  # large reads: hashlib releases the GIL per update, so threads hash in parallel
DOWNLOAD_WORKERS = 4  # files downloaded at once (huggingface_hub's snapshot_download uses 8)
REASON_MAX = 300  # a termination message is shown in `kubectl describe`: one short line

_SOURCE_RE = re.compile(r"^hf://([A-Za-z0-9._-]+/[A-Za-z0-9._-]+)(?:@([A-Za-z0-9._/-]+))?$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")

Log = Callable[[str], None]
Clock = Callable[[], float]


@dataclass(frozen=True)
class Fields:
    """The settings a failure's reason tells the user to check (a model's, or an adapter's)."""

    token: str = "model.hfTokenSecret"
    source: str = "model.source"


MODEL_FIELDS = Fields()


class FetchError(Exception):
    """A failed attempt: `reason` is one human-readable line; `transient` failures are retried."""

    def __init__(self, reason: str, *, transient: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.transient = transient


@dataclass(frozen=True, slots=True)
class HfSource:
    repo: str  # ORG/NAME
    revision: str  # a branch, a tag or a commit sha


@dataclass(frozen=True, slots=True)
class EntryFile:
    """A file an entry must hold, and what it must hash to."""

    name: str  # relative to the entry, "/"-separated
    size: int | None
    sha256: str | None = None  # LFS files (the Hub's lfs.sha256) and every file of a manifest
    blob_id: str | None = None  # files stored in git itself: the git blob id, sha1(b"blob N\0" + content)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A revision resolved to its commit, with the commit's files."""

    repo: str
    revision: str
    commit: str
    files: tuple[EntryFile, ...]

    @property
    def total(self) -> int:
        return sum(f.size or 0 for f in self.files)


@dataclass(frozen=True, slots=True)
class Fetched:
    entry: Path
    commit: str
    hit: bool  # the entry was complete and intact: nothing was downloaded
    downloaded: int  # bytes
    attempts: int


# ------------------------------------------------------------------------------------------------ source
def parse_source(source: str) -> HfSource:
    match = _SOURCE_RE.match(source)
    if match is None:
        raise FetchError(f"{source!r} is not an hf://ORG/NAME[@REVISION] source", transient=False)
    repo, revision = match.group(1), match.group(2) or "main"
    if any(part in (".", "..") for part in repo.split("/")):
        raise FetchError(f"{source!r}: '.' and '..' are not repository names", transient=False)
    return HfSource(repo, revision)


def resolve(source: HfSource) -> Snapshot:
    """The revision's commit and files, from one model_info request."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(source.repo, revision=source.revision, files_metadata=True)
    commit = info.sha or ""
    if not _COMMIT_RE.match(commit):  # it names a directory: never trust it as a path
        raise FetchError(
            f"hf://{source.repo}: the Hub gave no commit sha for {source.revision!r}", transient=True
        )
    files = []
    for sibling in info.siblings or []:
        _check_name(sibling.rfilename)
        lfs = sibling.lfs
        files.append(
            EntryFile(
                name=sibling.rfilename,
                size=lfs.size if lfs is not None else sibling.size,
                sha256=lfs.sha256 if lfs is not None else None,
                blob_id=None if lfs is not None else sibling.blob_id,  # an LFS blob id hashes the pointer
            )
        )
    if not files:
        raise FetchError(f"hf://{source.repo}@{source.revision} has no files", transient=False)
    return Snapshot(source.repo, source.revision, commit, tuple(sorted(files, key=lambda f: f.name)))


def _check_name(name: str) -> None:
    # File names come from the server and become paths under the entry: none may leave it, or replace
    # the manifest or huggingface_hub's metadata.
    path = PurePosixPath(name)
    if (
        not name
        or path.is_absolute()
        or any(part in ("", ".", "..") for part in name.split("/"))
        or name == MANIFEST
        or path.parts[:2] == HF_LOCAL_METADATA
    ):
        raise FetchError(f"the Hub listed a file named {name!r}, which is not a safe path", transient=False)


def entry_dir(cache_dir: Path, snapshot: Snapshot) -> Path:
    return cache_dir / "hf" / snapshot.repo / snapshot.commit


# ---------------------------------------------------------------------------------------------- progress
class Progress:
    """Throttled progress lines for one phase: at most one every PROGRESS_INTERVAL_S, then the last."""

    def __init__(self, log: Log, phase: str, total: int, clock: Clock = time.monotonic) -> None:
        self._log, self._phase, self._clock = log, phase, clock
        self._lock = threading.Lock()
        self._start = self._last = clock()
        self.total = total
        self.bytes = 0
        self.file: str | None = None

    def add(self, n: int, file: str | None = None) -> None:
        with self._lock:  # download and hash threads share one count
            self.bytes += n
            self.file = file or self.file
            now = self._clock()
            if now - self._last < PROGRESS_INTERVAL_S:
                return
            self._last = now
            self._log(self.line())

    def finish(self, **fields: object) -> None:
        with self._lock:
            self.file = None  # the phase's last line sums it up: no file in particular
            self._log(self.line(seconds=round(self._clock() - self._start, 3), **fields))

    def line(self, **fields: object) -> str:
        percent = 100.0 if not self.total else min(100.0, round(100.0 * self.bytes / self.total, 1))
        base: dict[str, object] = {"phase": self._phase, "bytes": self.bytes, "total": self.total}
        base["percent"] = percent
        if self.file is not None:
            base["file"] = self.file
        return format_progress(**base, **fields)


class _Bar:
    """What huggingface_hub drives as its `tqdm_class`: counts the bytes written into a Progress.

    Not a tqdm: huggingface_hub then calls it with the bar's settings only and draws nothing. A subclass
    per file (`_bar_class`) carries the Progress and the file's name, since huggingface_hub names the
    bar after the URL.
    """

    progress: Progress
    file: str

    def __init__(self, *args: object, total: int | None = None, initial: int = 0, **kwargs: object) -> None:
        self.total = total
        self.n = initial

    def update(self, n: float | None = 1) -> None:
        n = int(n or 0)
        self.n += n
        self.progress.add(n, self.file)

    # Xet downloads also report network bytes; those written to disk (update) are what counts.
    def update_transfer(self, n: float | None = 1) -> None:
        pass

    def set_postfix_str(self, *args: object, **kwargs: object) -> None:
        pass

    def set_transfer_postfix_str(self, *args: object, **kwargs: object) -> None:
        pass

    def refresh(self, *args: object, **kwargs: object) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bar_class(progress: Progress, file: str) -> type[_Bar]:
    # A class, not a partial: huggingface_hub looks for `update_transfer` on the class itself.
    return type("_FileBar", (_Bar,), {"progress": progress, "file": file})


# ------------------------------------------------------------------------------------------------ verify
Problem = tuple[str, str]  # (file name, what is wrong with it)


def _digest(path: Path, git_blob: bool, progress: Progress, name: str) -> tuple[str, str | None]:
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    sha1 = hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False) if git_blob else None
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            sha256.update(chunk)
            if sha1 is not None:
                sha1.update(chunk)
            progress.add(len(chunk), name)
    return sha256.hexdigest(), sha1.hexdigest() if sha1 is not None else None


def verify_files(
    entry: Path, files: Sequence[EntryFile], log: Log, clock: Clock = time.monotonic
) -> tuple[dict[str, str], list[Problem]]:
    """Check every file's size, then (only when all sizes match) its digests, hashing files in parallel.

    Returns each file's sha256 and the problems found; an empty list means the entry is intact.
    """
    problems: list[Problem] = []
    for f in files:
        path = entry / f.name
        if not path.is_file():
            problems.append((f.name, "missing"))
        elif f.size is not None and (size := path.stat().st_size) != f.size:
            problems.append((f.name, f"size {size}, expected {f.size}"))
    if problems:  # a size already condemns the entry: hashing the rest would only cost time
        return {}, problems

    progress = Progress(log, "verify", sum((entry / f.name).stat().st_size for f in files), clock)
    workers = max(1, min(len(files), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers, thread_name_prefix="fetch-hash") as pool:
        digests = list(
            pool.map(lambda f: _digest(entry / f.name, f.blob_id is not None, progress, f.name), files)
        )
    sums: dict[str, str] = {}
    for f, (sha256, blob_id) in zip(files, digests, strict=True):
        sums[f.name] = sha256
        if f.sha256 is not None and sha256 != f.sha256:
            problems.append((f.name, f"sha256 {sha256[:12]}…, expected {f.sha256[:12]}…"))
        elif f.blob_id is not None and blob_id != f.blob_id:
            problems.append((f.name, f"git blob id {(blob_id or '')[:12]}…, expected {f.blob_id[:12]}…"))
    shown = {"problems": [f"{name}: {what}" for name, what in problems[:10]]} if problems else {}
    progress.finish(ok=not problems, files=len(files), **shown)
    return sums, problems


def read_manifest(entry: Path) -> dict[str, object] | None:
    """The entry's manifest, or None when it has none (a partial entry). Raises ValueError if unreadable."""
    try:
        text = (entry / MANIFEST).read_text()
    except FileNotFoundError:
        return None
    manifest = json.loads(text)  # json.JSONDecodeError is a ValueError
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise ValueError("not a manifest")
    return manifest


def manifest_files(manifest: dict[str, object]) -> list[EntryFile]:
    files = manifest["files"]
    assert isinstance(files, list)
    return [EntryFile(str(f["name"]), int(f["size"]), str(f["sha256"])) for f in files]


def verify_entry(entry: Path, snapshot: Snapshot, log: Log, clock: Clock = time.monotonic) -> list[Problem]:
    """The problems of an entry that has a manifest; empty when every file is as the manifest says."""
    try:
        manifest = read_manifest(entry)
        assert manifest is not None
        files = manifest_files(manifest)
    except (ValueError, KeyError, TypeError) as e:
        return [(MANIFEST, f"unreadable ({e})")]
    if manifest.get("commit") != snapshot.commit:
        return [(MANIFEST, f"commit {manifest.get('commit')!r}, expected {snapshot.commit}")]
    # The manifest must list the commit's files, with the Hub's sizes: a manifest is only written after
    # the download was checked against the Hub, so a difference means it was tampered with.
    expected = {f.name: f.size for f in snapshot.files}
    listed = {f.name: f.size for f in files}
    if listed.keys() != expected.keys():
        missing = sorted(expected.keys() - listed.keys()) or sorted(listed.keys() - expected.keys())
        return [(MANIFEST, f"lists other files than the commit's ({', '.join(missing[:3])})")]
    for name, size in expected.items():
        if size is not None and listed[name] != size:
            return [(MANIFEST, f"{name}: size {listed[name]}, the Hub says {size}")]
    return verify_files(entry, files, log, clock)[1]


def write_manifest(entry: Path, snapshot: Snapshot, sums: dict[str, str]) -> None:
    # Written last, atomically and durably: its presence is what makes an entry complete.
    manifest = {
        "version": MANIFEST_VERSION,
        "repo": snapshot.repo,
        "commit": snapshot.commit,
        "files": [
            {"name": f.name, "size": (entry / f.name).stat().st_size, "sha256": sums[f.name]}
            for f in snapshot.files
        ],
    }
    tmp = entry / f"{MANIFEST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    with tmp.open("w") as out:
        json.dump(manifest, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, entry / MANIFEST)


# ---------------------------------------------------------------------------------------------- download
def download(snapshot: Snapshot, entry: Path, log: Log, clock: Clock = time.monotonic) -> int:
    """Download every file of the snapshot the entry lacks; returns the bytes downloaded.

    A file already there with the Hub's size is kept (a killed download leaves whole files: huggingface_hub
    writes each under a temporary name, then renames it); the verification that follows hashes it anyway.
    """
    from huggingface_hub import hf_hub_download

    todo: list[EntryFile] = []
    for f in snapshot.files:
        path = entry / f.name
        if path.is_file() and f.size is not None and path.stat().st_size == f.size:
            continue
        # huggingface_hub would keep a file of the wrong size whose metadata names this commit, unread.
        if path.is_file() or path.is_symlink():
            path.unlink()
        todo.append(f)
    progress = Progress(log, "download", sum(f.size or 0 for f in todo), clock)
    log(progress.line(files=len(todo), kept=len(snapshot.files) - len(todo)))
    if not todo:
        return 0

    def one(f: EntryFile) -> None:
        hf_hub_download(
            snapshot.repo,
            f.name,
            revision=snapshot.commit,  # every file from the resolved commit, even if the branch moves
            local_dir=entry,
            tqdm_class=_bar_class(progress, f.name),  # type: ignore[arg-type]
        )

    with ThreadPoolExecutor(min(DOWNLOAD_WORKERS, len(todo)), thread_name_prefix="fetch-get") as pool:
        futures = [pool.submit(one, f) for f in todo]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [future for future in done if future.exception() is not None]
        if failed:
            # The downloads under way finish (they cannot be interrupted); the ones not begun never start.
            for future in futures:
                future.cancel()
            raise failed[0].exception()  # type: ignore[misc]
    progress.finish(files=len(todo))
    return progress.bytes


def _complete(entry: Path, snapshot: Snapshot, log: Log, clock: Clock) -> int:
    """Download what the entry lacks, verify every file against the Hub, write the manifest."""
    entry.mkdir(parents=True, exist_ok=True)
    downloaded = download(snapshot, entry, log, clock)
    sums, problems = verify_files(entry, snapshot.files, log, clock)
    if problems:
        for name, _ in problems:
            with suppress(FileNotFoundError):
                (entry / name).unlink()  # never keep a file that failed: the next attempt fetches it again
        raise FetchError(f"hf://{snapshot.repo}: downloaded {_describe(problems)}", transient=True)
    # The serving container sees the entry as the model directory: leave only the repository's files.
    metadata = entry.joinpath(*HF_LOCAL_METADATA)
    shutil.rmtree(metadata, ignore_errors=True)
    with suppress(OSError):
        metadata.parent.rmdir()  # only if huggingface_hub's folder was all it held
    write_manifest(entry, snapshot, sums)
    return downloaded


def _describe(problems: Sequence[Problem]) -> str:
    shown = "; ".join(f"{name}: {what}" for name, what in problems[:3])
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"files that failed verification: {shown}{more}"


# ---------------------------------------------------------------------------------------------- lock, link
@contextmanager
def entry_lock(path: Path, log: Log, clock: Clock = time.monotonic) -> Iterator[None]:
    """An exclusive flock on `path` for the block; waits (logging) while another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait_for_lock(fd, path, log, clock)
        yield
    finally:
        os.close(fd)  # releases the lock, also when the process is killed


def _wait_for_lock(fd: int, path: Path, log: Log, clock: Clock) -> None:
    # Polled rather than blocking, so the log shows the wait goes on; the real time.sleep, not the
    # back-off's (a test's fake sleep would spin).
    start = last = clock()
    message = "another process holds the lock: waiting for its download of this entry"
    log(format_progress(phase="wait", seconds=0.0, lock=str(path), message=message))
    while True:
        time.sleep(LOCK_POLL_S)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if clock() - last >= PROGRESS_INTERVAL_S:
                last = clock()
                log(format_progress(phase="wait", seconds=round(last - start, 1), lock=str(path)))
    log(format_progress(phase="wait", seconds=round(clock() - start, 3), lock=str(path), acquired=True))


def link(path: Path, entry: Path) -> None:
    """Point `path` at the entry, atomically: a symlink made under a temporary name, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    os.symlink(os.path.abspath(entry), tmp)
    try:
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise FetchError(
            f"cannot point --link {path} at the entry: {e.strerror or e}", transient=False
        ) from e


# --------------------------------------------------------------------------------------------- failures
def classify(exc: BaseException, source: HfSource, fields: Fields = MODEL_FIELDS) -> FetchError:
    """One failed attempt as a FetchError: its reason in one line, and whether another attempt may help."""
    if isinstance(exc, FetchError):
        return exc
    from huggingface_hub import constants, errors

    where = f"hf://{source.repo}"
    status = _http_status(exc)
    if isinstance(exc, errors.RevisionNotFoundError):
        return FetchError(f"{where}: revision {source.revision!r} not found (HTTP {status})", transient=False)
    if isinstance(exc, errors.GatedRepoError) or status in (401, 403):
        token = "the token was refused" if os.environ.get("HF_TOKEN") else "no token was given"
        return FetchError(
            f"{where}: access denied (HTTP {status}): the repository is gated, private or missing and "
            f"{token}; set {fields.token} to a Secret holding a token with access to it",
            transient=False,
        )
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return FetchError(f"{where}: a file the Hub listed is not found (HTTP {status})", transient=False)
    if isinstance(exc, errors.RepositoryNotFoundError) or status == 404:
        return FetchError(
            f"{where}: repository not found (HTTP {status}); check {fields.source}", transient=False
        )
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return FetchError(f"{where}: HF_HUB_OFFLINE is set, nothing can be downloaded", transient=False)
    if status is not None:
        transient = status in (408, 429) or status >= 500
        return FetchError(f"{where}: the Hub answered HTTP {status}", transient=transient)
    cause = _innermost(exc)
    if isinstance(cause, PermissionError):
        # A node cache the kubelet created for the hostPath belongs to root: no attempt can fix that.
        return FetchError(
            f"{where}: cannot write the cache ({cause.filename or cause}) as uid {os.getuid()}: the cache "
            "directory must be writable by the pods' user",
            transient=False,
        )
    detail = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    if isinstance(exc, errors.LocalEntryNotFoundError) or _is_network_error(cause):
        return FetchError(f"{where}: cannot reach the Hub at {constants.ENDPOINT} ({detail})", transient=True)
    # Anything else (a full disk, a reset stream, a surprise from the library): another attempt may help,
    # and the attempts are bounded.
    return FetchError(f"{where}: {detail}", transient=True)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _http_status(exc: BaseException) -> int | None:
    for e in _chain(exc):
        response = getattr(e, "response", None)
        status = getattr(response, "status_code", None)
        if isinstance(status, int):
            return status
    return None


def _innermost(exc: BaseException) -> BaseException:
    return list(_chain(exc))[-1]


def _is_network_error(exc: BaseException) -> bool:
    # httpx's transport errors (connect, read, timeouts, protocol) without importing the HTTP client
    # huggingface_hub happens to use.
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"TransportError", "TimeoutException", "NetworkError"}) or isinstance(
        exc, ConnectionError | TimeoutError
    )


def _redact(text: str) -> str:
    token = os.environ.get("HF_TOKEN", "")
    return text.replace(token, "***") if len(token) >= 4 else text


def short_reason(text: str) -> str:
    """One line of at most REASON_MAX characters, without the token."""
    line = " ".join(_redact(text).split())
    return line if len(line) <= REASON_MAX else line[: REASON_MAX - 1] + "…"


# -------------------------------------------------------------------------------------------- entry point
def print_line(line: str) -> None:
    print(line, flush=True)


def fetch(
    source: str,
    cache_dir: Path | str,
    link_path: Path | str,
    attempts: int = 5,
    backoff: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    log: Log = print_line,
    clock: Clock = time.monotonic,
    fields: Fields = MODEL_FIELDS,
) -> Fetched:
    """Fetch `source` into `cache_dir`, verify it, point `link_path` at it. Raises FetchError (its reason
    one short line, naming `fields` to check) when an attempt fails for good or the last of `attempts` fails."""

    def emit(line: str) -> None:
        log(_redact(line))  # no line ever carries the token, whatever an error message held

    start = clock()
    parsed = parse_source(source)
    cache, target = Path(cache_dir), Path(link_path)
    attempts = max(1, attempts)
    for attempt in range(1, attempts + 1):
        try:
            snapshot = resolve(parsed)
            entry = entry_dir(cache, snapshot)
            emit(
                format_progress(
                    phase="resolve",
                    repo=snapshot.repo,
                    revision=snapshot.revision,
                    commit=snapshot.commit,
                    files=len(snapshot.files),
                    total=snapshot.total,
                    attempt=attempt,
                )
            )
            with entry_lock(entry.with_name(f"{snapshot.commit}.lock"), emit, clock):
                downloaded, hit = _ensure(entry, snapshot, emit, clock)
            link(target, entry)
        except Exception as e:
            failure = classify(e, parsed, fields)
            final = not failure.transient or attempt == attempts
            if final:
                reason = (
                    failure.reason if attempt == 1 else f"{failure.reason} (gave up after {attempt} attempts)"
                )
                reason = short_reason(reason)
                emit(format_progress(phase="failed", attempt=attempt, attempts=attempts, reason=reason))
                raise FetchError(reason, transient=failure.transient) from e
            delay = min(MAX_BACKOFF_S, backoff * 2 ** (attempt - 1))
            emit(
                format_progress(
                    phase="error",
                    attempt=attempt,
                    attempts=attempts,
                    reason=short_reason(failure.reason),
                    retry_in=delay,
                )
            )
            sleep(delay)
            continue
        emit(
            format_progress(
                phase="done",
                cache="hit" if hit else "miss",
                seconds=round(clock() - start, 3),
                bytes=snapshot.total,
                downloaded=downloaded,
                commit=snapshot.commit,
                path=str(target),
                entry=str(entry),
            )
        )
        return Fetched(entry, snapshot.commit, hit, downloaded, attempt)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _ensure(entry: Path, snapshot: Snapshot, log: Log, clock: Clock) -> tuple[int, bool]:
    """Under the entry's lock: (bytes downloaded, whether the entry was a cache hit)."""
    if (entry / MANIFEST).exists():
        problems = verify_entry(entry, snapshot, log, clock)
        if not problems:
            return 0, True
        # Never serve a damaged entry, nor patch one: what else changed is unknown.
        log(
            format_progress(
                phase="verify",
                ok=False,
                problems=[f"{name}: {what}" for name, what in problems[:10]],
                action="deleting the entry and downloading it again",
            )
        )
        shutil.rmtree(entry)
    elif entry.exists():
        present = sum(1 for f in snapshot.files if (entry / f.name).is_file())
        log(
            format_progress(
                phase="verify", ok=False, partial=True, present=present, files=len(snapshot.files)
            )
        )
    return _complete(entry, snapshot, log, clock), False
