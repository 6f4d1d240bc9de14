"""`tokenfleet route --config PATH` as a process: starts, serves, and refuses a bad config."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import yaml


def test_bad_config_exits_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("routing: {strategy: nope}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tokenfleet.runtime.cli", "route", "--config", str(path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "invalid router config" in proc.stderr


def test_route_serves_health_and_metrics(tmp_path, free_ports):
    port, backend_port = free_ports(2)
    cfg = {
        "port": port,
        # No tokenizer for this model name: the router still starts (approximate index only).
        "backends": [
            {
                "name": "a",
                "model": "m",
                "url": f"http://127.0.0.1:{backend_port}",
                "tokenizer": "/nonexistent",
            }
        ],
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet.runtime.cli", "route", "--config", str(path)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            assert b"tokenfleet:router_endpoint_in_flight" in r.read()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_command_line_overrides_are_validated_like_the_file(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("port: 0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tokenfleet.runtime.cli", "route", "--config", str(path), "--port", "70000"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "invalid router config override ['port']" in proc.stderr
