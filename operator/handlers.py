"""kopf handlers: a few lines each, all delegating to reconcile.py.

Registered into an explicit registry by `register()` (not at import time) so the resync interval is a
command-line choice and tests can build an operator without global state. Every kind reconciles on
create, update and resume (level-based: after a restart the operator re-derives everything), and on a
timer that corrects drift nobody told us about (a child edited or deleted by hand). A runtime Deployment
event (its status moved, or it was deleted) reconciles its ModelDeployment at once, so readiness shows up
in `kubectl get md` without waiting for the timer.

Three kopf indexes (namespace -> [(name, spec)]) hold what the watch streams last saw of each kind; every
handler passes them to reconcile.py as `Watched`, so finding a policy's users, or a referenced policy's
spec, costs no API call. kopf fills the indexes before it runs the first handler and updates an index
before the handlers of the same event run.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf
from tokenfleet.operator import adapter_report, autoscaler, loading_report
from tokenfleet.operator.api import GROUP, VERSION
from tokenfleet.operator.builders import MANAGED_BY
from tokenfleet.operator.reconcile import (
    OperatorContext,
    Watched,
    policy_refs,
    reconcile_cache_policy,
    reconcile_dependents,
    reconcile_model_deployment,
    reconcile_routers,
    reconcile_routing_policy,
    refresh_cache_policies,
)

MD = (GROUP, VERSION, "modeldeployments")
CP = (GROUP, VERSION, "cachepolicies")
RP = (GROUP, VERSION, "routingpolicies")


def configure(settings: kopf.OperatorSettings) -> None:
    # Progress and the diff base live in annotations under our group: the CRDs' status schemas stay ours
    # (structural schemas would prune kopf's status.kopf anyway).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Only explicit kopf.info/warn calls become Events (phase transitions, invalid specs), never log lines:
    # a resync every minute must not flood `kubectl describe`.
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 8


def _spec_entry(namespace: str, name: str, spec: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    # A deep copy: the index must not share dicts with a body kopf is still working on.
    return {namespace: (name, copy.deepcopy(dict(spec)))}


def watched(kwargs: dict[str, Any]) -> Watched:
    """The indexes kopf passes to every handler, as the view reconcile.py reads."""
    return Watched(
        model_deployments=kwargs["model_deployment_index"],
        cache_policies=kwargs["cache_policy_index"],
        routing_policies=kwargs["routing_policy_index"],
    )


def register(
    registry: kopf.OperatorRegistry,
    resync_seconds: float,
    autoscale_seconds: float = autoscaler.DEFAULT_INTERVAL_SECONDS,
) -> None:
    # ModelDeployments with spec.autoscaling: a decision every autoscale_seconds (autoscaler.py).
    autoscaler.register(registry, autoscale_seconds)
    loading_report.register(registry)
    adapter_report.register(registry)

    @kopf.on.startup(registry=registry)
    def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)

    @kopf.index(*MD, id="model_deployment_index", registry=registry)
    def _md_index(namespace: str, name: str, spec: Any, **_: Any) -> dict:
        return _spec_entry(namespace, name, spec)

    @kopf.index(*CP, id="cache_policy_index", registry=registry)
    def _cp_index(namespace: str, name: str, spec: Any, **_: Any) -> dict:
        return _spec_entry(namespace, name, spec)

    @kopf.index(*RP, id="routing_policy_index", registry=registry)
    def _rp_index(namespace: str, name: str, spec: Any, **_: Any) -> dict:
        return _spec_entry(namespace, name, spec)

    # ---- ModelDeployment
    @kopf.on.resume(*MD, id="model-deployment", registry=registry)
    @kopf.on.create(*MD, id="model-deployment", registry=registry)
    @kopf.on.update(*MD, id="model-deployment", registry=registry)
    def md_changed(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **kw: Any) -> None:
        ctx: OperatorContext = memo.ctx
        view = watched(kw)
        try:
            reconcile_model_deployment(ctx, view, namespace, name, logger)
        finally:
            # It may have joined, left or moved between routers and cache policies: the policies it named
            # before and after are brought up to date (the others' routers do not list it).
            before, after = kw.get("old"), kw.get("body")
            reconcile_routers(ctx, view, namespace, logger, policy_refs("routingPolicyRef", before, after))
            refresh_cache_policies(ctx, view, namespace, logger, policy_refs("cachePolicyRef", before, after))

    @kopf.timer(
        *MD,
        interval=resync_seconds,
        initial_delay=resync_seconds,
        id="model-deployment-resync",
        registry=registry,
    )
    def md_resync(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **kw: Any) -> None:
        try:
            reconcile_model_deployment(memo.ctx, watched(kw), namespace, name, logger)
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            # Already in status and Events; a failing timer must keep ticking so drift is still repaired.
            logger.debug("resync: %s", e)

    @kopf.on.delete(
        *MD, optional=True, id="model-deployment-deleted", registry=registry
    )  # optional: no finalizer, children go by GC
    def md_deleted(memo: kopf.Memo, namespace: str, logger: logging.Logger, **kw: Any) -> None:
        body = kw.get("body")
        reconcile_routers(memo.ctx, watched(kw), namespace, logger, policy_refs("routingPolicyRef", body))
        refresh_cache_policies(memo.ctx, watched(kw), namespace, logger, policy_refs("cachePolicyRef", body))

    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        labels={"app.kubernetes.io/managed-by": MANAGED_BY, f"{GROUP}/model-deployment": kopf.PRESENT},
        id="runtime-deployment",
        registry=registry,
    )
    def runtime_deployment_event(
        memo: kopf.Memo, namespace: str, labels: dict[str, str], logger: logging.Logger, **kw: Any
    ) -> None:
        parent = labels[f"{GROUP}/model-deployment"]
        try:
            reconcile_model_deployment(memo.ctx, watched(kw), namespace, parent, logger)
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            logger.debug("parent not reconciled: %s", e)  # the parent's own handlers report it

    # ---- CachePolicy
    @kopf.on.resume(*CP, id="cache-policy", registry=registry)
    @kopf.on.create(*CP, id="cache-policy", registry=registry)
    @kopf.on.update(*CP, id="cache-policy", registry=registry)
    def cp_changed(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **kw: Any) -> None:
        reconcile_cache_policy(memo.ctx, watched(kw), namespace, name, logger)

    @kopf.on.delete(*CP, optional=True, id="cache-policy-deleted", registry=registry)
    def cp_deleted(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **kw: Any) -> None:
        reconcile_dependents(memo.ctx, watched(kw), namespace, "cachePolicyRef", name, logger)

    # ---- RoutingPolicy
    @kopf.on.resume(*RP, id="routing-policy", registry=registry)
    @kopf.on.create(*RP, id="routing-policy", registry=registry)
    @kopf.on.update(*RP, id="routing-policy", registry=registry)
    def rp_changed(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **kw: Any) -> None:
        ctx: OperatorContext = memo.ctx
        reconcile_routing_policy(ctx, watched(kw), namespace, name, logger)
        # ModelDeployments waiting for this policy (PoliciesResolved=False) can proceed now.
        reconcile_dependents(ctx, watched(kw), namespace, "routingPolicyRef", name, logger)

    @kopf.timer(
        *RP,
        interval=resync_seconds,
        initial_delay=resync_seconds,
        id="routing-policy-resync",
        registry=registry,
    )
    def rp_resync(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **kw: Any) -> None:
        try:
            reconcile_routing_policy(memo.ctx, watched(kw), namespace, name, logger)
        except kopf.PermanentError as e:
            logger.debug("resync: %s", e)

    @kopf.on.delete(*RP, optional=True, id="routing-policy-deleted", registry=registry)
    def rp_deleted(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **kw: Any) -> None:
        reconcile_dependents(memo.ctx, watched(kw), namespace, "routingPolicyRef", name, logger)
