"""The collector settings an engine process runs with: a step's short-lived entries trigger no young
collection, cyclic garbage is still collected, and a bounded run gives the process its settings back."""

from __future__ import annotations

import gc

from tokenfleet.runtime.engine.long_lived_heap import YOUNG_THRESHOLD, long_lived_heap


def _young_collections_during(fn) -> int:
    count = 0

    def callback(phase: str, info: dict) -> None:
        nonlocal count
        if phase == "start":
            count += 1

    gc.callbacks.append(callback)
    try:
        fn()
    finally:
        gc.callbacks.remove(callback)
    return count


def _steps(num_steps: int = 50, num_seqs: int = 1024) -> None:
    """What a step allocates per running sequence and frees by reference counting a step later."""
    previous = None
    for step in range(num_steps):
        entries = [(f"r{i}", (step,), step, (), True, ()) for i in range(num_seqs)]
        sampled = {e[0]: [step] for e in entries}
        previous = (entries, sampled)
    del previous


def test_a_step_of_1024_sequences_runs_no_young_collection_and_the_run_restores_the_process():
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    assert _young_collections_during(_steps) > 0  # the control: CPython's default threshold
    with long_lived_heap():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > frozen_before  # what existed is out of the collector's walks
        assert _young_collections_during(_steps) == 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_cyclic_garbage_is_still_collected():
    class Node:
        pass

    def make_cycles() -> None:
        for _ in range(YOUNG_THRESHOLD):
            a, b = Node(), Node()
            a.other, b.other = b, a

    with long_lived_heap():
        collections = _young_collections_during(make_cycles)
        dead = sum(isinstance(o, Node) for o in gc.get_objects())
    assert collections > 0
    assert dead < YOUNG_THRESHOLD  # 100,000 were made: the collections freed most of them
