"""Sleep mode, measured: memory before / asleep / awake, sleep and wake seconds, tokens identical after wake.

One EngineCore with the built-in model (the start-up config: on CUDA the KV budget is
gpu_memory_utilization of the device, decode compiled per model.compile). Per level: greedy tokens, then
sleep, then wake, then the same request again. Memory is torch.cuda.memory_allocated on CUDA (what sleep
hands back to other users of the device) and the process RSS on the CPU (/proc/self/statm); the KV cache
is written in full first so all of it is resident. On the CPU the KV pages come back lazily (zero pages, backed on first write): "after wake" is
low there until traffic writes them.

    python bench/sleep_mode.py --device cuda --levels 1 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.engine_core import EngineCore
from tokenfleet.runtime.engine.sampling_params import SamplingParams

PROMPT = "Write a short note about lighthouses and the people who kept them running through the winter."


def memory(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def generate(core: EngineCore, rid: str, n: int) -> list[int]:
    core.add_request(
        rid, core.tokenizer.encode(PROMPT), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    )
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            tokens += out.new_token_ids
    return tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--cpu-kv-gib", type=float, default=0.5, help="CPU: the KV budget")
    args = p.parse_args(argv)
    config = RuntimeConfig.model_validate(
        {"model": {"device": args.device}, "cache": {"cpu_kv_cache_gib": args.cpu_kv_gib}}
    )
    t0 = time.perf_counter()
    core = EngineCore(config)
    print(f"device {args.device}; engine built in {time.perf_counter() - t0:.1f} s")
    print(f"memory measured as {'torch.cuda.memory_allocated' if args.device == 'cuda' else 'process RSS'}")
    ok = True
    for level in args.levels:
        before = generate(core, f"before-{level}", args.tokens)
        for k, v in core.runner.kv_caches:  # all of the KV resident, as after a busy period
            k.fill_(0)
            v.fill_(0)
        awake = memory(args.device)
        t = time.perf_counter()
        freed = core.sleep(level)
        sleep_s = time.perf_counter() - t
        asleep = memory(args.device)
        t = time.perf_counter()
        core.wake_up()
        wake_s = time.perf_counter() - t
        woken = memory(args.device)
        after = generate(core, f"after-{level}", args.tokens)
        same = after == before
        ok &= same
        mib = 2**20
        print(
            f"level {level}: memory awake {awake / mib:.0f} MiB, asleep {asleep / mib:.0f} MiB "
            f"(-{(awake - asleep) / mib:.0f} MiB; freed KV {freed['kv_cache'] / mib:.0f} MiB, weights "
            f"{freed['weights'] / mib:.0f} MiB), after wake {woken / mib:.0f} MiB; sleep {sleep_s:.3f} s, "
            f"wake {wake_s:.3f} s; {len(after)} tokens identical after wake: {same}"
        )
    core.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
