"""PersistentBlockTable: step after step, the same table as building it whole, while requests come, go,
reorder, take blocks, release them (sliding window) and arrive as fresh tuples of the same ids."""

from __future__ import annotations

import random

import torch
from tokenfleet.runtime.engine.persistent_block_table import PersistentBlockTable
from tokenfleet.runtime.model.attention.metadata import block_table_tensor


def test_every_step_equals_the_table_built_whole():
    rng = random.Random(7)
    persistent = PersistentBlockTable()
    live: dict[str, tuple[int, ...]] = {}
    next_id = 0
    previous = None
    for step in range(400):
        for rid in list(live):
            roll = rng.random()
            if roll < 0.05:
                del live[rid]  # finished
            elif roll < 0.25:
                live[rid] = live[rid] + (rng.randrange(1000),)  # took a block
            elif roll < 0.28 and live[rid]:
                live[rid] = (0, *live[rid][1:])  # released its first block to the null block
            elif roll < 0.31:
                live[rid] = tuple(live[rid])[:]  # the same ids
            elif roll < 0.34:
                live[rid] = tuple(list(live[rid]))  # the same ids in a new tuple (a worker's message)
        while len(live) < 12 or (rng.random() < 0.2 and len(live) < 40):
            live[f"r{next_id}"] = tuple(rng.randrange(1000) for _ in range(rng.randint(0, 30)))
            next_id += 1
        order = list(live)
        if step % 7 == 0:
            rng.shuffle(order)  # e.g. a preempted request back at the end
        tables = [live[rid] for rid in order]
        snapshot = None if previous is None else previous.clone()
        got = persistent.build(order, tables)
        width = max(max(map(len, tables), default=0), 1)
        assert torch.equal(got, block_table_tensor(tables, width)), step
        assert got.dtype == torch.int32 and got.is_contiguous()
        if previous is not None:
            assert torch.equal(previous, snapshot), "last step's table was written into"
        previous = got


def test_no_rows():
    persistent = PersistentBlockTable()
    assert persistent.build(["a"], [(3, 4)]).tolist() == [[3, 4]]
    assert tuple(persistent.build([], []).shape) == (0, 1)
    assert persistent.build(["a"], [()]).tolist() == [[0]]
