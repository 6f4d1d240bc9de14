"""Decode speed against the hardware limit: tokenfleet eager vs compiled, the weight-read roofline, llama.cpp.

All in one run and one table, so the ratios hold even on a shared, noisy machine:
  - the machine's read-only streaming bandwidth (a large tensor summed, best of several passes);
  - the weight-read roofline: a decode step reads every weight once, so single-stream tok/s cannot beat
    bandwidth / weight bytes (fp32 as served on CPU; bf16 for what halving the bytes would allow);
  - tokenfleet decode tok/s and inter-token latency (median step time of decode-only steps) per batch size,
    eager (`model.compile: off`) and compiled (`on`);
  - llama.cpp (llama-cpp-python, `make bench-peers`) on the same GGUF, single stream, when importable: its
    decode rate is the difference of two greedy completions of different lengths (prefill cancels out).

    python bench/decode.py [--batches 1 4 16 64] [--compiled-batches 1] [--tokens 64] [--device auto]

The compiled engine compiles only the batch sizes it measures (not every power of two up to the largest):
each is a whole-model compile at start-up, a C++ one on CPU (minutes on 2 shared cores, cached under
~/.cache/tokenfleet/inductor afterwards), hence `--compiled-batches` defaults to the single stream there.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import statistics
import subprocess
import sys
import time

import torch
from tokenfleet.runtime.config import ModelConfig, RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.model.loader import load_model
from tokenfleet.runtime.model.source import resolve_source

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Once upon a time"


def stream_bandwidth(device: torch.device, mib: int = 512, passes: int = 5) -> float:
    """Read-only streaming bandwidth in GB/s: the best of `passes` sums over a tensor larger than any cache."""
    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(passes):
        _sync(device)
        start = time.perf_counter()
        data.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model: torch.nn.Module, bytes_per_param: int) -> int:
    """Bytes one decode step reads: every distinct parameter once (a tied LM head is the embedding)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * bytes_per_param
    return total


def measure(llm: LLM, batch: int, tokens: int) -> tuple[float, float]:
    """(decode tok/s over all streams, median inter-token latency in ms) for `batch` concurrent requests."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = llm.tokenizer.encode(PROMPT)
    stamps: list[tuple[float, int]] = []  # (time, tokens emitted by the step) of decode-only steps

    def on_step(outputs) -> None:
        stamps.append((time.perf_counter(), sum(len(o.new_token_ids) for o in outputs)))

    # Prompts differ in their last token so no two requests are identical; the prefix cache may still serve
    # the shared part, which only shortens prefill (not measured).
    prompts = [[*prompt[:-1], prompt[-1] + i] for i in range(batch)]
    llm.generate(prompts, params, use_tqdm=False, on_step=on_step)
    # Steps in which every request emits one token are decode steps; the earlier ones are prefill.
    decode = [(t, n) for t, n in stamps if n == batch]
    if len(decode) < 3:
        return float("nan"), float("nan")
    times = [t for t, _ in decode]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return batch * len(gaps) / (times[-1] - times[0]), statistics.median(gaps) * 1e3


def llama_cpp_decode(gguf: str, threads: int, tokens: int) -> float | str | None:
    """llama.cpp's single-stream decode tok/s on the same file; None when llama_cpp is not installed, a
    short reason when it failed. It runs in a child process: a crash in the peer's native code (as its AMX
    path below did here) must not cost the table of everything measured before it."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    cmd = [
        sys.executable,
        __file__,
        "--peer-llama-cpp",
        gguf,
        "--threads",
        str(threads),
        "--tokens",
        str(tokens),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return f"failed (exit status {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    return float(proc.stdout.strip().splitlines()[-1])


def _peer_llama_cpp(gguf: str, threads: int, tokens: int) -> float:
    """The child's side of `llama_cpp_decode`: its decode rate is the difference of two greedy completions
    of different lengths (prefill cancels out), the better of two tries."""
    import llama_cpp
    import llama_cpp.llama_cpp as bindings  # what `Llama` calls for its defaults

    # llama-cpp-python 0.3.36 crashes (SIGSEGV in ggml_backend_amx_mul_mat) on CPUs with AMX when it repacks
    # the Q4_1 weights into its AMX buffer type ("extra" buffer types); its AVX-512 kernels work. The
    # high-level `Llama` takes no such option, so its default model parameters are amended instead.
    default_params = bindings.llama_model_default_params

    def model_params():
        params = default_params()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = model_params
    llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_ctx=1024, verbose=False, seed=0)
    llm(PROMPT, max_tokens=8, temperature=0.0)  # warm-up
    rates = []
    for _ in range(2):
        timings = []
        for n in (8, 8 + tokens):
            start = time.perf_counter()
            out = llm(PROMPT, max_tokens=n, temperature=0.0, stop=[])
            timings.append((time.perf_counter() - start, out["usage"]["completion_tokens"]))
        (t0, n0), (t1, n1) = timings
        rates.append((n1 - n0) / (t1 - t0))
    return max(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument(
        "--compiled-batches", type=int, nargs="*", default=None, help="default: all on CUDA, 1 on CPU"
    )
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--repeats", type=int, default=2, help="alternating repetitions per batch (best kept)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--peer-llama-cpp", metavar="GGUF", help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_llama_cpp:
        print(_peer_llama_cpp(args.peer_llama_cpp, args.threads, args.tokens))
        return

    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    compiled_batches = args.compiled_batches
    if compiled_batches is None:
        compiled_batches = args.batches if device.type == "cuda" else [1]
    model_config = ModelConfig(device=device.type)
    loaded = load_model(model_config, device)
    threads = torch.get_num_threads()
    bw = stream_bandwidth(device)
    bytes_model = weight_bytes(loaded.model, loaded.dtype.itemsize)
    fp32_roof = bw * 1e9 / weight_bytes(loaded.model, 4)
    bf16_roof = bw * 1e9 / weight_bytes(loaded.model, 2)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"# {loaded.name} on {device} ({loaded.dtype}), torch {torch.__version__}, {threads} threads, "
        f"load average {load:.2f}"
    )
    print(
        f"# read bandwidth {bw:.1f} GB/s; weights read per step {bytes_model / 1e6:.0f} MB; roofline "
        f"fp32 {fp32_roof:.1f} tok/s, bf16 {bf16_roof:.1f} tok/s (single stream)"
    )

    # Both engines first, then each batch size measured alternately (eager, compiled, eager, ...) and the
    # best repetition kept: on a shared machine load comes and goes, and alternating spreads it evenly.
    engines: dict[str, tuple[LLM, list[int]]] = {}
    for name, setting, batches in (
        ("eager", "off", args.batches),
        ("compiled", "on", [b for b in args.batches if b in compiled_batches]),
    ):
        if not batches:
            continue
        start = time.perf_counter()
        llm = LLM(
            config=RuntimeConfig(),
            loaded=loaded,
            compile=setting,
            compile_batch_sizes=batches,  # no compile (nor CUDA-graph capture) of sizes never measured
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(2048, 64 * max(batches)),
        )
        setup = time.perf_counter() - start
        if setting == "on":
            print(f"# compiled buckets {list(llm.engine.runner.compiled.buckets)} in {setup:.1f} s")
        measure(llm, 1, 8)  # warm-up
        engines[name] = (llm, batches)
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for b in args.batches:
        for _ in range(args.repeats):
            for name, (llm, batches) in engines.items():
                if b in batches:
                    tps, itl = measure(llm, b, args.tokens)
                    if (name, b) not in best or tps > best[name, b][0]:
                        best[name, b] = (tps, itl)
    rows = [(name, b, *best[name, b]) for name in engines for b in args.batches if (name, b) in best]
    for llm, _ in engines.values():
        llm.shutdown()
    bw_after = stream_bandwidth(device)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if bw_after > bw:  # the roofline from the better of the two measurements: never flattering
        bw = bw_after
        fp32_roof = bw * 1e9 / weight_bytes(loaded.model, 4)
        bf16_roof = bw * 1e9 / weight_bytes(loaded.model, 2)
    print(
        f"# after: read bandwidth {bw_after:.1f} GB/s, load average {load_after:.2f}; roofline used: fp32 "
        f"{fp32_roof:.1f} tok/s, bf16 {bf16_roof:.1f} tok/s ({bw:.1f} GB/s)"
    )

    cpp = (
        None
        if args.no_llama_cpp or device.type != "cpu"
        else llama_cpp_decode(str(resolve_source(model_config.model).path), threads, args.tokens)
    )

    print()
    print(f"{'system':<14}{'batch':>6}{'tok/s':>10}{'ITL ms':>9}{'x fp32 roof':>13}{'x eager':>9}")
    eager = {b: tps for name, b, tps, _ in rows if name == "eager"}
    for name, b, tps, itl in rows:
        per_stream = tps / b
        print(
            f"{'tokenfleet ' + name:<14}{b:>6}{tps:>10.1f}{itl:>9.1f}{per_stream / fp32_roof:>13.2f}"
            f"{tps / eager[b]:>9.2f}"
        )
    if isinstance(cpp, str):
        print(f"# llama.cpp: {cpp}")
    elif cpp is not None:
        # Single stream: its x eager needs the eager batch-1 row, which --batches may leave out.
        vs_eager = f"{cpp / eager[1]:>9.2f}" if 1 in eager else f"{'-':>9}"
        print(f"{'llama.cpp':<14}{1:>6}{cpp:>10.1f}{1e3 / cpp:>9.1f}{cpp / fp32_roof:>13.2f}{vs_eager}")
    else:
        print(
            "# llama.cpp: not installed (make bench-peers)"
            if device.type == "cpu"
            else "# llama.cpp: CPU only"
        )
    print(
        "# x fp32 roof: per-stream tok/s / fp32 weight-read roofline (llama.cpp reads Q4_1 weights: ~5x fewer bytes)"
    )


if __name__ == "__main__":
    main()
