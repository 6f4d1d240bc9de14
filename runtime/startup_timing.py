"""Startup phases of one server process: marked where they end, logged once as one structured line.

The startup path calls `mark(phase)` as each part ends (imports, config, weight read, ...); `report()`
logs a single `startup: {...}` JSON line once the server is ready, with each phase's seconds in the order
they ended. A phase's time is the time since the previous mark, so the phases add up to the total since
the process started (measured from the kernel's process start time where /proc has it, so interpreter
start-up and imports before this module count too).

Phases that run many times (dequantising each tensor) are summed with `add(phase, seconds)` instead; the
time they take is then taken out of the enclosing mark's interval, so nothing is counted twice.

While the model loads, `weights(done, total)` counts the tensors copied in (logged at every tenth), and
`progress()` says where start-up stands — the phases done, the seconds so far, the weights' percent — for
`/ready`'s "loading" answer, so whoever waits on a slow load (a kubectl user, a router) sees it move.

Plain module state, not an object passed around: the marks sit in code that runs once per process, in
layers (model loader, engine, server) that do not otherwise share anything at startup.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

logger = logging.getLogger("tokenfleet.startup")

LOG_PREFIX = "startup: "


def _process_start_monotonic() -> float:
    """time.monotonic() at the moment the kernel started this process (Linux), else now."""
    now = time.monotonic()
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            # Field 22 (starttime, clock ticks since boot) follows the command name in parentheses, which
            # may itself contain spaces: split after its closing parenthesis.
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return now
    age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    # CLOCK_MONOTONIC and /proc/uptime (CLOCK_BOOTTIME) agree unless the machine was suspended meanwhile.
    return now - max(0.0, age)


_lock = threading.Lock()
_origin = _process_start_monotonic()
_last = _origin
_phases: dict[str, float] = {}
_pending = 0.0  # add()-ed seconds not yet taken out of a mark's interval
_reported = False
_weights: tuple[int, int] | None = None  # (tensors copied in, of total) while the model loads


def mark(phase: str) -> None:
    """End `phase` now: it gets the time since the previous mark (less what add() counted meanwhile)."""
    global _last, _pending
    with _lock:
        now = time.monotonic()
        _phases[phase] = _phases.get(phase, 0.0) + max(0.0, now - _last - _pending)
        _last, _pending = now, 0.0


def add(phase: str, seconds: float) -> None:
    """Count `seconds` to `phase` (repeated work inside another phase's interval)."""
    global _pending
    with _lock:
        _phases[phase] = _phases.get(phase, 0.0) + seconds
        _pending += seconds


class timed:
    """`with timed("dequant"): ...` — add() the block's duration to the phase."""

    __slots__ = ("_start", "phase")

    def __init__(self, phase: str):
        self.phase = phase

    def __enter__(self) -> timed:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        add(self.phase, time.perf_counter() - self._start)


def weights(done: int, total: int) -> None:
    """`done` of `total` weight tensors are in place; logged at every tenth (and the last)."""
    global _weights
    with _lock:
        _weights = (done, total)
    if total and (done == total or done * 10 // total != (done - 1) * 10 // total):
        logger.info("loading weights: %d/%d tensors (%d%%)", done, total, done * 100 // total)


def progress() -> dict:
    """Where start-up stands: phases done (in order), seconds since the process started, weights loaded."""
    with _lock:
        out: dict = {"phases_done": list(_phases), "seconds": round(time.monotonic() - _origin, 1)}
        if _weights is not None:
            done, total = _weights
            out["weights"] = {"done": done, "total": total, "percent": round(100 * done / max(total, 1))}
    return out


def phases() -> dict[str, float]:
    with _lock:
        return dict(_phases)


def report() -> dict | None:
    """Log the phases once (later calls do nothing) as `startup: {"phases": {...}, "total_s": ...}`."""
    global _reported
    with _lock:
        if _reported:
            return None
        _reported = True
        record = {
            "phases": {k: round(v, 4) for k, v in _phases.items()},
            "total_s": round(_last - _origin, 4),
        }
    logger.info(LOG_PREFIX + json.dumps(record))
    return record


def parse_line(line: str) -> dict | None:
    """The record of a `startup: {...}` log line (anywhere in it, after any log prefix), else None."""
    at = line.find(LOG_PREFIX + "{")
    if at < 0:
        return None
    try:
        return json.loads(line[at + len(LOG_PREFIX) :])
    except ValueError:
        return None


def reset() -> None:
    """Start over from now (tests; a process that builds a second engine)."""
    global _origin, _last, _pending, _reported, _weights
    with _lock:
        _origin = _last = time.monotonic()
        _phases.clear()
        _pending, _reported, _weights = 0.0, False, None
