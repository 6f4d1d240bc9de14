"""Apply fuzz documents to a real API server with the operator running, and judge what became of each.

Documents go in batches, one fresh namespace per batch (deleted once judged, so the operator's resync
timers only ever see a few live objects), several batches at once, creates through a bounded pool. A
create asks for strict field validation, as kubectl does: an unknown field is refused, not pruned.

What each document must become (`judge`):
- rejected by the API server (schema or CEL), with a message naming the offending field; or
- accepted, and the operator then writes a status for its generation whose conditions are each True or
  carry a reason and a message, and either
  - reconciled (ConfigValid True; a ModelDeployment Ready at zero replicas, or Pending on a policy that
    really does not exist, naming it), or
  - flagged: ConfigValid False with a message naming the field, and a Warning Event on the object.
A malformed document must never be reconciled as if nothing were wrong.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from audit_log import Call, by_document, reconciles
from crd_fuzz import API_VERSION, PLURALS, FuzzDoc
from kube_api import ApiError, KubeApi

WORD = re.compile(r"[A-Za-z][A-Za-z0-9]*")


@dataclass(frozen=True, slots=True)
class Outcome:
    doc: FuzzDoc
    namespace: str
    result: str  # rejected | reconciled | pending | flagged | unsettled
    message: str
    problems: tuple[str, ...] = ()


@dataclass
class BatchLog:
    """When each namespace was judged: calls made after it are its deletion's, not the documents'."""

    judged_at: dict[str, float] = field(default_factory=dict)
    started_at: dict[str, float] = field(default_factory=dict)


def names_field(message: str, doc: FuzzDoc, fields: set[str]) -> bool:
    """Whether `message` names the document's offending field (a malformed one), or any field at all."""
    if doc.leaf is not None:
        return doc.leaf in message
    return "metadata.name" in message or any(w in fields for w in WORD.findall(message))


def _conditions(stored: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type"): c for c in (stored.get("status") or {}).get("conditions") or []}


def _settled(doc: FuzzDoc, stored: dict[str, Any] | None, warned: bool, present: set[str]) -> bool:
    """The operator is done with it: a status for its generation, and what goes with it."""
    if stored is None:
        return False
    status = stored.get("status") or {}
    if status.get("observedGeneration") != stored["metadata"].get("generation"):
        return False
    valid = _conditions(stored).get("ConfigValid")
    if valid is None:
        return False
    if valid.get("status") != "True":
        return warned  # the Event is posted right after the status
    if doc.kind == "ModelDeployment":
        if status.get("phase") == "Pending":  # waiting for a policy: only right while it does not exist
            return bool(_refs(doc) - present)
        return status.get("phase") == "Ready"
    return True


def _refs(doc: FuzzDoc) -> set[str]:
    spec = doc.body.get("spec") or {}
    return {
        f"{kind}/{spec[key]}"
        for key, kind in (("cachePolicyRef", "CachePolicy"), ("routingPolicyRef", "RoutingPolicy"))
        if isinstance(spec.get(key), str)
    }


def judge(
    doc: FuzzDoc,
    namespace: str,
    refusal: tuple[int, str] | None,
    stored: dict[str, Any] | None,
    warned: bool,
    present: set[str],
    fields: set[str],
) -> Outcome:
    """Pure: the verdict on one document from the API server's answer and what is stored now."""
    problems: list[str] = []
    if refusal is not None:
        code, text = refusal
        # 422 Invalid (schema, CEL); 400 BadRequest is strict decoding's answer to an unknown field (also one
        # inside an object given where a scalar belongs).
        if code != 422 and not (code == 400 and "strict decoding error" in text):
            problems.append(f"refused with HTTP {code}, not 422 Invalid")
        if not names_field(text, doc, fields):
            problems.append(f"refusal does not name the field {doc.field or '(any)'}")
        return Outcome(doc, namespace, "rejected", text, tuple(problems))
    if not _settled(doc, stored, warned, present):
        status = (stored or {}).get("status")
        return Outcome(doc, namespace, "unsettled", json.dumps(status)[:600], ("no settled status",))
    assert stored is not None
    conditions = _conditions(stored)
    for ctype, cond in conditions.items():
        if cond.get("status") != "True" and not (cond.get("reason") and cond.get("message")):
            problems.append(f"condition {ctype} is {cond.get('status')} without a reason and message")
    valid = conditions["ConfigValid"]
    message = valid.get("message") or ""
    if valid["status"] != "True":
        if not names_field(message, doc, fields):
            problems.append(f"ConfigValid message does not name the field {doc.field or '(any)'}")
        return Outcome(doc, namespace, "flagged", message, tuple(problems))
    if doc.family == "malformed":
        problems.append(f"malformed ({doc.mutation} at {doc.field}) yet accepted and reconciled")
    if (stored.get("status") or {}).get("phase") == "Pending":
        ready = conditions.get("Ready") or {}
        message = ready.get("message") or ""
        missing = [ref for ref in _refs(doc) if ref.split("/", 1)[1] in message]
        if not missing:
            problems.append("Pending without naming the missing policy")
        return Outcome(doc, namespace, "pending", message, tuple(problems))
    return Outcome(doc, namespace, "reconciled", message, tuple(problems))


def _path(kind: str, namespace: str) -> str:
    return f"/apis/{API_VERSION}/namespaces/{namespace}/{PLURALS[kind]}"


async def _create(
    api: KubeApi, pool: asyncio.Semaphore, doc: FuzzDoc, namespace: str
) -> tuple[int, str] | None:
    async with pool:
        try:
            await api.request(
                "POST", _path(doc.kind, namespace), doc.body, params={"fieldValidation": "Strict"}
            )
        except ApiError as e:
            return e.status, e.text
    return None


async def _stored(api: KubeApi, namespace: str) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for kind in PLURALS:
        listing = await api.get(_path(kind, namespace)) or {}
        for item in listing.get("items") or []:
            out[(kind, item["metadata"]["name"])] = item
    return out


async def _warned(api: KubeApi, namespace: str) -> set[tuple[str, str]]:
    listing = await api.get(f"/api/v1/namespaces/{namespace}/events") or {}
    return {
        (e["involvedObject"].get("kind"), e["involvedObject"].get("name"))
        for e in listing.get("items") or []
        if e.get("type") == "Warning"
    }


async def run_batch(
    api: KubeApi,
    pool: asyncio.Semaphore,
    docs: list[FuzzDoc],
    fields: set[str],
    log: BatchLog,
    settle_seconds: float,
) -> list[Outcome]:
    namespace = f"fuzz-{uuid.uuid4().hex[:8]}"
    await api.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                     "metadata": {"name": namespace}})  # fmt: skip
    log.started_at[namespace] = time.time()
    try:
        refusals = await asyncio.gather(*(_create(api, pool, doc, namespace) for doc in docs))
        accepted = [d for d, r in zip(docs, refusals, strict=True) if r is None]
        present = {f"{d.kind}/{d.name}" for d in accepted}
        deadline = time.monotonic() + settle_seconds
        while True:
            async with pool:
                stored, warned = await _stored(api, namespace), await _warned(api, namespace)
            done = all(
                _settled(d, stored.get((d.kind, d.name)), (d.kind, d.name) in warned, present)
                for d in accepted
            )
            if done or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        log.judged_at[namespace] = time.time()
        return [
            judge(d, namespace, r, stored.get((d.kind, d.name)), (d.kind, d.name) in warned, present, fields)
            for d, r in zip(docs, refusals, strict=True)
        ]
    finally:
        await api.request("DELETE", f"/api/v1/namespaces/{namespace}")


async def run_fuzz(
    api: KubeApi,
    docs: list[FuzzDoc],
    fields: set[str],
    batch_size: int = 12,
    batches_at_once: int = 8,
    pool_size: int = 8,
    settle_seconds: float = 180.0,
) -> tuple[list[Outcome], BatchLog]:
    pool, lanes, log = asyncio.Semaphore(pool_size), asyncio.Semaphore(batches_at_once), BatchLog()

    async def lane(batch: list[FuzzDoc]) -> list[Outcome]:
        async with lanes:
            return await run_batch(api, pool, batch, fields, log, settle_seconds)

    batches = [docs[i : i + batch_size] for i in range(0, len(docs), batch_size)]
    results = await asyncio.gather(*(lane(b) for b in batches))
    return [o for batch in results for o in batch], log


@dataclass(frozen=True, slots=True)
class CallFigures:
    """The operator's API calls per accepted document, up to the moment its batch was judged."""

    calls: dict[str, int]  # document name -> calls attributed to it (itself and its children)
    reconciles: dict[str, int]  # document name -> reconciles (GETs of the object itself)
    lifetime: dict[str, float]  # document name -> seconds between its batch's start and its judgement

    def per_reconcile(self) -> dict[str, float]:
        return {n: self.calls[n] / max(1, self.reconciles.get(n, 0)) for n in self.calls}


def call_figures(outcomes: Iterable[Outcome], calls: list[Call], log: BatchLog) -> CallFigures:
    per_doc = by_document(calls, until=log.judged_at)
    counts, recs, life = {}, {}, {}
    for o in outcomes:
        if o.result == "rejected":
            continue
        mine = per_doc.get(o.doc.index, [])
        counts[o.doc.name] = len(mine)
        recs[o.doc.name] = reconciles(mine, PLURALS[o.doc.kind], o.doc.name)
        life[o.doc.name] = log.judged_at[o.namespace] - log.started_at[o.namespace]
    return CallFigures(counts, recs, life)
