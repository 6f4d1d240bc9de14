"""The autoscaler: sizes every ModelDeployment that has `spec.autoscaling` from what its pods report.

A kopf timer per such ModelDeployment runs one decision every interval:
1. read the ModelDeployment fresh and list its pods (the Deployment's label selector);
2. observe them and the routers of its RoutingPolicy (fleet_scrape.py: classify, scrape `/metrics`; the
   recent scrapes kept in the object's kopf memo);
3. call the one policy, `autoscaling_policy.decide`, with the history kept in `status.autoscaling`
   (level-based: a restarted operator continues the same windows and cooldowns);
4. before a scale-down, set each Ready pod's `controller.kubernetes.io/pod-deletion-cost` to its requests
   in flight (deletion_cost.py), so the ReplicaSet removes the idlest pods;
5. write `spec.replicas` through the ModelDeployment's scale subresource, then `status.autoscaling`, and an
   Event with the reason whenever the count changes: the status records only a count that was written;
6. with `autoscaling.idle: sleep`, the policy's count is the pods to keep *awake*: warm_tier.py turns it into
   the count to write (awake plus the pods kept asleep) and the pods to put to sleep or wake, which this
   module then calls with the deployment's internal key (`status.autoscaling.scaledReplicas` is the count
   written, `awakeReplicas` / `sleepingReplicas` / `startingReplicas` what was seen).

Between decisions a second timer reads only the routers, every DEMAND_POLL_SECONDS: the requests they hold
for the model and its pods' queues as their load reports said. When `demand_calls_decision` says that
calls for more (from zero, or at the start of a burst), the same decision runs at once instead of up to a
whole interval later.

Why the ModelDeployment's `/scale` and not the Deployment's: the reconcile writes the Deployment's replicas
from `spec.replicas` (server-side apply), and each field has one writer. The autoscaler stands exactly where
an HPA targeting `md/NAME` would, so `kubectl get md` shows the count it chose and rollouts keep working.

Manual scaling while autoscaling is on: the autoscaler decides from its own last count
(`status.autoscaling.desiredReplicas`), not from a `kubectl scale` made since, and writes its decision back
with an Event `ManualScaleOverridden` — the HPA's contract.

A disaggregated ModelDeployment is sized role by role (`disaggregation.<role>.autoscaling`): the same
policy, each role's own pods (its Deployment's selector), its own history in `status.roles.<role>.autoscaling`,
and its count written to `spec.disaggregation.<role>.replicas` by a conditional JSON patch of that one field
(a role has no scale subresource). That patch goes first, even when the count stays, and the role's status
only after it applied: a spec changed since it was read (switched to aggregated, a role count edited)
refuses it (422) and the decision is dropped, so no status records a decision that was never applied. Each
part is decided on its own: one role's failure leaves the other's decision standing. The routers' held
requests count as decode demand only (`scale_targets`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf
from kubernetes.client.exceptions import ApiException
from tokenfleet.operator import warm_tier
from tokenfleet.operator.api import GROUP, VERSION, ModelDeploymentSpec, parse_model_deployment
from tokenfleet.operator.autoscaling_policy import (
    AutoscalingSpec,
    Decision,
    PodSample,
    PodState,
    decide,
    demand_calls_decision,
)
from tokenfleet.operator.autoscaling_status import autoscaling_status, history_from_status
from tokenfleet.operator.builders import model_mount, selector_string
from tokenfleet.operator.deletion_cost import POD_DELETION_COST, cost_annotations, deletion_costs
from tokenfleet.operator.disaggregation import ROLES, role_name
from tokenfleet.operator.fleet_scrape import (
    ScrapeBook,
    cold_start_seconds,
    fetch_text,
    observe,
    pod_view,
    scrape_session,
)
from tokenfleet.operator.internal_key import read_internal_key
from tokenfleet.operator.pod_metrics import MetricsParseError, router_gauges
from tokenfleet.operator.reconcile import OperatorContext
from tokenfleet.operator.router_builders import ROUTER_PORT, router_selector
from tokenfleet.runtime.errors import ConfigError

MD = (GROUP, VERSION, "modeldeployments")
DEFAULT_INTERVAL_SECONDS = 15.0
# Between decisions the routers' demand is read this often (a cheap scrape of the router pods only).
DEMAND_POLL_SECONDS = 1.0
# A pod put to sleep waits this long for requests in flight (it was idle when chosen; one may have just
# arrived) before refusing; the call itself is bounded a little above it.
SLEEP_DRAIN_SECONDS = 5.0
SLEEP_CALL_TIMEOUT_SECONDS = 30.0


# ------------------------------------------------------------------------------------------------ a decision
@dataclass(frozen=True, slots=True)
class ScaleTarget:
    """What one decision sizes: the whole fleet of an aggregated deployment, or one role's pods."""

    role: str | None  # None: the fleet (spec.replicas); else "prefill" / "decode"
    autoscaling: AutoscalingSpec
    replicas: int  # the count the spec says now
    selector: str  # its pods
    previous: Mapping[str, Any]  # its status.autoscaling as stored
    routers: bool  # whether the routers' held requests count as its demand


def scale_targets(name: str, spec: ModelDeploymentSpec, status: Mapping[str, Any]) -> list[ScaleTarget]:
    """The autoscaled parts of a ModelDeployment (pure).

    Disaggregated, each role is sized from its own pods only: a prefill pod's queue and TTFT say nothing
    about decode capacity, and a decode pod's KV usage nothing about prefill. The requests routers hold
    count as decode demand alone: a request takes a decode slot for its whole generation (a prefill slot
    for its prompt only), so it is decode capacity that bounds how many run at once.
    """
    if spec.disaggregation is None:
        if spec.autoscaling is None:
            return []
        previous = status.get("autoscaling") or {}
        return [ScaleTarget(None, spec.autoscaling, spec.replicas, selector_string(name), previous, True)]
    out = []
    for role in ROLES:
        r = getattr(spec.disaggregation, role)
        if r.autoscaling is not None:
            previous = ((status.get("roles") or {}).get(role) or {}).get("autoscaling") or {}
            selector = selector_string(role_name(name, role))
            out.append(ScaleTarget(role, r.autoscaling, r.replicas, selector, previous, role == "decode"))
    return out


async def autoscale(
    ctx: OperatorContext,
    namespace: str,
    name: str,
    book: ScrapeBook,
    session: aiohttp.ClientSession,
    now: float,
    logger: logging.Logger,
) -> Decision | None:
    """One decision for an aggregated ModelDeployment; None when it has no (valid) autoscaling spec, is
    disaggregated (`autoscale_roles`), is going away, or the decision could not be written."""
    decisions = await autoscale_all(ctx, namespace, name, book, session, now, logger)
    return decisions.get(None)


async def autoscale_roles(
    ctx: OperatorContext,
    namespace: str,
    name: str,
    book: ScrapeBook,
    session: aiohttp.ClientSession,
    now: float,
    logger: logging.Logger,
) -> dict[str, Decision]:
    """One decision per autoscaled role of a disaggregated ModelDeployment, by role."""
    decisions = await autoscale_all(ctx, namespace, name, book, session, now, logger)
    return {role: d for role, d in decisions.items() if role is not None}


async def autoscale_all(
    ctx: OperatorContext,
    namespace: str,
    name: str,
    book: ScrapeBook,
    session: aiohttp.ClientSession,
    now: float,
    logger: logging.Logger,
) -> dict[str | None, Decision]:
    """What the timer runs each period: the decision of every autoscaled part (key None: the whole fleet)
    that was written; a part whose API calls failed (logged) or whose spec changed since it was read has
    none this period."""
    kube = ctx.kube
    body = await asyncio.to_thread(kube.get, "ModelDeployment", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return {}
    try:
        spec = parse_model_deployment(body.get("spec"))
    except ConfigError:
        return {}  # the reconcile reports an invalid spec (status condition and Event)
    targets = scale_targets(name, spec, body.get("status") or {})
    if not targets:
        return {}
    routers: list[Mapping[str, Any]] = []
    if spec.routing_policy_ref and any(t.routers for t in targets):
        selector = ",".join(f"{k}={v}" for k, v in router_selector(spec.routing_policy_ref).items())
        routers = await asyncio.to_thread(kube.list, "Pod", namespace, selector)
    model = model_mount(spec, {}).served_name  # the name clients send, which the router's gauge is keyed by
    out: dict[str | None, Decision] = {}
    for target in targets:
        scoped = book if target.role is None else book.scoped(target.role)
        try:
            decision = await _decide(
                ctx, body, target, routers if target.routers else [], model, scoped, session, now, logger
            )
        except Exception as e:  # an API hiccup on one role must not cost the other role its decision
            what = "" if target.role is None else f"{target.role}: "
            logger.warning("autoscaler: %sno decision this period: %s", what, e)
            continue
        if decision is not None:
            out[target.role] = decision
    return out


async def _decide(
    ctx: OperatorContext,
    body: Mapping[str, Any],
    target: ScaleTarget,
    routers: list[Mapping[str, Any]],
    model: str,
    book: ScrapeBook,
    session: aiohttp.ClientSession,
    now: float,
    logger: logging.Logger,
) -> Decision | None:
    """One part's decision, written; None when the spec changed since it was read (nothing written)."""
    kube = ctx.kube
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    pods = await asyncio.to_thread(kube.list, "Pod", namespace, target.selector)
    seen = await observe(session, pods, routers, model, target.autoscaling, book, now)
    what = "" if target.role is None else f"{target.role}: "
    if seen.router_failures:
        logger.info(
            "autoscaler: %s%d router pod(s) did not report pending requests", what, seen.router_failures
        )

    # The count this autoscaler last wrote: awake pods plus (idle: sleep) the pods it keeps asleep.
    last = target.previous.get("scaledReplicas", target.previous.get("desiredReplicas"))
    written = last if isinstance(last, int) else target.replicas
    current = warm_tier.awake_count(written, seen.samples)
    decision = decide(
        current,
        seen.samples,
        target.autoscaling,
        history_from_status(target.previous),
        now,
        seen.pending_requests,
    )
    warm = warm_tier.plan(decision.replicas, written, seen.samples, target.autoscaling)
    scaled = decision.replicas != current
    observed = {
        "pending": seen.pending_requests,
        **{s.value: sum(p.state is s for p in seen.samples) for s in PodState if s is not PodState.SLEEPING},
    }
    if routers:
        observed["router_scrape_failures"] = seen.router_failures
    states = {s: sum(p.state is s for p in seen.samples) for s in PodState}
    status = autoscaling_status(decision, target.previous, scaled, now, observed, cold_start_seconds(pods))
    status |= {
        "scaledReplicas": warm.replicas,
        "awakeReplicas": states[PodState.READY] + states[PodState.UNKNOWN],
        "sleepingReplicas": states[PodState.SLEEPING],
        "startingReplicas": states[PodState.STARTING],
    }
    if warm.replicas < target.replicas:
        # Before the count drops: the ReplicaSet then removes the pods with the fewest requests in flight.
        await _mark_deletion_costs(ctx, namespace, pods, seen.samples, logger)
    if not await _write_count(ctx, namespace, name, target, warm.replicas):
        logger.info(
            "autoscaler: %sdecision dropped, the spec changed since it was read (%s)", what, decision.reason
        )
        return None
    patch: dict[str, Any] = {"autoscaling": status}
    if target.role is not None:
        patch = {"roles": {target.role: patch}}
    await asyncio.to_thread(kube.patch_status, "ModelDeployment", namespace, name, patch)
    field = "replicas" if target.role is None else f"disaggregation.{target.role}.replicas"
    if target.replicas != written:
        ctx.event(
            dict(body),
            "Normal",
            "ManualScaleOverridden",
            f"{field} were set to {target.replicas} outside the autoscaler, which owns them while "
            f"{'spec.autoscaling' if target.role is None else f'disaggregation.{target.role}.autoscaling'} "
            f"is set: now {decision.replicas} ({decision.reason})",
        )
    elif scaled:
        reason = "ScaledUp" if decision.replicas > current else "ScaledDown"
        ctx.event(dict(body), "Normal", reason, what + decision.reason)
    if scaled or target.replicas != warm.replicas:
        logger.info("autoscaler: %s%s", what, decision.reason)
    if warm.sleep or warm.wake:
        await _sleep_and_wake(ctx, body, warm, seen.urls, target.autoscaling.level, logger)
    return decision


async def _sleep_and_wake(
    ctx: OperatorContext,
    body: Mapping[str, Any],
    warm: warm_tier.WarmPlan,
    urls: Mapping[str, str],
    level: int,
    logger: logging.Logger,
) -> None:
    """Put `warm.sleep` to sleep and wake `warm.wake`, all at once, with the deployment's internal key (only
    it opens a pod's sleep endpoints). Best effort: a pod that refuses (requests in flight: 409) or cannot be
    reached stays as it is, and the next decision sees it as it is and asks again."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    try:
        key = await asyncio.to_thread(read_internal_key, ctx.kube, namespace, name)
    except ApiException as e:
        logger.warning(
            "autoscaler: the internal key cannot be read (%s): no pod put to sleep or woken", e.reason
        )
        return
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    calls = [(pod, f"/sleep?level={level}&timeout={SLEEP_DRAIN_SECONDS:g}") for pod in warm.sleep]
    calls += [(pod, "/wake_up") for pod in warm.wake]
    timeout = aiohttp.ClientTimeout(total=SLEEP_CALL_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:

        async def call(pod: str, path: str) -> tuple[int | None, str]:
            if pod not in urls:
                return None, "no address"
            try:
                async with session.post(urls[pod] + path) as response:
                    return response.status, (await response.text())[:200]
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                return None, f"{type(e).__name__}: {e}"

        outcomes = await asyncio.gather(*(call(pod, path) for pod, path in calls))
    done: dict[str, list[str]] = {"sleep": [], "wake": []}
    for (pod, path), (code, text) in zip(calls, outcomes, strict=True):
        what = "sleep" if path.startswith("/sleep") else "wake"
        if code == 200:
            done[what].append(pod)
        elif what == "wake" and code is not None and code >= 500:
            # The pod answered and could not wake (say, its freed device memory was taken meanwhile); it
            # stays asleep, and asking again may fail the same way while demand waits. A new pod is sure:
            # delete this one and its ReplicaSet replaces it (a cold start instead of a wake).
            await _replace(ctx, body, pod, f"HTTP {code}: {text}", logger)
        else:
            error = text if code is None else f"HTTP {code}: {text}"
            logger.info("autoscaler: %s of pod %s refused (%s); asked again next decision", what, pod, error)
    if done["sleep"]:
        ctx.event(dict(body), "Normal", "PodsAsleep", f"level {level}: {', '.join(done['sleep'])}")
    if done["wake"]:
        ctx.event(dict(body), "Normal", "PodsWoken", ", ".join(done["wake"]))


async def _replace(
    ctx: OperatorContext, body: Mapping[str, Any], pod: str, why: str, logger: logging.Logger
) -> None:
    namespace = body["metadata"]["namespace"]
    try:
        await asyncio.to_thread(ctx.kube.delete, "Pod", namespace, pod)
    except ApiException as e:
        logger.warning("autoscaler: pod %s could not wake (%s) and was not deleted: %s", pod, why, e.reason)
        return
    ctx.event(
        dict(body), "Warning", "WakeFailed", f"pod {pod} could not wake ({why}): deleted, to be replaced"
    )


async def _mark_deletion_costs(
    ctx: OperatorContext,
    namespace: str,
    pods: list[Mapping[str, Any]],
    samples: tuple[PodSample, ...],
    logger: logging.Logger,
) -> None:
    """Set each Ready pod's pod-deletion-cost to its in-flight requests (deletion_cost.py). Best effort:
    a pod gone meanwhile or a refused write costs only the choice of which pod goes, never the decision."""
    for pod, cost in cost_annotations(pods, deletion_costs(samples)).items():
        try:
            await asyncio.to_thread(ctx.kube.annotate, "Pod", namespace, pod, {POD_DELETION_COST: cost})
        except ApiException as e:
            logger.info("autoscaler: pod %s: deletion cost not set (%s)", pod, e.reason)


async def _write_count(
    ctx: OperatorContext, namespace: str, name: str, target: ScaleTarget, replicas: int
) -> bool:
    """Write the decided count before anything records it; False when the spec no longer holds what the
    decision was made from (the write was refused and nothing changed)."""
    kube = ctx.kube
    if target.role is None:
        if target.replicas != replicas:
            await asyncio.to_thread(kube.scale, "ModelDeployment", namespace, name, replicas)
        return True
    # The role's count is a spec field with no scale subresource of its own: a JSON patch of exactly that
    # field (the reconcile then writes it to the role's Deployment), on the condition that it still holds
    # what was read — a spec switched to aggregated meanwhile must not get a `disaggregation` back from a
    # late decision. The condition goes even when the count stays (a patch that changes nothing writes
    # nothing): the role's status written next must not land on a spec that has moved on either.
    path = f"/spec/disaggregation/{target.role}/replicas"
    ops = [{"op": "test", "path": path, "value": target.replicas}]
    if target.replicas != replicas:
        ops.append({"op": "replace", "path": path, "value": replicas})
    try:
        await asyncio.to_thread(kube.patch, "ModelDeployment", namespace, name, ops)
    except ApiException as e:
        if e.status != 422:  # 422: a `test` failed (the value changed, or the path is gone)
            raise
        return False
    return True


def autoscaling_changed(
    ctx: OperatorContext,
    namespace: str,
    name: str,
    new: Any,
    status: Mapping[str, Any] | None,
    role: str | None = None,
) -> bool:
    """`spec.autoscaling` (or a role's) changed to `new`; when it is gone, clear the old decision (the
    replicas are the user's again, from their current value) and say whether status was written."""
    status = status or {}
    stored = (
        status.get("autoscaling")
        if role is None
        else ((status.get("roles") or {}).get(role) or {}).get("autoscaling")
    )
    if new or stored is None:
        return False
    patch = {"autoscaling": None} if role is None else {"roles": {role: {"autoscaling": None}}}
    ctx.kube.patch_status("ModelDeployment", namespace, name, patch)
    return True


# ------------------------------------------------------------------------------------------------ kopf wiring
def _autoscaling_on(spec: Mapping[str, Any], **_: Any) -> bool:
    spec = spec or {}
    roles = spec.get("disaggregation") or {}
    return bool(spec.get("autoscaling")) or any((roles.get(r) or {}).get("autoscaling") for r in ROLES)


def _decision_lock(memo: kopf.Memo) -> asyncio.Lock:
    """One decision at a time per object: the periodic one and the ones demand triggers."""
    return memo.setdefault("autoscaler_lock", asyncio.Lock())


def _demand_watched(spec: Mapping[str, Any], **_: Any) -> bool:
    """Autoscaled and behind routers: their demand is read every second between decisions."""
    spec = spec or {}
    return bool(spec.get("autoscaling")) and bool(spec.get("routingPolicyRef"))


@dataclass(frozen=True, slots=True)
class RouterDemand:
    awake: int  # pods serving or on their way, as the last decision saw them (0 at zero replicas)
    held: int  # requests the routers hold for the model
    waiting: int  # requests queued in its pods, as the routers last heard (the most any router saw)


async def router_demand(
    ctx: OperatorContext, namespace: str, name: str, session: aiohttp.ClientSession
) -> tuple[RouterDemand, AutoscalingSpec] | None:
    """What the routers of a deployment see of its demand now, read from their /metrics at once; None when
    it has no valid spec or no router. Held requests add up over routers (each holds its own); the pods'
    queues are the same pods seen by every router, so the largest figure counts."""
    body = await asyncio.to_thread(ctx.kube.get, "ModelDeployment", namespace, name)
    if body is None:
        return None
    try:
        spec = parse_model_deployment(body.get("spec"))
    except ConfigError:
        return None
    if not spec.routing_policy_ref or spec.autoscaling is None:
        return None
    selector = ",".join(f"{k}={v}" for k, v in router_selector(spec.routing_policy_ref).items())
    routers = await asyncio.to_thread(ctx.kube.list, "Pod", namespace, selector)
    urls = [v.url for v in (pod_view(p, ROUTER_PORT) for p in routers) if v is not None and v.url]
    if not urls:
        return None
    model = model_mount(spec, {}).served_name
    held = waiting = 0.0
    for text in await asyncio.gather(*(fetch_text(session, url) for url in urls)):
        try:
            h, w = router_gauges(text, model) if text is not None else (0.0, 0.0)
        except MetricsParseError:
            continue
        held, waiting = held + h, max(waiting, w)
    last = ((body.get("status") or {}).get("autoscaling")) or {}
    if spec.replicas == 0:
        awake = 0
    elif "awakeReplicas" in last:
        awake = int(last.get("awakeReplicas") or 0) + int(last.get("startingReplicas") or 0)
    else:
        awake = spec.replicas
    return RouterDemand(awake, round(held), round(waiting)), spec.autoscaling


def register(
    registry: kopf.OperatorRegistry,
    interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
    demand_seconds: float = DEMAND_POLL_SECONDS,
) -> None:
    @kopf.timer(
        *MD,
        interval=interval_seconds,
        sharp=True,  # decisions on a steady beat, whatever one took
        when=_autoscaling_on,
        id="autoscaler",
        registry=registry,
    )
    async def autoscaler_tick(
        memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **_: Any
    ) -> None:
        book = memo.setdefault("autoscaler_scrapes", ScrapeBook())  # the per-object memo
        async with _decision_lock(memo), scrape_session() as session:
            try:
                await autoscale_all(memo.ctx, namespace, name, book, session, time.time(), logger)
            except Exception as e:  # an API hiccup: the next tick decides again from stored state
                logger.warning("autoscaler: no decision this period: %s", e)

    @kopf.timer(*MD, interval=demand_seconds, when=_demand_watched, id="autoscaler-demand", registry=registry)
    async def demand_tick(
        memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **_: Any
    ) -> None:
        """Demand should not wait for the next decision (up to a whole interval, longer than the cold start
        it then waits for): the routers are read every `demand_seconds`, and when what they see calls for
        more (`demand_calls_decision`: requests held, at zero or behind busy pods, or the pods' queues over
        the target) the same decision runs at once."""
        async with scrape_session() as session:
            try:
                seen = await router_demand(memo.ctx, namespace, name, session)
            except Exception as e:
                logger.debug("autoscaler: routers' demand not read: %s", e)  # every second: not worth more
                return
            if seen is None:
                return
            demand, spec = seen
            if not demand_calls_decision(demand.awake, demand.held, demand.waiting, spec):
                return
            book = memo.setdefault("autoscaler_scrapes", ScrapeBook())
            async with _decision_lock(memo):
                try:
                    await autoscale_all(memo.ctx, namespace, name, book, session, time.time(), logger)
                except Exception as e:
                    logger.warning("autoscaler: no decision on demand: %s", e)

    @kopf.on.field(*MD, field="spec.autoscaling", id="autoscaler-off", registry=registry)
    def autoscaling_field(
        memo: kopf.Memo, namespace: str, name: str, new: Any, status: Mapping[str, Any], **_: Any
    ) -> None:
        autoscaling_changed(memo.ctx, namespace, name, new, status)

    for role in ROLES:

        @kopf.on.field(
            *MD,
            field=f"spec.disaggregation.{role}.autoscaling",
            id=f"autoscaler-off-{role}",
            registry=registry,
        )
        def role_autoscaling_field(
            memo: kopf.Memo,
            namespace: str,
            name: str,
            new: Any,
            status: Mapping[str, Any],
            role: str = role,
            **_: Any,
        ) -> None:
            autoscaling_changed(memo.ctx, namespace, name, new, status, role)
