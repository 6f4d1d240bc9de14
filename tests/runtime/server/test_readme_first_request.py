"""The README's first requests, run as written against `tokenfleet serve` on the built-in model: each
answers 200 with a non-empty answer and a finish reason in bounded time (sampling is not deterministic, so
the text itself is not checked)."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[3] / "README.md"
LAUNCH = "import sys; from tokenfleet.runtime.cli import main; sys.exit(main())"
README_URL = "http://127.0.0.1:8000"
STATUS = "\nHTTP_STATUS:"


def readme_curls() -> list[str]:
    """Every curl command in the README's bash blocks aimed at `make serve`, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for command in re.split(r"(?<!\\)\n", block):
            if command.startswith("curl ") and README_URL in command:
                commands.append(command)
    return commands


def test_the_readme_shows_bounded_and_streamed_requests():
    commands = readme_curls()
    assert commands, "no curl example for `make serve` in README.md"
    assert all('"max_tokens"' in c for c in commands)
    assert any('"stream": true' in c for c in commands)


@pytest.fixture(scope="module")
def served_url():
    # `make serve`'s command, on a free port.
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "serve", "--model", "smollm2-135m-instruct", "--host", "127.0.0.1",
         "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        seen, deadline = [], time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(line)
            if "serving 'smollm2-135m-instruct' at " in line:
                yield line.split(" at ")[1].split()[0]
                break
        else:
            raise AssertionError(f"`tokenfleet serve` did not start: {seen}")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def run_as_written(command: str, url: str) -> tuple[int, str]:
    """The README's command with only the address changed, plus a write-out of the status code."""
    done = subprocess.run(
        ["bash", "-c", command.replace(README_URL, url) + f" -w '{STATUS}%{{http_code}}'"],
        capture_output=True,
        text=True,
        timeout=300,  # the time bound: at most 64 tokens from a 135M model, even on a saturated CPU
    )
    assert done.returncode == 0, done.stderr
    body, _, status = done.stdout.rpartition(STATUS)
    return int(status), body


@pytest.mark.slow  # a fresh process loads torch and the model
@pytest.mark.parametrize("index", range(len(readme_curls())))
def test_the_readme_curl_answers(served_url, index):
    command = readme_curls()[index]
    status, body = run_as_written(command, served_url)
    assert status == 200, body
    if '"stream": true' in command:
        events = [line[len("data: ") :] for line in body.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        finish = reasons[-1]
    else:
        choice = json.loads(body)["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    assert text.strip()
    assert finish in ("stop", "length")
