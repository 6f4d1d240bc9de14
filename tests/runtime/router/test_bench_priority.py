"""bench/priority.py without pods: its options, seeded arrivals and prompts, the routing spec it hands the
routers, and the report it prints."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
from tokenfleet.runtime.router.config import RouterConfig

_PATH = Path(__file__).resolve().parents[3] / "bench" / "priority.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tokenfleet_bench_priority", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_quick_sets_smaller_defaults_and_explicit_flags_win(bench):
    full = bench.parse_args([])
    quick = bench.parse_args(["--quick"])
    assert full.interactive == bench.FULL["interactive"] and quick.interactive == bench.QUICK["interactive"]
    assert quick.flood_concurrency < full.flood_concurrency
    assert bench.parse_args(["--quick", "--interactive", "9"]).interactive == 9
    # The largest prefill chunk is the prompt or the step's token budget, whichever is smaller.
    assert full.chunk == min(full.flood_prompt_tokens, full.max_num_batched_tokens)
    assert bench.parse_args(["--flood-prompt-tokens", "900"]).chunk == full.max_num_batched_tokens
    with pytest.raises(SystemExit):
        bench.parse_args(["--interactive", "2", "--rounds", "3"])


def test_interactive_arrivals_are_seeded_and_shared_out_over_the_rounds(bench):
    args = bench.parse_args(["--interactive", "10", "--rounds", "3"])
    rounds = bench.interactive_offsets(args)
    assert [len(r) for r in rounds] == [4, 3, 3] and all(r[0] == 0.0 for r in rounds)
    gaps = [b - a for r in rounds for a, b in itertools.pairwise(r)]
    assert all(0.5 * args.interactive_gap <= g <= 1.5 * args.interactive_gap for g in gaps)
    assert bench.interactive_offsets(args) == rounds
    assert bench.interactive_offsets(bench.parse_args(["--interactive", "10", "--seed", "1"])) != rounds


def test_prompts_are_seeded_sized_and_distinct(bench):
    a = bench.prompt_ids("flood-0-1", 384)
    assert a == bench.prompt_ids("flood-0-1", 384) and len(a) == 384
    assert a[:16] != bench.prompt_ids("flood-0-2", 384)[:16]  # no shared first block: no prefix-cache hit


def test_the_routers_accept_the_routing_spec(bench):
    cfg = RouterConfig.model_validate(
        {
            "backends": [{"name": "pod0", "model": bench.MODEL, "url": "http://127.0.0.1:1"}],
            "routing": {
                "strategy": "least-load",
                "priorityClasses": bench.CLASSES,
                "maxInFlightPerEndpoint": bench.MAX_IN_FLIGHT,
            },
        }
    )
    classes = {c.name: c.priority for c in cfg.routing.priority_classes}
    assert classes == {"interactive": -10, "batch": 10}
    assert (
        cfg.routing.max_in_flight_per_endpoint > bench.FULL["flood_concurrency"] + bench.FULL["interactive"]
    )


def test_report(bench, capsys):
    args = bench.parse_args(["--quick"])
    blocks = {
        "idle": [{"warmup_s": 0.0, "ttfts": [0.1, 0.2], "n": 2, "window_s": 4.0, "batch_done": 0,
                  "batch_failed": 0, "batch_tokens": 0, "preemptions": 0, "steps": [5, 5]}],
        "fcfs": [{"warmup_s": 9.0, "ttfts": [3.0, 5.0], "n": 2, "window_s": 10.0, "batch_done": 4,
                  "batch_failed": 0, "batch_tokens": 200, "preemptions": 0, "steps": [40, 50]}],
        "priority": [{"warmup_s": 9.0, "ttfts": [0.4, 0.9], "n": 2, "window_s": 5.0, "batch_done": 2,
                      "batch_failed": 0, "batch_tokens": 95, "preemptions": 2, "steps": [20, 25]}],
    }  # fmt: skip
    results = [bench.summarize(phase, blocks[phase]) for phase in bench.PHASES]
    assert results[1]["batch_tok_s"] == 20.0 and results[2]["batch_tok_s"] == 19.0
    bench.print_report(results, {"lone": [0.5, 0.7], "paired": [1.0, 1.2]}, args, 60.0)
    out = capsys.readouterr().out
    assert "5.0% of output tok/s" in out  # 1 - 19 / 20
    assert "(c) TTFT p99 0.900 s <= (a) idle p99 0.200 s + 1.100 s = 1.300 s: met" in out
    assert "(c) TTFT p99 0.900 s <= (a) idle p99 0.200 s + 0.600 s = 0.800 s: NOT met" in out
    assert "shared 2-core CPU box" in out
