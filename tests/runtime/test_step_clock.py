"""StepClock: model time and the host gap between steps, counted only while the engine stays busy."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.step_clock import StepClock


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_gaps_run_from_one_steps_end_to_the_next_ones_start_and_pause_forgets_the_last_end():
    t = FakeTime()
    clock = StepClock(enabled=True, now=t)
    for start, end in ((0.0, 1.0), (1.5, 2.0), (2.25, 3.0)):
        t.now = start
        clock.begin()
        t.now = end
        clock.end()
    assert clock.model_seconds == pytest.approx(2.25)
    assert (clock.host_gap_seconds, clock.num_gaps, clock.num_model_runs) == (pytest.approx(0.75), 2, 3)
    clock.pause()  # idle from 3.0 to 10.0: not host work
    t.now = 10.0
    clock.begin()
    t.now = 10.5
    clock.end()
    assert (clock.host_gap_seconds, clock.num_gaps, clock.num_model_runs) == (pytest.approx(0.75), 2, 4)


def test_a_disabled_clock_counts_nothing():
    t = FakeTime()
    clock = StepClock(enabled=False, now=t)
    clock.begin()
    t.now = 1.0
    clock.end()
    clock.begin()
    assert (clock.model_seconds, clock.host_gap_seconds, clock.num_model_runs, clock.num_gaps) == (0, 0, 0, 0)


def test_the_engine_counts_one_gap_between_consecutive_steps_and_none_across_idle_time(default_model):
    from tokenfleet.runtime.config import RuntimeConfig
    from tokenfleet.runtime.engine.engine_core import EngineCore

    config = RuntimeConfig.model_validate(
        {"model": {"dtype": "float32", "attention_backend": "torch"}, "cache": {"num_blocks": 64}}
    )
    core = EngineCore(config, loaded=default_model)
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        for round_ in range(2):  # the engine runs out of work between the two
            core.add_request(f"r{round_}", [10, 20, 30], params)
            while core.has_unfinished():
                core.step()
        stats = core.stats()
        # Five steps per request (the prompt with its first token, then four decodes): four gaps each.
        assert stats.num_steps == 10 and stats.num_host_gaps == 8
        assert stats.model_seconds_total > 0 and stats.host_gap_seconds_total > 0
        assert core.runner.clock.num_model_runs == 10
    finally:
        core.shutdown()
