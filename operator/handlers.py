"""kopf handlers: a few lines each, all delegating to reconcile.py.

Registered into an explicit registry by `register()` (not at import time) so the resync interval is a
command-line choice and tests can build an operator without global state. Every kind reconciles on
create, update and resume (level-based: after a restart the operator re-derives everything), and on a
timer that corrects drift nobody told us about (a child edited or deleted by hand). A runtime Deployment
event (its status moved, or it was deleted) reconciles its ModelDeployment at once, so readiness shows up
in `kubectl get md` without waiting for the timer.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from tokenfleet.operator.api import GROUP, VERSION
from tokenfleet.operator.builders import MANAGED_BY
from tokenfleet.operator.reconcile import (
    OperatorContext,
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


def register(registry: kopf.OperatorRegistry, resync_seconds: float) -> None:
    @kopf.on.startup(registry=registry)
    def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)

    # ---- ModelDeployment
    @kopf.on.resume(*MD, id="model-deployment", registry=registry)
    @kopf.on.create(*MD, id="model-deployment", registry=registry)
    @kopf.on.update(*MD, id="model-deployment", registry=registry)
    def md_changed(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
        ctx: OperatorContext = memo.ctx
        try:
            reconcile_model_deployment(ctx, namespace, name, logger)
        finally:
            # It may have joined, left or moved between routers and cache policies.
            reconcile_routers(ctx, namespace, logger)
            refresh_cache_policies(ctx, namespace, logger)

    @kopf.timer(
        *MD,
        interval=resync_seconds,
        initial_delay=resync_seconds,
        id="model-deployment-resync",
        registry=registry,
    )
    def md_resync(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
        try:
            reconcile_model_deployment(memo.ctx, namespace, name, logger)
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            # Already in status and Events; a failing timer must keep ticking so drift is still repaired.
            logger.debug("resync: %s", e)

    @kopf.on.delete(
        *MD, optional=True, id="model-deployment-deleted", registry=registry
    )  # optional: no finalizer, children go by GC
    def md_deleted(memo: kopf.Memo, namespace: str, logger: logging.Logger, **_: Any) -> None:
        reconcile_routers(memo.ctx, namespace, logger)
        refresh_cache_policies(memo.ctx, namespace, logger)

    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        labels={"app.kubernetes.io/managed-by": MANAGED_BY, f"{GROUP}/model-deployment": kopf.PRESENT},
        id="runtime-deployment",
        registry=registry,
    )
    def runtime_deployment_event(
        memo: kopf.Memo, namespace: str, labels: dict[str, str], logger: logging.Logger, **_: Any
    ) -> None:
        try:
            reconcile_model_deployment(memo.ctx, namespace, labels[f"{GROUP}/model-deployment"], logger)
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            logger.debug("parent not reconciled: %s", e)  # the parent's own handlers report it

    # ---- CachePolicy
    @kopf.on.resume(*CP, id="cache-policy", registry=registry)
    @kopf.on.create(*CP, id="cache-policy", registry=registry)
    @kopf.on.update(*CP, id="cache-policy", registry=registry)
    def cp_changed(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
        reconcile_cache_policy(memo.ctx, namespace, name, logger)

    @kopf.on.delete(*CP, optional=True, id="cache-policy-deleted", registry=registry)
    def cp_deleted(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
        reconcile_dependents(memo.ctx, namespace, "cachePolicyRef", name, logger)

    # ---- RoutingPolicy
    @kopf.on.resume(*RP, id="routing-policy", registry=registry)
    @kopf.on.create(*RP, id="routing-policy", registry=registry)
    @kopf.on.update(*RP, id="routing-policy", registry=registry)
    def rp_changed(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
        ctx: OperatorContext = memo.ctx
        reconcile_routing_policy(ctx, namespace, name, logger)
        # ModelDeployments waiting for this policy (PoliciesResolved=False) can proceed now.
        reconcile_dependents(ctx, namespace, "routingPolicyRef", name, logger)

    @kopf.timer(
        *RP,
        interval=resync_seconds,
        initial_delay=resync_seconds,
        id="routing-policy-resync",
        registry=registry,
    )
    def rp_resync(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
        try:
            reconcile_routing_policy(memo.ctx, namespace, name, logger)
        except kopf.PermanentError as e:
            logger.debug("resync: %s", e)

    @kopf.on.delete(*RP, optional=True, id="routing-policy-deleted", registry=registry)
    def rp_deleted(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
        reconcile_dependents(memo.ctx, namespace, "routingPolicyRef", name, logger)
