"""The progress line `tokenfleet fetch` writes to its log, and its parser.

One JSON object after a fixed prefix, e.g.

    fetch: {"phase": "download", "bytes": 123, "total": 456, "percent": 27.0, "file": "model.safetensors"}

Phases: resolve, wait (for another pod's download of the same entry), verify, download, error (a failed
attempt, with its reason and the back-off before the next), failed (the last attempt failed) and done
(with "cache": "hit" | "miss", "seconds", "bytes").

The operator reads the last such line of an init container's log to show a download's progress or its
failure reason, so this module imports nothing but json: the operator may import it without the runtime's
dependencies.
"""

from __future__ import annotations

import json

PREFIX = "fetch: "
PHASES = ("resolve", "wait", "verify", "download", "error", "failed", "done")


def format_progress(**fields: object) -> str:
    """One log line: the prefix, then the fields as one JSON object (in the order given)."""
    return PREFIX + json.dumps(fields)


def parse_progress(line: str) -> dict[str, object] | None:
    """The fields of a progress line, or None for any other line.

    A line may start with a timestamp (`kubectl logs --timestamps`, the API's `timestamps=true`): one
    whitespace-free word before the prefix is allowed.
    """
    head, sep, body = line.strip().partition(PREFIX)
    if not sep or len(head.split()) > 1:
        return None
    try:
        fields = json.loads(body)
    except ValueError:
        return None
    if not isinstance(fields, dict) or not isinstance(fields.get("phase"), str):
        return None
    return fields


def last_progress(log: str) -> dict[str, object] | None:
    """The fields of the last progress line in a log, or None when it has none."""
    for line in reversed(log.splitlines()):
        fields = parse_progress(line)
        if fields is not None:
            return fields
    return None
