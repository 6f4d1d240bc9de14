"""Cost model and profiles against hand-computed figures; bad input names the field; the CLI and the planner."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from tokenfleet.sim.api import simulate
from tokenfleet.sim.cli import main as cli
from tokenfleet.sim.config import parse_config
from tokenfleet.sim.cost_model import BatchShape, RooflineCost
from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.hardware import Efficiency, gpu_profile
from tokenfleet.sim.model_profile import from_gguf, model_profile
from tokenfleet.sim.plan import _searches, plan
from tokenfleet.sim.trace import TraceWorkload


def decode(batch: int, ctx: int) -> BatchShape:
    return BatchShape(batch, batch, batch, float(batch * ctx), batch * ctx)


def test_presets_have_the_published_parameter_counts():
    assert model_profile("8b").total_params == pytest.approx(8.03e9, rel=0.01)
    assert model_profile("70b").total_params == pytest.approx(70.6e9, rel=0.01)
    moe = model_profile("moe")
    assert moe.total_params == pytest.approx(46.7e9, rel=0.01)
    assert moe.active_params == pytest.approx(13.0e9, rel=0.05)
    assert model_profile("8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB per token in bf16


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    m = model_profile("8b")
    h100 = RooflineCost(gpu_profile("h100"), m, 1, Efficiency())
    # Batch 1: the weights are read once per step, plus the context KV and the new token's KV.
    weights_read = (
        m.num_layers * (m.attn_params_per_layer + m.mlp_params_per_layer) + m.vocab_size * m.hidden_size
    ) * 2
    expected = (weights_read + (1000 + 1) * m.kv_bytes_per_token) / (3.35e12 * 0.8) + 0.0025
    assert h100.step_seconds(decode(1, 1000)) == pytest.approx(expected, rel=1e-3)
    # A big prefill is compute bound: 2 x active params x tokens / (peak x efficiency) dominates.
    prefill = BatchShape(8192, 1, 1, 8192 * 8193 / 2, 8192)
    assert h100.step_seconds(prefill) > 2 * 8192 * 7e9 / (989e12 * 0.55)
    # More bandwidth, faster decode; fp8 weights halve the bytes; TP splits the work (plus all-reduces).
    assert RooflineCost(gpu_profile("h200"), m).step_seconds(decode(64, 1000)) < h100.step_seconds(
        decode(64, 1000)
    )
    fp8 = RooflineCost(gpu_profile("h100"), m.with_precision("fp8", "fp8"))
    assert fp8.step_seconds(decode(64, 1000)) < 0.7 * h100.step_seconds(decode(64, 1000))
    big = model_profile("70b")
    tp2, tp4 = RooflineCost(gpu_profile("h100"), big, 2), RooflineCost(gpu_profile("h100"), big, 4)
    assert tp4.step_seconds(decode(32, 1000)) < tp2.step_seconds(decode(32, 1000))


def test_kv_capacity_follows_memory_left_after_weights():
    m = model_profile("8b")
    h100 = RooflineCost(gpu_profile("h100"), m).num_kv_blocks(16)
    assert h100 == int((80e9 * 0.9 - 2e9 - m.weight_bytes) // (16 * m.kv_bytes_per_token))
    assert RooflineCost(gpu_profile("h200"), m).num_kv_blocks(16) > 2 * h100
    assert RooflineCost(gpu_profile("l4"), model_profile("70b")).num_kv_blocks(16) == 0  # does not fit


def test_moe_reads_only_the_experts_a_small_batch_touches():
    moe = model_profile("moe")
    cost = RooflineCost(gpu_profile("h100"), moe, 2)
    one, many = cost.step_seconds(decode(1, 500)), cost.step_seconds(decode(128, 500))
    dense_total = moe.total_params * 2 / (3.35e12 * 0.8 * 2)
    assert one < 0.5 * dense_total  # 2 of 8 experts per layer at batch 1
    assert many > one


def test_hf_config_and_gguf_header(tmp_path):
    cfg = {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(cfg))
    p = model_profile(str(tmp_path / "tiny"))
    assert (p.num_layers, p.head_dim, p.num_experts, p.experts_per_token) == (4, 32, 4, 2)
    assert p.active_params < p.total_params

    import gguf

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_feed_forward_length(128)
    w.add_context_length(512)
    w.add_vocab_size(300)
    w.add_tensor("token_embd.weight", np.zeros((300, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = from_gguf(path)
    assert (g.num_layers, g.hidden_size, g.num_kv_heads, g.head_dim, g.vocab_size) == (2, 64, 2, 16, 300)
    assert g.weight_bytes == 300 * 64 * 4 and g.tie_embeddings and g.max_model_len == 512


@pytest.mark.parametrize(
    ("data", "field", "accepted"),
    [
        ({"fleet": {"gpu": "h1000"}}, "fleet.gpu", "h100-sxm"),
        ({"fleet": {"gpu": "l4", "tp": 8}}, "fleet.tp", None),
        ({"routing": {"strategy": "random"}}, "routing.strategy", None),
        ({"slo": {"ttft_s": 0}}, "slo.ttft_s", None),
        ({"workload": {"rate": -1}}, "workload.rate", None),
        ({"cache": {"block_size": 24}}, "cache.block_size", "16"),
        ({"cache": {"kv_cache_dtype": "fp8_e4m3"}}, "cache.kv_cache_dtype", "eviction"),
        ({"cache": {"cpu_offload_gib": 4}}, "cache.cpu_offload_gib", "ttl_seconds"),
        (
            {"fleet": {"replicas": 2}, "disaggregation": {"prefill_replicas": 2}},
            "disaggregation.prefill_replicas",
            "1..1",
        ),
        (
            {"disaggregation": {"prefill_replicas": 1, "link_gb_per_s": 0}},
            "disaggregation.link_gb_per_s",
            None,
        ),
    ],
)
def test_bad_config_names_the_field(data, field, accepted):
    with pytest.raises(SimInputError) as e:
        parse_config(data)
    assert str(e.value).startswith(field)
    if accepted:
        assert accepted in str(e.value)


def test_plan_refuses_a_disaggregated_config():
    from tokenfleet.sim.plan import plan

    config = parse_config({"fleet": {"replicas": 2}, "disaggregation": {"prefill_replicas": 1}})
    with pytest.raises(SimInputError, match=r"^disaggregation: plan searches aggregated fleets"):
        plan(config, ["h100"], [1], ["round-robin"], 4)


def test_unknown_model_and_unfitting_fleet():
    with pytest.raises(SimInputError, match=r"^model: unknown model 'gpt-9'.*accepted: .*llama-3-8b"):
        simulate(parse_config({"model": "gpt-9"}))
    with pytest.raises(SimInputError, match=r"^fleet: .*no KV cache"):
        simulate(parse_config({"model": "70b", "fleet": {"gpu": "l4"}}))


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("not json", "trace line 2"),
        ('{"t": 1, "output_tokens": 5}', "trace line 2: prompt_tokens"),
        ('{"t": 1, "prompt_tokens": 5}', "trace line 2: output_tokens"),
        ('{"t": 1, "prompt_tokens": 5.5, "output_tokens": 3}', "trace line 2: prompt_tokens"),
        ('{"t": 0.5, "prompt_tokens": 5, "output_tokens": 3}', "trace line 2: t"),
        ('{"t": 1, "prompt_tokens": 5, "output_tokens": 3, "colour": 1}', "trace line 2: colour"),
    ],
)
def test_malformed_trace_lines_name_line_and_field(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 1, "prompt_tokens": 10, "output_tokens": 2}\n' + line + "\n")
    with pytest.raises(SimInputError) as e:
        TraceWorkload(path)
    assert str(e.value).startswith(field)


def test_trace_sessions_extend_their_own_prefix(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {
            "t": 0,
            "prefix_group": "a",
            "prefix_tokens": 64,
            "suffix_tokens": 8,
            "output_tokens": 4,
            "session": "s",
        },
        {"t": 1, "suffix_tokens": 8, "output_tokens": 4, "session": "s"},
        {"t": 2, "prefix_group": "a", "prefix_tokens": 64, "suffix_tokens": 8, "output_tokens": 4},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    a, b, c = list(TraceWorkload(path, seed=5).arrivals())
    assert b.prompt[: len(a.prompt) + 4] == a.prompt + a.output and len(b.prompt) == len(a.prompt) + 12
    assert c.prompt[:64] == a.prompt[:64] and c.prompt[64:] != a.prompt[64:]


def test_cli_run_writes_json_and_png_and_reports_bad_input(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = [
        "run",
        "--gpu",
        "h100",
        "--replicas",
        "2",
        "--rate",
        "4",
        "--duration",
        "5",
        "--json",
        str(out),
        "--png",
        str(png),
    ]
    assert cli(args) == 0
    assert json.loads(out.read_text())["requests"]["unfinished"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT" in capsys.readouterr().out
    assert cli(["run", "--gpu", "tpu-v5"]) == 2
    assert "fleet.gpu: unknown GPU 'tpu-v5'" in capsys.readouterr().err
    assert cli(["plan", "--jobs", "-1"]) == 2
    assert "jobs: expected 0 (every usable core) or a positive count, got -1" in capsys.readouterr().err


def test_plan_finds_the_cheapest_fleet_and_says_when_none_fits():
    config = parse_config(
        {
            "model": "8b",
            "workload": {"rate": 30, "duration_s": 5, "num_tenants": 10, "seed": 4},
            "slo": {"ttft_s": 1.0, "tpot_s": 0.05},
        }
    )
    quiet = type("P", (), {"total": 0, "update": lambda self, label: None, "close": lambda self: None})()
    feasible, _, skipped = plan(config, ["h100", "a100", "l4"], [1], ["prefix-affinity"], 4, progress=quiet)
    assert skipped == [s for s in skipped if s.startswith("l4 tp=1: batch-1 TPOT")] and skipped
    assert feasible and feasible[0].met
    assert feasible == sorted(feasible, key=lambda c: c.cost_per_hour)
    # Within what the GPUs can do, but not with at most one replica: the closest candidates come back instead.
    heavy = config.model_copy(update={"workload": config.workload.model_copy(update={"rate": 400})})
    feasible, closest, _ = plan(heavy, ["a100"], [1], ["round-robin"], 1, progress=quiet)
    assert not feasible and closest and not closest[0].met
    # Physically impossible: no GPU decodes one token of an 8B model in 1 ms.
    tight = config.model_copy(update={"slo": config.slo.model_copy(update={"tpot_s": 0.001})})
    with pytest.raises(SimInputError, match=r"^slo: no candidate can meet TPOT <= 0.001"):
        plan(tight, ["h100", "l4"], [1, 2], ["round-robin"], 2, progress=quiet)


class _Labels:
    def __init__(self) -> None:
        self.total, self.labels = 0, []

    def update(self, label: str) -> None:
        self.labels.append(label)

    def close(self) -> None:
        pass


def test_plan_in_worker_processes_gives_the_serial_answer_and_reports_every_probe():
    config = parse_config(
        {
            "model": "8b",
            "workload": {"rate": 60, "duration_s": 4, "num_tenants": 10, "seed": 5},
            "slo": {"ttft_s": 1.0, "tpot_s": 0.05},
        }
    )
    args = (config, ["h100", "a100"], [1], ["round-robin", "prefix-affinity"], 4)
    serial, parallel = _Labels(), _Labels()
    expected = plan(*args, progress=serial, jobs=1)
    assert plan(*args, progress=parallel, jobs=2) == expected
    assert expected[0] or expected[1]
    # Same probes (their order interleaves across workers), each reported once.
    assert sorted(parallel.labels) == sorted(serial.labels) and len(set(serial.labels)) == len(serial.labels)


def test_a_failing_search_ends_the_plan_at_once_instead_of_after_every_other_search():
    config = parse_config(
        {
            "model": "8b",
            "workload": {"rate": 200, "duration_s": 10, "num_tenants": 10, "seed": 6},
            "slo": {"ttft_s": 1.0, "tpot_s": 0.05},
        }
    )
    # The first candidate fails in its worker; three good ones would take about four probes each.
    combos = [("no-such-gpu", 1, "round-robin")] + [
        ("h100", 1, r) for r in ("round-robin", "least-load", "prefix-affinity")
    ]
    progress = _Labels()
    with pytest.raises(SimInputError, match=r"^fleet.gpu: unknown GPU 'no-such-gpu'"):
        _searches(config, combos, 8, 2, progress)
    # The other worker stops after its probe in flight, and the queued searches never start.
    assert len(progress.labels) <= 3, progress.labels


def test_a_simulator_input_error_survives_the_trip_back_from_a_worker():
    err = pickle.loads(pickle.dumps(SimInputError("fleet.gpu", "unknown GPU 'x'", ["a100", "h100"])))
    assert isinstance(err, SimInputError) and err.field == "fleet.gpu"
    assert str(err) == "fleet.gpu: unknown GPU 'x' (accepted: a100, h100)"
