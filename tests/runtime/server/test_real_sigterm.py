"""`tokenfleet serve` as a process: it prints its URL and a curl example, and drains on SIGTERM.

Under load, SIGTERM must let in-flight requests finish while new ones get 503 and /ready turns 503; then
the process exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

LAUNCH = "import sys; from tokenfleet.runtime.cli import main; sys.exit(main())"


@pytest.fixture
def server_process(tmp_path):
    cfg = tmp_path / "runtime.yaml"
    cfg.write_text("cache:\n  num_blocks: 128\nserver:\n  drain_seconds: 60\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "serve", "--config", str(cfg), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    yield proc, lines
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _wait_for_line(lines: queue.Queue, needle: str, timeout: float) -> tuple[str, list[str]]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        if needle in line:
            return line, seen
    raise AssertionError(f"{needle!r} not printed in {timeout}s; got {seen}")


@pytest.mark.slow  # a fresh process loads torch and the model
async def test_sigterm_drains_in_flight_and_refuses_new(server_process):
    proc, lines = server_process
    line, _ = _wait_for_line(lines, "serving 'smollm2-135m-instruct' at ", 180)
    url = line.split(" at ")[1].split()[0]
    curl, _ = _wait_for_line(lines, "curl ", 5)
    assert f"{url}/v1/chat/completions" in curl

    async def stream(session: aiohttp.ClientSession, started: asyncio.Event) -> str:
        body = {"prompt": "Tell me a story", "max_tokens": 12, "ignore_eos": True, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            text, done = [], False
            async for raw in resp.content:
                line = raw.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    text.append(chunk["choices"][0]["text"])
                    started.set()
                    last = chunk
            assert done
            assert last["choices"][0]["finish_reason"] == "length"
            return "".join(text)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        events = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(stream(session, ev)) for ev in events]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in events)), 60)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (await session.get(url + "/ready")).status != 503:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        refused = await session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status == 503
        assert (await refused.json())["error"]["code"] == "draining"
        assert (await session.get(url + "/health")).status == 200  # draining is not dying
        texts = await asyncio.gather(*tasks)
        assert all(texts)
    assert await asyncio.to_thread(proc.wait, 30) == 0
    _wait_for_line(lines, "tokenfleet: stopped", 5)
