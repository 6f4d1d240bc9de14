"""JSONL trace replay: one request per line, replayed at its timestamp.

Each line is a JSON object:

    {"t": 0.25, "prompt_tokens": 900, "output_tokens": 120}
    {"t": 0.40, "prefix_group": "tenant-a", "prefix_tokens": 1024, "suffix_tokens": 200,
     "output_tokens": 80, "priority": 0, "session": "chat-17"}

- `t` (seconds, >= 0, non-decreasing): arrival time.
- The prompt is either `prompt_tokens` unique tokens, or the shared prefix of `prefix_group` (its
  `prefix_tokens`; every line of a group must give the same length) followed by `suffix_tokens` unique ones.
- `output_tokens` (>= 1): tokens generated (the request ends exactly there).
- `priority` (int, default 1; lower is served first), `session` (string, optional): a later line with the
  same session continues the conversation: its prompt is the previous turn's prompt + answer + the new
  suffix (`suffix_tokens`, or `prompt_tokens`). Turns are replayed at their own `t` (open loop).

Token ids are drawn from `seed`, so a trace + seed is a fixed workload. Errors name the line and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.workload import VOCAB_HIGH, VOCAB_LOW, SimRequest

_KNOWN = {
    "t",
    "prompt_tokens",
    "prefix_group",
    "prefix_tokens",
    "suffix_tokens",
    "output_tokens",
    "priority",
    "session",
}


class TraceWorkload:
    def __init__(self, path: Path, seed: int = 0) -> None:
        self.path = Path(path)
        self.seed = seed
        try:
            self._lines = self.path.read_text().splitlines()
        except OSError as e:
            raise SimInputError("trace", f"cannot read {path}: {e}") from e
        self._records = [self._parse(i + 1, line) for i, line in enumerate(self._lines) if line.strip()]
        if not self._records:
            raise SimInputError("trace", f"{path} holds no requests")
        self.duration_s = self._records[-1]["t"]

    def _parse(self, lineno: int, line: str) -> dict:
        where = f"trace line {lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SimInputError(where, f"not JSON: {e.msg}") from None
        if not isinstance(rec, dict):
            raise SimInputError(where, "expected a JSON object")
        unknown = set(rec) - _KNOWN
        if unknown:
            raise SimInputError(f"{where}: {sorted(unknown)[0]}", "unknown field", _KNOWN)

        def num(key: str, minimum: float, required: bool = True, kind=int):
            if key not in rec:
                if required:
                    raise SimInputError(f"{where}: {key}", "missing")
                return None
            value = rec[key]
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or (kind is int and value != int(value))
            ):
                raise SimInputError(
                    f"{where}: {key}",
                    f"expected {'an integer' if kind is int else 'a number'}, got {value!r}",
                )
            if value < minimum:
                raise SimInputError(f"{where}: {key}", f"must be >= {minimum}, got {value}")
            return kind(value)

        out = {
            "t": num("t", 0, kind=float),
            "output_tokens": num("output_tokens", 1),
            "priority": num("priority", -(2**31), required=False) if "priority" in rec else 1,
            "session": rec.get("session"),
            "prompt_tokens": num("prompt_tokens", 1, required=False),
            "suffix_tokens": num("suffix_tokens", 0, required=False),
            "prefix_group": rec.get("prefix_group"),
            "prefix_tokens": num("prefix_tokens", 1, required=False),
        }
        if out["session"] is not None and not isinstance(out["session"], str):
            raise SimInputError(f"{where}: session", "expected a string")
        if out["prefix_group"] is not None:
            if out["prefix_tokens"] is None:
                raise SimInputError(f"{where}: prefix_tokens", "required with prefix_group")
        elif out["prompt_tokens"] is None and out["session"] is None:
            raise SimInputError(
                f"{where}: prompt_tokens", "give prompt_tokens or prefix_group + prefix_tokens"
            )
        if getattr(self, "_last_t", 0.0) > out["t"]:
            raise SimInputError(f"{where}: t", f"goes back in time ({out['t']} < {self._last_t})")
        self._last_t = out["t"]
        return out

    def arrivals(self) -> Iterator[SimRequest]:
        content = np.random.Generator(np.random.PCG64(self.seed + 1_000_003))

        def tokens(n: int) -> list[int]:
            return content.integers(VOCAB_LOW, VOCAB_HIGH, size=n).tolist()

        def output(n: int) -> list[int]:
            return [int(content.integers(VOCAB_LOW, VOCAB_HIGH))] * n  # one token, repeated (replica.py)

        groups: dict[str, list[int]] = {}
        sessions: dict[str, SimRequest] = {}
        for i, rec in enumerate(self._records):
            suffix = rec["suffix_tokens"] if rec["suffix_tokens"] is not None else (rec["prompt_tokens"] or 0)
            prev = sessions.get(rec["session"]) if rec["session"] is not None else None
            if prev is not None:
                prompt = prev.prompt + prev.output + tokens(suffix)
            elif rec["prefix_group"] is not None:
                group = groups.setdefault(rec["prefix_group"], tokens(rec["prefix_tokens"]))
                if len(group) != rec["prefix_tokens"]:
                    raise SimInputError(
                        f"trace request {i + 1}: prefix_tokens",
                        f"group {rec['prefix_group']!r} was {len(group)} tokens before",
                    )
                prompt = group + tokens(suffix)
            else:
                prompt = tokens(rec["prompt_tokens"])
            if not prompt:
                raise SimInputError(f"trace request {i + 1}: prompt_tokens", "the prompt is empty")
            req = SimRequest(
                f"r{i + 1}",
                rec["t"],
                prompt,
                output(rec["output_tokens"]),
                rec["priority"],
                rec["session"],
                rec["prefix_group"],
                0 if prev is None else prev.turn + 1,
                prefix_key=None if prev is not None else rec["prefix_group"],
                prefix_len=rec["prefix_tokens"] or 0,
                parent=prev,
            )
            if rec["session"] is not None:
                sessions[rec["session"]] = req
            yield req

    def follow_up(self, previous: SimRequest, finished_at: float) -> SimRequest | None:
        return None  # turns are lines of the trace
