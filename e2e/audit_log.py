"""The operator's API calls, counted from the API server's audit log (envtest.py writes one line per request
of the operator's identity, metadata only).

Counted by the server, not by the operator: a hot loop shows up whatever code path it takes (a kopf retry,
a timer, a handler patching what it watches). A call is attributed to a fuzz document by the token in the
object's name or in the request URI (a label selector naming it), see crd_fuzz.py.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from crd_fuzz import TOKEN


@dataclass(frozen=True, slots=True)
class Call:
    time: float  # when the server received it (epoch seconds)
    verb: str
    resource: str
    subresource: str
    namespace: str
    name: str
    uri: str
    code: int


def read_calls(path: Path, namespaces: Collection[str]) -> list[Call]:
    """The completed requests in `namespaces`, in the order the server logged them."""
    calls = []
    if not path.exists():
        return calls
    with path.open() as f:
        for line in f:
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            if ref.get("namespace") not in namespaces:
                continue
            received = dt.datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
            calls.append(
                Call(
                    time=received.timestamp(),
                    verb=event["verb"],
                    resource=ref.get("resource", ""),
                    subresource=ref.get("subresource", ""),
                    namespace=ref["namespace"],
                    name=ref.get("name", ""),
                    uri=event.get("requestURI", ""),
                    code=int((event.get("responseStatus") or {}).get("code") or 0),
                )
            )
    return calls


def document_of(call: Call) -> int | None:
    """The fuzz document a call is about: the token in the object's name, else in its URI (a list by label)."""
    found = TOKEN.search(call.name) or TOKEN.search(call.uri)
    return int(found.group(1)) if found else None


def by_document(calls: Iterable[Call], until: dict[str, float] | None = None) -> dict[int, list[Call]]:
    """Calls per document; with `until` (namespace -> time), only those made before that namespace's time."""
    out: dict[int, list[Call]] = {}
    for call in calls:
        if until is not None and call.time > until.get(call.namespace, float("inf")):
            continue
        index = document_of(call)
        if index is not None:
            out.setdefault(index, []).append(call)
    return out


def reconciles(calls: Iterable[Call], plural: str, name: str) -> int:
    """How often the operator reconciled the object: every reconcile (handler, timer, a child's event)
    starts with one GET of the object itself."""
    return sum(
        1 for c in calls if c.verb == "get" and c.resource == plural and c.name == name and not c.subresource
    )
