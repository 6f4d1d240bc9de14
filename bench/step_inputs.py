"""A decode step's attention inputs on the host: the block table built whole vs kept across steps.

Between two forwards the runner turns the scheduler's output into the step's tensors. Built whole, the
block table flattens every request's block ids each step, O(all blocks held); `PersistentBlockTable`
gathers last step's rows and writes only the rows whose request took a block. Measured here on the host
for decode-only steps (every request one token further; a request takes a new block every `block_size`
steps, staggered as in a running batch), `build_step_metadata` with and without the kept table, the two
interleaved in one run, medians of `--rounds`:

    python bench/step_inputs.py [--streams 1 64 256] [--context 1024 4096] [--steps 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tokenfleet.runtime.engine.persistent_block_table import PersistentBlockTable
from tokenfleet.runtime.model.attention.metadata import build_step_metadata

BLOCK_SIZE = 16


def steps(num_streams: int, context: int, num_steps: int) -> list[tuple[list[int], list[tuple[int, ...]]]]:
    """Each step's (start positions, block-id tuples), a tuple rebuilt only when its request takes a block
    (as the KV cache manager hands them over)."""
    starts = [context - 1 - (i * 5) % BLOCK_SIZE for i in range(num_streams)]
    tables = [tuple(range(i * 1000, i * 1000 + -(-(s + 1) // BLOCK_SIZE))) for i, s in enumerate(starts)]
    out = []
    for _ in range(num_steps):
        out.append((list(starts), list(tables)))
        for i in range(num_streams):
            starts[i] += 1
            if starts[i] % BLOCK_SIZE == 0:
                tables[i] = tables[i] + (tables[i][-1] + 1,)
    return out


def measure(workload, persistent: bool) -> float:
    """Mean µs per step."""
    kept = PersistentBlockTable() if persistent else None
    rids = [f"r{i}" for i in range(len(workload[0][0]))]
    ones = [1] * len(rids)
    t0 = time.perf_counter()
    for starts, tables in workload:
        block_tables = kept.build(rids, tables) if kept is not None else None
        build_step_metadata(starts, ones, tables, BLOCK_SIZE, block_tables)
    return (time.perf_counter() - t0) / len(workload) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(
        f"decode steps' attention inputs on the host, torch threads {torch.get_num_threads()}, block {BLOCK_SIZE}"
    )
    print(f"{'streams':>7} {'context':>7} {'whole us/step':>13} {'kept us/step':>12} {'whole/kept':>10}")
    for num_streams in args.streams:
        for context in args.context:
            workload = steps(num_streams, context, args.steps)
            whole, kept = [], []
            for _ in range(args.rounds):
                whole.append(measure(workload, persistent=False))
                kept.append(measure(workload, persistent=True))
            w, k = statistics.median(whole), statistics.median(kept)
            print(f"{num_streams:>7} {context:>7} {w:>13.1f} {k:>12.1f} {w / k:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
