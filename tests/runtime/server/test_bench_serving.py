"""bench/serving.py: seeded datasets, statistics, and one short run against a server over a fake engine."""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "bench" / "serving.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tokenfleet_bench_serving", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_datasets_are_seeded_and_sized(bench):
    a = bench.random_dataset(8, 20, 5, 0.5, random.Random(3), (10, 50))
    b = bench.random_dataset(8, 20, 5, 0.5, random.Random(3), (10, 50))
    assert a == b
    assert all(10 <= len(r.prompt_token_ids) <= 30 and 2 <= r.output_len <= 7 for r in a)
    shared = bench.shared_prefix_dataset(6, 2, 16, 4, 3, random.Random(0), (10, 50))
    prefixes = {tuple(r.prompt_token_ids[:16]) for r in shared}
    assert len(prefixes) == 2 and all(len(r.prompt_token_ids) == 20 for r in shared)
    assert bench.arrival_delays(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]
    assert sum(bench.arrival_delays(2000, 10.0, random.Random(0))) == pytest.approx(200, rel=0.1)


def test_summary_figures(bench):
    r = bench.RequestResult
    results = [
        r(ok=True, prompt_len=10, output_tokens=5, ttft=0.1, e2e=0.5, itl=[0.1] * 4),
        r(ok=True, prompt_len=10, output_tokens=3, ttft=3.0, e2e=3.2, itl=[0.1, 0.1]),
        r(ok=False, prompt_len=10, error="HTTP 429"),
    ]
    s = bench.summarize(results, duration=2.0, slo_ttft_ms=1000, slo_tpot_ms=200)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["output_throughput"] == 4.0
    assert s["goodput"] == 0.5  # the second request misses the TTFT SLO
    assert s["ttft_ms"]["p50"] == pytest.approx(1550)
    assert s["tpot_ms"]["mean"] == pytest.approx(100)
    assert "Goodput" in bench.format_table(s, 1000, 200)


async def test_short_run_against_server(bench, client, fake_engine):
    args = argparse.Namespace(
        base_url=str(client.make_url("")),
        model=None,
        api_key=None,
        request_rate=50.0,
        max_concurrency=3,
        seed=0,
        timeout=30.0,
    )
    requests = bench.random_dataset(6, 8, 4, 0.0, random.Random(0), (65, 90))
    results, _ = await bench.run(args, requests)
    assert all(res.ok for res in results), [res.error for res in results]
    assert [res.output_tokens for res in results] == [4] * 6
    assert all(len(res.itl) == 3 for res in results)
    assert all(p.ignore_eos and p.temperature == 0 for _, _, p in fake_engine.submitted)
