"""`tokenfleet fetch` against a fake Hub on loopback: the real huggingface_hub client, our cache on disk.

The fake (e2e/fake_hub.py, loaded by path: the e2e cluster's pods download from the same one) serves what
huggingface_hub 2.4.0 asks for and counts every request.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenfleet.runtime.model import fetch_cli
from tokenfleet.runtime.model.fetch import MANIFEST, FetchError, fetch, parse_source
from tokenfleet.runtime.model.fetch_progress import format_progress, last_progress, parse_progress

from .hub_client import FakeHub, FakeRepo, client_pointed_at, hub_env, serve_hub

REPO = "org/model"
COMMIT = "a" * 40
TOKEN = "hf_secretTokenValue123"
MODEL = "model.safetensors"


def _repo(private: bool = False, commit: str = COMMIT) -> FakeRepo:
    rng = random.Random(7)
    files = {
        "config.json": json.dumps({"model_type": "llama", "hidden_size": 64}).encode(),
        MODEL: rng.randbytes(1 << 20),
        "tokenizer/vocab.json": b'{"a": 0, "b": 1}',
    }
    return FakeRepo(commit, files, frozenset({MODEL}), private)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    fake = FakeHub({REPO: _repo(), "org/private": _repo(private=True)}, token=TOKEN)
    server = serve_hub(fake)
    with client_pointed_at(monkeypatch, fake.url, tmp_path):
        yield fake
    server.shutdown()
    server.server_close()


class Run:
    """One in-process fetch's log and back-off sleeps."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.sleeps: list[float] = []

    def __call__(self, tmp_path: Path, source: str = f"hf://{REPO}", link: str = "model", **kw: object):
        return fetch(
            source, tmp_path / "cache", tmp_path / link, sleep=self.sleeps.append, log=self.lines.append, **kw
        )  # type: ignore[arg-type]

    def progress(self) -> list[dict[str, object]]:
        return [p for p in map(parse_progress, self.lines) if p is not None]

    def phases(self, phase: str) -> list[dict[str, object]]:
        return [p for p in self.progress() if p["phase"] == phase]


def _entry(tmp_path: Path, commit: str = COMMIT) -> Path:
    return tmp_path / "cache" / "hf" / REPO / commit


def _assert_intact(tmp_path: Path, hub: FakeHub, link: str = "model") -> None:
    for name, data in hub.repos[REPO].files.items():
        assert (tmp_path / link / name).read_bytes() == data, name


# ------------------------------------------------------------------------------------------------------ tests
def test_cli_fetches_verifies_and_links(hub: FakeHub, tmp_path: Path) -> None:
    # The real command in its own process, configured only through the environment, as in a pod.
    termination = tmp_path / "termination-log"
    env = {**os.environ, **hub_env(hub.url, tmp_path)}
    env.pop("HF_TOKEN", None)
    argv = [
        "fetch",
        f"hf://{REPO}",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--link",
        str(tmp_path / "model"),
    ]
    argv += ["--work-dir", "deployments/team-a/chat"]  # the serving container's own part of the cache
    proc = subprocess.run(
        [sys.executable, "-m", "tokenfleet.runtime.cli", *argv, "--termination-log", str(termination)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    entry = _entry(tmp_path)
    assert os.readlink(tmp_path / "model") == str(entry)
    _assert_intact(tmp_path, hub)
    assert (tmp_path / "cache" / "deployments" / "team-a" / "chat").is_dir()
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["commit"] == COMMIT
    files = {f["name"]: f for f in manifest["files"]}
    assert files.keys() == hub.repos[REPO].files.keys()
    model = hub.repos[REPO].files[MODEL]
    assert files[MODEL] == {"name": MODEL, "size": len(model), "sha256": hashlib.sha256(model).hexdigest()}
    # Only the repository's files and the manifest: huggingface_hub's metadata folder is gone.
    on_disk = {str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file()}
    assert on_disk == {*hub.repos[REPO].files, MANIFEST}
    progress = [p for p in map(parse_progress, proc.stdout.splitlines()) if p is not None]
    assert progress[0]["phase"] == "resolve"
    assert {"resolve", "download", "verify", "done"} <= {p["phase"] for p in progress}
    done = last_progress(proc.stdout)
    assert (
        done is not None
        and done["cache"] == "miss"
        and done["bytes"] == sum(map(len, hub.repos[REPO].files.values()))
    )
    assert all(hub.gets(name) == 1 for name in hub.repos[REPO].files)
    assert not termination.exists()


def test_cli_answers_ready_with_its_progress_while_it_downloads(hub: FakeHub, tmp_path: Path) -> None:
    # The pod's HTTP port during the init container: 503 and how far the download is; free again after.
    hub.get_delay_s = 3.0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **hub_env(hub.url, tmp_path)}
    argv = ["fetch", f"hf://{REPO}", "--cache-dir", str(tmp_path / "cache"), "--link", str(tmp_path / "model"),
            "--status-port", str(port), "--status-host", "127.0.0.1"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet.runtime.cli", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    answers: list[dict] = []
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2)
            except urllib.error.HTTPError as e:
                assert e.code == 503
                answers.append(json.loads(e.read()))
            except OSError:
                pass  # not listening yet, or already closed
            time.sleep(0.1)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert answers and all(a["status"] == "fetching" for a in answers)
    assert "download" in {a["progress"]["phase"] for a in answers}, answers
    with pytest.raises(OSError):  # closed before the fetch exits: the server can take the port
        urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2)


def test_second_fetch_is_a_cache_hit_without_file_requests(hub: FakeHub, tmp_path: Path) -> None:
    assert not Run()(tmp_path).hit
    before = hub.requests.copy()
    again = Run()
    result = again(tmp_path, link="other")
    assert result.hit and result.downloaded == 0
    assert hub.requests - before == Counter({("GET", "api"): 1})  # the resolve, no HEAD, no file GET
    assert again.phases("done")[-1]["cache"] == "hit"
    assert again.phases("verify")[-1]["ok"] is True
    _assert_intact(tmp_path, hub, link="other")


def test_a_flipped_byte_is_detected_and_downloaded_again(hub: FakeHub, tmp_path: Path) -> None:
    Run()(tmp_path)
    path = _entry(tmp_path) / MODEL
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    run = Run()
    result = run(tmp_path)
    assert not result.hit
    failed = [p for p in run.phases("verify") if p.get("action")]
    assert failed and any(MODEL in problem and "sha256" in problem for problem in failed[0]["problems"])
    assert hub.gets(MODEL) == 2
    _assert_intact(tmp_path, hub)
    assert Run()(tmp_path).hit


def test_a_partial_entry_is_completed(hub: FakeHub, tmp_path: Path) -> None:
    Run()(tmp_path)
    entry = _entry(tmp_path)
    (entry / MANIFEST).unlink()  # as a download killed before its end leaves it
    with (entry / MODEL).open("r+b") as f:
        f.truncate(1000)
    run = Run()
    assert not run(tmp_path).hit
    assert run.phases("verify")[0].get("partial") is True
    assert hub.gets(MODEL) == 2 and hub.gets("config.json") == 1  # only the damaged file again
    _assert_intact(tmp_path, hub)
    assert (entry / MANIFEST).exists()


def test_missing_repository_fails_at_once(hub: FakeHub, tmp_path: Path) -> None:
    termination = tmp_path / "termination-log"
    argv = [f"hf://{REPO}-gone", "--cache-dir", str(tmp_path / "cache"), "--link", str(tmp_path / "m")]
    assert fetch_cli.main([*argv, "--termination-log", str(termination)]) == 1
    reason = termination.read_text().strip()
    assert "not found" in reason and f"{REPO}-gone" in reason and len(reason) <= 300
    assert hub.requests == Counter({("GET", "api"): 1})
    run = Run()
    with pytest.raises(FetchError) as failure:
        run(tmp_path, source=f"hf://{REPO}@no-such-branch")
    assert not failure.value.transient and "revision 'no-such-branch' not found" in failure.value.reason
    assert run.sleeps == []
    assert run.phases("failed")[0]["reason"] == failure.value.reason


def test_private_repository_without_token_names_the_secret(hub: FakeHub, tmp_path: Path) -> None:
    termination = tmp_path / "termination-log"
    argv = ["hf://org/private", "--cache-dir", str(tmp_path / "cache"), "--link", str(tmp_path / "m")]
    assert fetch_cli.main([*argv, "--termination-log", str(termination)]) == 1
    reason = termination.read_text()
    assert "HTTP 401" in reason and "model.hfTokenSecret" in reason
    assert hub.requests == Counter({("GET", "api"): 1})  # not retried


def test_token_is_sent_and_never_shown(hub: FakeHub, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    run = Run()
    assert not run(tmp_path, source="hf://org/private").hit
    assert set(hub.auth_seen) == {f"Bearer {TOKEN}"}
    # A refused token: the reason and every line leave it out.
    hub.token = "another"
    termination = tmp_path / "termination-log"
    argv = ["hf://org/private", "--cache-dir", str(tmp_path / "c2"), "--link", str(tmp_path / "m2")]
    assert fetch_cli.main([*argv, "--termination-log", str(termination)]) == 1
    out = capsys.readouterr()
    reason = termination.read_text()
    assert "token was refused" in reason and "model.hfTokenSecret" in reason
    for text in (*run.lines, out.out, out.err, reason):
        assert TOKEN not in text


def test_transient_server_errors_are_retried_with_backoff(hub: FakeHub, tmp_path: Path) -> None:
    hub.fail_gets[MODEL] = 2
    run = Run()
    result = run(tmp_path, backoff=2.0)
    assert run.sleeps == [2.0, 4.0] and result.attempts == 3
    errors = run.phases("error")
    assert [e["retry_in"] for e in errors] == [2.0, 4.0] and "HTTP 500" in str(errors[0]["reason"])
    _assert_intact(tmp_path, hub)


def test_every_attempt_failing_ends_with_the_reason(hub: FakeHub, tmp_path: Path) -> None:
    hub.fail_gets[MODEL] = 100
    run = Run()
    with pytest.raises(FetchError) as failure:
        run(tmp_path, attempts=3, backoff=1.0)
    assert run.sleeps == [1.0, 2.0]
    assert "HTTP 500" in failure.value.reason and "gave up after 3 attempts" in failure.value.reason
    assert not (_entry(tmp_path) / MANIFEST).exists() and not (tmp_path / "model").exists()


def test_an_unreachable_hub_is_retried(hub: FakeHub, tmp_path: Path, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard: nothing listens
    run = Run()
    with pytest.raises(FetchError) as failure:
        run(tmp_path, attempts=2)
    assert failure.value.transient and "cannot reach the Hub at http://127.0.0.1:9" in failure.value.reason
    assert run.sleeps == [2.0]


def test_backoff_is_capped(hub: FakeHub, tmp_path: Path) -> None:
    hub.fail_gets[MODEL] = 100
    run = Run()
    with pytest.raises(FetchError):
        run(tmp_path, attempts=4, backoff=20.0)
    assert run.sleeps == [20.0, 40.0, 60.0]


def test_concurrent_fetches_download_once(hub: FakeHub, tmp_path: Path) -> None:
    hub.get_delay_s = 0.6  # the first download is still running when the second asks for the lock
    runs = [Run(), Run()]
    results: list[object] = [None, None]

    def go(i: int) -> None:
        results[i] = runs[i](tmp_path, link=f"model-{i}")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=30)
    assert hub.gets(MODEL) == 1
    assert sorted(r.hit for r in results) == [False, True]  # type: ignore[attr-defined]
    waiter = runs[[r.hit for r in results].index(True)]  # type: ignore[attr-defined]
    assert waiter.phases("wait") and waiter.phases("wait")[-1].get("acquired") is True
    for i in range(2):
        _assert_intact(tmp_path, hub, link=f"model-{i}")


def test_a_new_commit_gets_its_own_entry_and_the_link_follows(hub: FakeHub, tmp_path: Path) -> None:
    Run()(tmp_path)
    hub.repos[REPO] = _repo(commit="b" * 40)
    hub.repos[REPO].files["config.json"] = b'{"model_type": "llama", "hidden_size": 128}'
    assert Run()(tmp_path).commit == "b" * 40
    assert os.readlink(tmp_path / "model") == str(_entry(tmp_path, "b" * 40))
    _assert_intact(tmp_path, hub)
    assert (_entry(tmp_path) / MANIFEST).exists()  # the old entry stays for pods still pinned to it


# ------------------------------------------------------------------------------------------------ line format
def test_progress_lines_round_trip_and_ignore_other_lines() -> None:
    line = format_progress(phase="download", bytes=1, total=4, percent=25.0, file="m")
    assert line.startswith("fetch: ")
    assert parse_progress(line) == {"phase": "download", "bytes": 1, "total": 4, "percent": 25.0, "file": "m"}
    assert parse_progress("2024-05-01T10:00:00.000Z " + line)["phase"] == "download"  # type: ignore[index]
    for other in ("", "hello", "fetch: not json", 'fetch: {"no": "phase"}', "a b " + line, "fetch: [1]"):
        assert parse_progress(other) is None
    assert last_progress(f"{line}\nnoise\n") == parse_progress(line)
    assert last_progress("noise") is None


@pytest.mark.parametrize("source", ["org/model", "hf://org", "hf://org/../x", "hf://o/m@", "s3://o/m"])
def test_bad_sources_are_refused(source: str) -> None:
    with pytest.raises(FetchError) as failure:
        parse_source(source)
    assert not failure.value.transient


def test_revision_defaults_to_main() -> None:
    assert parse_source("hf://org/m").revision == "main"
    assert parse_source("hf://org/m@refs/pr/1").revision == "refs/pr/1"


def test_a_cache_the_pod_cannot_write_fails_at_once_with_the_reason() -> None:
    # A hostPath the kubelet created belongs to root; the pods run as uid 1000. No retry can fix that.
    from tokenfleet.runtime.model.fetch import classify

    try:
        raise OSError("download failed") from PermissionError(
            13, "Permission denied", "/var/cache/tokenfleet/hf"
        )
    except OSError as e:
        failure = classify(e, parse_source(f"hf://{REPO}"))
    assert not failure.transient
    assert "/var/cache/tokenfleet/hf" in failure.reason and "writable" in failure.reason


@pytest.mark.parametrize("work_dir", ["/etc/tokenfleet", "deployments/../../etc"])
def test_a_work_dir_outside_the_cache_is_refused(tmp_path: Path, work_dir: str) -> None:
    termination = tmp_path / "termination-log"
    argv = ["hf://org/model", "--cache-dir", str(tmp_path / "cache"), "--link", str(tmp_path / "model")]
    assert fetch_cli.main([*argv, "--work-dir", work_dir, "--termination-log", str(termination)]) == 1
    assert "a relative path inside the cache" in termination.read_text()
    assert not (tmp_path / "cache").exists()
