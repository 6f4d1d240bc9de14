"""Tensor parallelism on CPU (gloo), with real worker processes (torch.multiprocessing spawn).

- Sharded greedy output is token-identical to one process (logprobs within fp32 tolerance): the default
  model split 3 ways (9 heads, 3 KV heads: one each), tiny random Llama (1 KV head, replicated), Qwen2 (QKV
  bias) and Qwen2-MoE (experts and shared expert split) checkpoints split 2 ways — with prefix-cache hits,
  preemption, n-gram speculation and the self-draft on.
- Failure: a worker killed mid-request ends the request with an error and fails /health, SIGTERM stops
  every worker, and a crash of rank 0 leaves no worker behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.tensor_parallel import shard_slice

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320)


def _config(case: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig

    if case == "llama":
        return LlamaConfig(**SMALL, intermediate_size=96, num_key_value_heads=1)
    if case == "qwen2":
        return Qwen2Config(**SMALL, intermediate_size=96, num_key_value_heads=2, rope_theta=1e6)
    return Qwen2MoeConfig(
        **SMALL,
        num_key_value_heads=2,
        intermediate_size=80,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        num_experts=5,
        num_experts_per_tok=3,
        mlp_only_layers=[0],
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny random HF checkpoints (safetensors + a byte-level BPE tokenizer), saved once."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["tensor parallel shards of one model"] * 10, trainer)
    tok_file = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    backend.save(str(tok_file))
    paths = {}
    for case in ("llama", "qwen2", "qwen2_moe"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(case)).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                    param.normal_(0.0, 0.5)  # random init leaves biases at zero: make them count
                elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                    param.normal_(0.0, 0.5)  # decisive, varied routing
        directory = tmp_path_factory.mktemp(case)
        model.save_pretrained(directory, safe_serialization=True)
        PreTrainedTokenizerFast(tokenizer_file=str(tok_file), eos_token="<|endoftext|>").save_pretrained(
            directory
        )
        paths[case] = str(directory)
    return paths


def _run(llm: LLM, prompts: list[list[int]]):
    """Greedy outputs: the first prompt alone (its blocks get cached), then the rest in one batch."""
    outs = llm.generate([prompts[0]], GREEDY) + llm.generate(prompts[1:], GREEDY)
    return [
        (o.token_ids, [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)])
        for o in (r.outputs[0] for r in outs)
    ]


def _assert_same(reference, sharded) -> None:
    for (ids1, lps1), (ids2, lps2) in zip(reference, sharded, strict=True):
        assert ids1 == ids2
        assert lps1 == pytest.approx(lps2, abs=1e-4)  # fp32: only the all-reduce summation order differs


def _tp(tp: int, **sections) -> RuntimeConfig:
    return RuntimeConfig.model_validate({**sections, "parallel": {"tensor_parallel_size": tp}})


# ---- equivalence ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_split_three_ways_matches_one_process(default_model):
    prompts = [
        [1, 504, 3575, 282, 4649, 314, 5045],
        [1, 504, 3575, 282, 4649, 314, 5045, 30],
        [28, 7125, 1548],
    ]
    reference = _run(LLM(loaded=default_model, num_blocks=64), prompts)
    llm = LLM(dtype="float32", num_blocks=64, tensor_parallel_size=3)
    try:
        sharded = _run(llm, prompts)
    finally:
        llm.shutdown()
    _assert_same(reference, sharded)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen2_moe"])
def test_tiny_checkpoints_at_tp2_match_one_process_with_preemption_and_prefix_hits(case, checkpoints):
    shared = [5, 9, 5, 9, 17, 23, 5, 9, 40, 41, 42, 5, 9, 17, 23, 60, 61, 5, 9]  # 2 full blocks of 8
    prompts = [[*shared, 70, 71], [*shared, 80, 5, 9, 17], [90, 91, 92, 5, 9, 93, 94, 5, 9, 95] * 2]
    model = {"model": checkpoints[case], "dtype": "float32"}
    reference = _run(LLM(config=_tp(1, model=model, cache={"block_size": 8, "num_blocks": 64})), prompts)
    # 8 blocks of 8 tokens cannot hold two ~35-token sequences at once: one is preempted.
    llm = LLM(config=_tp(2, model=model, cache={"block_size": 8, "num_blocks": 8}))
    try:
        sharded = _run(llm, prompts)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    _assert_same(reference, sharded)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


@pytest.mark.slow
def test_ngram_speculation_at_tp2_matches_plain_decoding(checkpoints):
    prompts = [[5, 9, 17, 23] * 4, [40, 41, 42, 43, 40, 41, 42] * 2]
    model = {"model": checkpoints["llama"], "dtype": "float32"}
    cache = {"block_size": 8, "num_blocks": 32}
    reference = _run(LLM(config=_tp(1, model=model, cache=cache)), prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "ngram_min": 1}
    llm = LLM(config=_tp(2, model=model, cache=cache, speculative=spec))
    try:
        sharded = _run(llm, prompts)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    _assert_same(reference, sharded)
    assert stats.spec_decode_num_drafts > 0


@pytest.mark.slow
def test_self_speculation_at_tp2_matches_plain_decoding(checkpoints):
    """The self-draft (the sharded target's first layer + its LM head, writing the shared paged KV) runs on
    every rank; verification keeps the output the target's own."""
    prompts = [[5, 9, 17, 23] * 3, [40, 41, 42, 43, 40, 41, 42]]
    model = {"model": checkpoints["llama"], "dtype": "float32"}
    cache = {"block_size": 8, "num_blocks": 32}
    reference = _run(LLM(config=_tp(1, model=model, cache=cache)), prompts)
    spec = {"method": "self", "num_speculative_tokens": 2, "draft_layers": 1}
    llm = LLM(config=_tp(2, model=model, cache=cache, speculative=spec))
    try:
        sharded = _run(llm, prompts)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    _assert_same(reference, sharded)
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.slow
def test_a_separate_draft_model_at_tp2_runs_on_rank_0_and_matches_plain_decoding(checkpoints):
    """The draft model (here the target's own checkpoint, unsharded: every proposal is right) is loaded
    whole on rank 0 only, next to its target shard, and drafts without collectives."""
    prompts = [[5, 9, 17, 23] * 3, [40, 41, 42, 43, 40, 41, 42]]
    model = {"model": checkpoints["llama"], "dtype": "float32"}
    cache = {"block_size": 8, "num_blocks": 32}
    reference = _run(LLM(config=_tp(1, model=model, cache=cache)), prompts)
    spec = {"method": "draft", "num_speculative_tokens": 2, "draft_model": checkpoints["llama"]}
    llm = LLM(config=_tp(2, model=model, cache=cache, speculative=spec))
    try:
        sharded = _run(llm, prompts)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    _assert_same(reference, sharded)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0  # draft = target


def test_cpu_ranks_split_the_thread_budget_the_pod_was_given(monkeypatch):
    from tokenfleet.runtime.engine.cpu_threads import cpu_thread_budget
    from tokenfleet.runtime.engine.parallel.workers import threads_per_rank

    cores = cpu_thread_budget({})  # this process's cores (capped by its cgroup's CPU quota, if any)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # a ModelDeployment pod's CPU request, not the node's cores
    assert (threads_per_rank(2), threads_per_rank(3), threads_per_rank(16)) == (4, 2, 1)
    for unusable in ("", "0", "four"):
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        assert threads_per_rank(2) == max(1, cores // 2)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_per_rank(1) == cores


def test_sizes_that_do_not_divide_fail_at_start_up_with_the_reason():
    with pytest.raises(ConfigError, match="9 attention heads"):
        LLM(config=_tp(2, model={"dtype": "float32"}, cache={"num_blocks": 16}))


def test_each_rank_reads_only_its_slice():
    full = ModelArch("llama", 48, 16, 24, 1, 4, 1, 4, 1e-5, 1e4, 64)  # 4 heads, 1 KV head, vocab 48
    assert shard_slice("model.layers.0.self_attn.q_proj.weight", full, 1, 2) == (0, 8, 8)
    assert shard_slice("model.layers.0.self_attn.k_proj.weight", full, 1, 2) == (0, 0, 4)  # replicated
    assert shard_slice("model.layers.0.self_attn.o_proj.weight", full, 1, 2) == (1, 8, 8)
    assert shard_slice("model.layers.0.mlp.down_proj.weight", full, 1, 2) == (1, 12, 12)
    assert shard_slice("model.embed_tokens.weight", full, 1, 2) == (0, 24, 24)
    assert shard_slice("model.layers.0.input_layernorm.weight", full, 1, 2) is None


# ---- failure ---------------------------------------------------------------------------------------------------


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: set[int], timeout: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return {p for p in pids if _alive(p)}


def _serve(model_dir: str, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    config = tmp_path / "runtime.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"model": model_dir, "dtype": "float32"},
                "cache": {"num_blocks": 64},
                "server": {"port": 0, "drain_seconds": 2},
            }
        )
    )
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet.runtime.cli", "serve", "--config", str(config),
         "--tensor-parallel-size", "2", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "serving" in line:
            return proc, line.split(" at ")[1].split()[0]
    proc.kill()
    raise AssertionError(f"server did not start: {(tmp_path / 'server.log').read_text()[-3000:]}")


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_a_worker_killed_mid_request_kills_the_engine_and_sigterm_stops_everything(checkpoints, tmp_path):
    proc, url = _serve(checkpoints["llama"], tmp_path)
    try:
        workers = _children(proc.pid)
        assert workers and _health(url) == 200
        body = json.dumps(
            {"model": checkpoints["llama"], "prompt": [5, 9, 17], "max_tokens": 900, "stream": True,
             "ignore_eos": True}
        ).encode()  # fmt: skip
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as stream:
            assert stream.readline()  # generating
            tp_workers = {p for p in workers if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()}
            for pid in tp_workers:
                os.kill(pid, signal.SIGKILL)
            rest = stream.read().decode()  # ends (no hang): an error event, not [DONE] after 900 tokens
        assert "error" in rest
        assert _health(url) == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) is not None
        assert not _wait_gone(workers)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_no_worker_survives_a_crash_of_rank_0(checkpoints, tmp_path):
    script = textwrap.dedent(
        f"""
        import time
        from tokenfleet.runtime.engine.llm import LLM
        if __name__ == "__main__":
            llm = LLM(model={checkpoints["llama"]!r}, dtype="float32", num_blocks=16, tensor_parallel_size=2)
            print("pids", *llm.engine.workers.pids, flush=True)
            time.sleep(300)
        """
    )
    path = tmp_path / "rank0.py"
    path.write_text(script)
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids"), line
        workers = {int(p) for p in line.split()[1:]}
        assert workers and all(_alive(p) for p in workers)
        everything = workers | _children(proc.pid)
        proc.kill()  # no shutdown, no atexit: only the kernel's parent-death signal and pipe EOF remain
        proc.wait(timeout=30)
        assert not _wait_gone(everything)
    finally:
        if proc.poll() is None:
            proc.kill()
