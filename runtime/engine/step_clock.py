"""StepClock: how long each step's model work runs (the forward pass, logits and sampling: what a GPU
runs as kernels), and how long the host keeps the model waiting between two steps.

Everything else a step does (scheduling, preparing inputs, applying the results, detokenizing, and the
server's own work in the same process: HTTP, SSE framing, the GIL it holds) sits between one step's model
work and the next one's. When the model is cheap, or a GPU finishes it in a few milliseconds, that gap sets
the pace, and hiding it behind the device is what overlapped scheduling and CUDA graphs are for. The clock
makes it visible per pod (`tokenfleet:engine_host_gap_seconds` over `tokenfleet:engine_host_gaps`) and
lets `bench/host_overhead.py` split a served pod's step into model and host time beside the offline
engine's.

A gap is counted only between steps of a busy engine: `pause()` (the engine ran out of work, or a step
scheduled nothing) forgets the last end, so idle time between requests never counts. A speculative
drafter's proposals and commands run between steps (KV transfers, policy changes) do count: the model
waits for them too. Building the sampled-token map (a few dict writes per request) counts as model time.

Host clock only (`perf_counter`), so the figures mean what they say only where the model runs on the host:
the clock is off on other devices, where a kernel launch returns before the device has finished and the
split would be wrong (the sampler's read of the results waits for the device).
"""

from __future__ import annotations

import time


class StepClock:
    """Cumulative model and host-gap seconds; `begin()` / `end()` around each step's model work."""

    def __init__(self, enabled: bool, now=time.perf_counter):
        self.enabled = enabled
        self.model_seconds = 0.0
        self.host_gap_seconds = 0.0
        self.num_model_runs = 0
        self.num_gaps = 0
        self._now = now
        self._start = 0.0
        self._last_end: float | None = None

    def begin(self) -> None:
        if not self.enabled:
            return
        now = self._now()
        if self._last_end is not None:
            self.host_gap_seconds += now - self._last_end
            self.num_gaps += 1
        self._start = now

    def end(self) -> None:
        if not self.enabled:
            return
        now = self._now()
        self.model_seconds += now - self._start
        self.num_model_runs += 1
        self._last_end = now

    def pause(self) -> None:
        """The engine has no work scheduled: the time until the next step is idle, not host work."""
        self._last_end = None
