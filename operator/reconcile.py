"""Level-based reconciliation: read the parent (and what it references), build every child, apply, write
status. Called from the kopf handlers of all three kinds, from timers, and when a child goes away; running
it twice, or after a restart, converges to the same objects (server-side apply writes nothing when nothing
changed, and status is written only when it changed).

Cross-resource questions (which ModelDeployments use this policy? does that policy exist, and what does it
say?) are answered from `Watched`: in the operator, kopf indexes filled from the watch streams kopf runs
anyway, so a handler never lists a kind from the API server. Only the object being reconciled is read
fresh (`Kube.get`), so its status is computed from what is stored now.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from tokenfleet.operator.api import (
    DEFAULT_IMAGE,
    GROUP,
    NODE_CACHE_DIR,
    ModelDeploymentSpec,
    check_name,
    parse_cache_policy,
    parse_model_deployment,
    parse_routing_policy,
    source_kind,
)
from tokenfleet.operator.builders import (
    build_config_map,
    build_deployment,
    build_pod_disruption_budget,
    build_runtime_config,
    build_service,
    common_labels,
    config_hash,
    selector_string,
    service_url,
)
from tokenfleet.operator.disaggregation import build_disaggregated_children, role_name, router_backends
from tokenfleet.operator.inference_pool import PoolSupport, build_inference_pool
from tokenfleet.operator.internal_key import build_internal_key_secret, new_internal_key
from tokenfleet.operator.kube import Kube, NamespaceTerminating, NotServed
from tokenfleet.operator.network_policy import build_network_policy
from tokenfleet.operator.router_builders import (
    ROUTER_PORT,
    build_backend,
    build_router_config,
    build_router_config_map,
    build_router_deployment,
    build_router_role_binding,
    build_router_service,
    build_router_service_account,
    router_names,
    router_selector,
)
from tokenfleet.operator.router_status import fetch_metrics, routers_status
from tokenfleet.operator.status import (
    COLD_START_COVERED,
    ReconcileOutcome,
    cold_start_coverage,
    model_deployment_status,
    policy_status,
    status_changed,
)
from tokenfleet.runtime.errors import ConfigError

# {namespace: [(name, spec), ...]}: the shape of a kopf index keyed by namespace, and of a plain dict.
NamespaceIndex = Mapping[str, Collection[tuple[str, dict[str, Any]]]]


@dataclass(frozen=True, slots=True)
class Watched:
    """The three kinds as the operator's watches last saw them (spec only), per namespace."""

    model_deployments: NamespaceIndex
    cache_policies: NamespaceIndex
    routing_policies: NamespaceIndex

    @staticmethod
    def _specs(index: NamespaceIndex, namespace: str) -> dict[str, dict[str, Any]]:
        return dict(index.get(namespace, ()))

    def model_deployment_specs(self, namespace: str) -> dict[str, dict[str, Any]]:
        return self._specs(self.model_deployments, namespace)

    def cache_policy_spec(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._specs(self.cache_policies, namespace).get(name)

    def cache_policy_names(self, namespace: str) -> list[str]:
        return sorted(self._specs(self.cache_policies, namespace))

    def routing_policy_names(self, namespace: str) -> list[str]:
        return sorted(self._specs(self.routing_policies, namespace))

    def users_of(self, namespace: str, field: str, policy: str) -> list[str]:
        """Names of the ModelDeployments whose spec.<field> is `policy`."""
        specs = self.model_deployment_specs(namespace)
        return sorted(name for name, spec in specs.items() if (spec or {}).get(field) == policy)


def _existing(present: list[str], names: Collection[str] | None) -> list[str]:
    """`present`, narrowed to `names` when given (a reference to a policy that does not exist is skipped)."""
    return present if names is None else [n for n in present if n in names]


def policy_refs(field: str, *bodies: Mapping[str, Any] | None) -> set[str]:
    """The policies that ModelDeployment `bodies` (e.g. before and after a change) name in spec.<field>."""
    refs = (((b or {}).get("spec") or {}).get(field) for b in bodies)
    return {r for r in refs if isinstance(r, str) and r}


def post_event(owner: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event on `owner`, through kopf's event poster (type_: "Normal" or "Warning")."""
    kopf.event(owner, type=type_, reason=reason, message=message)


@dataclass(frozen=True, slots=True)
class OperatorContext:
    """Everything a handler needs besides the event; lives in kopf's memo (no module-level state)."""

    kube: Kube
    image: str = DEFAULT_IMAGE
    resync_seconds: float = 60.0
    now: Callable[[], str] = lambda: dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    event: Callable[[dict[str, Any], str, str, str], None] = post_event
    # Whether InferencePools can be written here; built from resync_seconds unless given.
    pools: PoolSupport | None = None
    # Where the operator's own pods run: the runtime pods' NetworkPolicy admits them (metrics scrapes).
    operator_namespace: str = "tokenfleet-system"
    # The node directory behind `model.nodeCache` (an administrator's choice: pods mount it from the host).
    node_cache_dir: str = NODE_CACHE_DIR

    def __post_init__(self) -> None:
        if self.pools is None:
            object.__setattr__(self, "pools", PoolSupport(recheck_seconds=self.resync_seconds))


def _adopt_and_apply(
    ctx: OperatorContext, owner: dict[str, Any], children: list[dict[str, Any]]
) -> list[dict]:
    kopf.adopt(children, owner=owner)
    return [ctx.kube.apply(child) for child in children]


def _announce(
    ctx: OperatorContext, owner: dict[str, Any], before: dict[str, Any] | None, after: dict[str, Any]
) -> None:
    """Events on notable transitions only (phase changes), never on every resync."""
    old_phase = (before or {}).get("phase")
    new_phase = after.get("phase")
    if old_phase == new_phase:
        return
    ready = next((c for c in after.get("conditions", []) if c["type"] == "Ready"), None)
    message = f"{old_phase or 'New'} -> {new_phase}: {ready['message'] if ready else ''}".strip()
    if new_phase in ("Failed", "Degraded", "Pending"):
        ctx.event(owner, "Warning", ready["reason"] if ready else new_phase, message)
    else:
        ctx.event(owner, "Normal", new_phase or "Unknown", message)


# --------------------------------------------------------------------------------------------- ModelDeployment
@contextlib.contextmanager
def _unless_namespace_goes(namespace: str, logger: logging.Logger) -> Iterator[None]:
    """A namespace being deleted refuses new children: stop quietly, its objects are going away anyway."""
    try:
        yield
    except NamespaceTerminating:
        logger.debug("namespace %s is being deleted: nothing more to create there", namespace)


def reconcile_model_deployment(
    ctx: OperatorContext, watched: Watched, namespace: str, name: str, logger: logging.Logger
) -> None:
    with _unless_namespace_goes(namespace, logger):
        _reconcile_model_deployment(ctx, watched, namespace, name, logger)


def _reconcile_model_deployment(
    ctx: OperatorContext, watched: Watched, namespace: str, name: str, logger: logging.Logger
) -> None:
    body = ctx.kube.get("ModelDeployment", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    generation = int(body["metadata"].get("generation") or 0)
    outcome, spec, cache = _resolve(watched, namespace, name, body)
    # Once children are applied: the new mode's Deployments that removing the old mode's children waits for.
    switching: list[str] | None = None
    if spec is not None and not outcome.missing_policies and outcome.config_error is None:
        try:
            config = build_runtime_config(spec, cache)
        except ValueError as e:  # pydantic: a combination RuntimeConfig rejects
            outcome = ReconcileOutcome(config_error=f"runtime config: {e}")
        else:
            children = [
                build_config_map(name, config),
                build_deployment(name, spec, config, node_cache_dir=ctx.node_cache_dir),
                build_service(name),
                build_pod_disruption_budget(name),
            ]
            served = name  # the Deployment the status reports on
            if spec.disaggregation is not None:  # two Deployments; the decode role answers the clients
                children = build_disaggregated_children(name, spec, cache, ctx.node_cache_dir)
                served = role_name(name, "decode")
            # Before the Deployments: their pods mount it.
            ensure_internal_key(ctx, body, logger)
            applied = _adopt_and_apply(ctx, body, children)
            switching = finish_mode_switch(ctx, body, spec, children, applied, logger)
            sync_network_policy(ctx, body, spec)
            sync_inference_pool(ctx, body, spec, logger)
            outcome = ReconcileOutcome(
                desired_replicas=spec.replicas if served == name else spec.disaggregation.decode.replicas,
                selector=selector_string(served),
                endpoint=service_url(served, namespace),
                config_hash=config_hash(config),
            )
    served = name if spec is None or spec.disaggregation is None else role_name(name, "decode")
    # Read the Deployment right before writing status so a concurrent reconcile cannot leave a staler view.
    deployment = ctx.kube.get("Deployment", namespace, served) if outcome.config_error is None else None
    # The pods say why a rollout does not progress (a crash loop, an unschedulable pod).
    pods = ctx.kube.list("Pod", namespace, selector_string(served)) if deployment is not None else []
    previous = body.get("status") or {}
    status = model_deployment_status(outcome, deployment, generation, previous, ctx.now(), pods)
    if status_changed(previous, status):
        ctx.kube.patch_status("ModelDeployment", namespace, name, status)
        _announce(ctx, body, previous, status)
        logger.info("status: %s (%s ready)", status["phase"], status.get("readyReplicas"))
    if spec is not None and spec.disaggregation is not None and deployment is not None:
        counts = {
            "decode": deployment,
            "prefill": ctx.kube.get("Deployment", namespace, role_name(name, "prefill")),
        }
        patch = role_counts_patch(previous.get("roles"), counts)
        if patch:
            ctx.kube.patch_status("ModelDeployment", namespace, name, {"roles": patch})
    elif spec is not None and spec.disaggregation is None and switching == [] and previous.get("roles"):
        # Aggregated again and the roles' children are gone: their counts (and any late autoscaler
        # decision for a role) describe nothing any more.
        ctx.kube.patch_status("ModelDeployment", namespace, name, {"roles": None})
    if outcome.config_error is not None:
        # No retry: only a spec change can fix it (and that triggers a reconcile).
        raise kopf.PermanentError(outcome.config_error)
    if outcome.missing_policies:
        # Creating the policy triggers a reconcile too; the retry covers a missed event.
        raise kopf.TemporaryError(
            f"waiting for {', '.join(outcome.missing_policies)}", delay=ctx.resync_seconds
        )
    if switching:
        # The other mode's pods keep serving until these can; their Deployments' status events (and the
        # resync) reconcile again, and the retry covers a missed one.
        raise kopf.TemporaryError(
            f"waiting for Deployment {', '.join(switching)} to have an available replica before removing "
            "the children of the previous serving mode",
            delay=ctx.resync_seconds,
        )


def ensure_internal_key(ctx: OperatorContext, owner: dict[str, Any], logger: logging.Logger) -> bool:
    """Create the ModelDeployment's internal-key Secret if there is none; True when it was created.

    Create-only (a POST that a stored Secret refuses): never regenerated or rewritten, so neither a
    restart, a resync nor a spec change rotates the key; what an admin stored there stays. The operator
    never reads it back.
    """
    name = owner["metadata"]["name"]
    secret = build_internal_key_secret(name, common_labels(name), new_internal_key())
    kopf.adopt(secret, owner=owner)
    created = ctx.kube.create_if_absent(secret)
    if created:
        logger.info("created the internal key Secret %s", secret["metadata"]["name"])
    return created


def role_counts_patch(
    previous: Mapping[str, Any] | None, deployments: Mapping[str, Mapping[str, Any] | None]
) -> dict[str, Any]:
    """`status.roles.<role>.{replicas, readyReplicas}` from each role's Deployment, as a merge patch (empty:
    nothing changed). Every role's counts go together, so the roles always describe one moment; their
    `autoscaling` is the autoscaler's and a merge patch leaves it alone."""
    patch: dict[str, Any] = {}
    for role, deployment in deployments.items():
        st = (deployment or {}).get("status") or {}
        patch[role] = {
            "replicas": int(st.get("replicas") or 0),
            "readyReplicas": int(st.get("readyReplicas") or 0),
        }
    stored = previous or {}
    changed = any(
        ((stored.get(role) or {}).get(k) != v) for role, counts in patch.items() for k, v in counts.items()
    )
    return patch if changed else {}


# The kinds of a ModelDeployment's runtime children: those of its other serving mode (aggregated, or a
# disaggregated role) go after the spec switches between them, once the new mode's pods serve.
PRUNED_KINDS = ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget")


def stale_children(
    owner: Mapping[str, Any], wanted: Collection[dict[str, Any]], existing: Collection[dict[str, Any]]
) -> list[tuple[str, str]]:
    """(kind, name) of the objects in `existing` that `owner` controls but the current spec no longer builds.

    Pure. Only what the owner controls goes (its uid in a controller ownerReference), never an object of the
    same name and labels made by someone else.
    """
    keep = {(c["kind"], c["metadata"]["name"]) for c in wanted}
    out = []
    for obj in existing:
        key = (obj.get("kind"), obj["metadata"]["name"])
        if _controlled_by(owner, obj) and key not in keep:
            out.append(key)
    return sorted(out)


def _controlled_by(owner: Mapping[str, Any], obj: Mapping[str, Any]) -> bool:
    uid = owner["metadata"].get("uid")
    refs = obj["metadata"].get("ownerReferences") or []
    return bool(uid) and any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


def other_mode_may_remain(ctx: OperatorContext, owner: Mapping[str, Any], spec: ModelDeploymentSpec) -> bool:
    """Whether children of the serving mode the spec no longer runs may still exist, known without listing
    (a reconcile runs on every resync and every Deployment event). Aggregated: `status.roles` is written
    only while disaggregated and removed once the roles' children are gone. Disaggregated: the aggregated
    Deployment, named after the ModelDeployment, still exists under its control (one GET; the prune
    deletes Deployments last, so any aggregated child left means that one is too)."""
    meta = owner["metadata"]
    if spec.disaggregation is None:
        return bool((owner.get("status") or {}).get("roles"))
    deployment = ctx.kube.get("Deployment", meta["namespace"], meta["name"])
    return deployment is not None and _controlled_by(owner, deployment)


def serving(deployment: Mapping[str, Any]) -> bool:
    """Whether a Deployment as stored can take traffic: an available replica, or none wanted (pure)."""
    wanted = (deployment.get("spec") or {}).get("replicas")
    available = int((deployment.get("status") or {}).get("availableReplicas") or 0)
    return available >= min(1, 1 if wanted is None else int(wanted))


def finish_mode_switch(
    ctx: OperatorContext,
    owner: dict[str, Any],
    spec: ModelDeploymentSpec,
    wanted: list[dict[str, Any]],
    applied: list[dict[str, Any]],
    logger: logging.Logger,
) -> list[str]:
    """After a switch between aggregated and disaggregated serving, remove the old mode's children once
    the new mode's Deployments (`applied`, as stored) serve; before that the old pods are the only ones
    that can answer. Returns the names of the new Deployments still awaited (empty: nothing left to do)."""
    if not other_mode_may_remain(ctx, owner, spec):
        return []
    waiting = [d["metadata"]["name"] for d in applied if d["kind"] == "Deployment" and not serving(d)]
    if not waiting:
        prune_children(ctx, owner, wanted, logger)
    return sorted(waiting)


def prune_children(
    ctx: OperatorContext, owner: dict[str, Any], wanted: list[dict[str, Any]], logger: logging.Logger
) -> list[tuple[str, str]]:
    """Delete the runtime children of the mode the ModelDeployment no longer runs (a switch between
    aggregated and disaggregated serving). Level-based: it compares what exists now with what the spec
    builds, so a switch made while the operator was down is cleaned up at its next reconcile."""
    meta = owner["metadata"]
    selector = f"{GROUP}/model-deployment={meta['name']}"
    existing = []
    for kind in PRUNED_KINDS:
        existing += [{**o, "kind": kind} for o in ctx.kube.list(kind, meta["namespace"], selector)]
    removed = stale_children(owner, wanted, existing)
    # Deployments last: a Deployment left over is what says the prune is unfinished (other_mode_may_remain).
    for kind, name in sorted(removed, key=lambda key: key[0] == "Deployment"):
        ctx.kube.delete(kind, meta["namespace"], name)
        logger.info("removed %s %s (no longer part of the spec)", kind, name)
    return removed


def sync_network_policy(ctx: OperatorContext, body: dict[str, Any], spec: ModelDeploymentSpec) -> None:
    """Write the runtime pods' NetworkPolicy, or remove it when `spec.networkPolicy.enabled` is false."""
    meta = body["metadata"]
    if spec.network_policy.enabled:
        _adopt_and_apply(ctx, body, [build_network_policy(meta["name"], spec, ctx.operator_namespace)])
    else:
        ctx.kube.delete("NetworkPolicy", meta["namespace"], meta["name"])


def sync_inference_pool(
    ctx: OperatorContext, body: dict[str, Any], spec: ModelDeploymentSpec, logger: logging.Logger
) -> None:
    """Write the ModelDeployment's InferencePool, or remove it when the spec turned it off; a cluster
    without the InferencePool CRD is noted once and otherwise ignored (everything else still reconciles)."""
    assert ctx.pools is not None
    meta = body["metadata"]
    if not spec.inference_pool.enabled:
        if ctx.pools.served is not False:
            ctx.kube.delete("InferencePool", meta["namespace"], meta["name"])
        return
    if not ctx.pools.worth_trying():
        return
    try:
        _adopt_and_apply(ctx, body, [build_inference_pool(meta["name"], spec)])
    except NotServed:
        ctx.pools.found(False, logger)
    except ApiException as e:
        if e.status != 422:
            raise
        # Refused by the pool's own schema (an installed CRD newer or older than ours): the pool is an
        # add-on, so the ModelDeployment's children and status still go on; the reason is in the log.
        ctx.pools.found(True, logger)
        logger.warning("InferencePool %s refused by the API server: %s", meta["name"], e.body or e.reason)
    else:
        ctx.pools.found(True, logger)


def _resolve(
    watched: Watched, namespace: str, name: str, body: dict[str, Any]
) -> tuple[ReconcileOutcome, ModelDeploymentSpec | None, Any]:
    """Parse the spec and fetch the referenced policies; a problem becomes part of the outcome."""
    try:
        check_name("ModelDeployment", name)
        spec = parse_model_deployment(body.get("spec"))
        source_kind(spec.model.source)
    except ConfigError as e:
        return ReconcileOutcome(config_error=str(e)), None, None
    missing: list[str] = []
    cache = None
    if spec.cache_policy_ref:
        cp_spec = watched.cache_policy_spec(namespace, spec.cache_policy_ref)
        if cp_spec is None:
            missing.append(f"CachePolicy/{spec.cache_policy_ref}")
        else:
            try:
                cache = parse_cache_policy(cp_spec)
            except ConfigError as e:
                return ReconcileOutcome(config_error=f"CachePolicy/{spec.cache_policy_ref}: {e}"), None, None
    if spec.routing_policy_ref and spec.routing_policy_ref not in watched.routing_policy_names(namespace):
        missing.append(f"RoutingPolicy/{spec.routing_policy_ref}")
    pending = ReconcileOutcome(missing_policies=tuple(missing), selector=selector_string(name))
    return (pending if missing else ReconcileOutcome()), spec, cache


def reconcile_dependents(
    ctx: OperatorContext, watched: Watched, namespace: str, field: str, policy: str, logger: logging.Logger
) -> list[str]:
    """Reconcile every ModelDeployment using a policy that changed; one bad dependent does not stop the rest."""
    names = watched.users_of(namespace, field, policy)
    for md_name in names:
        try:
            reconcile_model_deployment(ctx, watched, namespace, md_name, logger)
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            logger.warning("ModelDeployment %s/%s: %s", namespace, md_name, e)
    return names


def reconcile_cache_policy(
    ctx: OperatorContext,
    watched: Watched,
    namespace: str,
    name: str,
    logger: logging.Logger,
    dependents: bool = True,
) -> None:
    """Validate, re-render every dependent (unless `dependents` is False: a status refresh), write status."""
    body = ctx.kube.get("CachePolicy", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    error = None
    try:
        parse_cache_policy(body.get("spec"))
    except ConfigError as e:
        error = str(e)
    if dependents:
        used_by = reconcile_dependents(ctx, watched, namespace, "cachePolicyRef", name, logger)
    else:
        used_by = watched.users_of(namespace, "cachePolicyRef", name)
    _write_policy_status(ctx, "CachePolicy", body, used_by, None, error)


def refresh_cache_policies(
    ctx: OperatorContext,
    watched: Watched,
    namespace: str,
    logger: logging.Logger,
    names: Collection[str] | None = None,
) -> None:
    """Keep the CachePolicies' `usedBy` true when ModelDeployments come, go or switch policies: those in
    `names` (the ones a changed ModelDeployment named before and after), or every one."""
    for cp_name in _existing(watched.cache_policy_names(namespace), names):
        try:
            reconcile_cache_policy(ctx, watched, namespace, cp_name, logger, dependents=False)
        except kopf.PermanentError as e:
            logger.debug("CachePolicy %s/%s: %s", namespace, cp_name, e)


def _write_policy_status(
    ctx: OperatorContext,
    kind: str,
    body: dict[str, Any],
    used_by: list[str],
    endpoint: str | None,
    error: str | None,
    routers: list[dict[str, Any]] | None = None,
    covered: dict[str, str] | None = None,
) -> None:
    meta = body["metadata"]
    status = policy_status(int(meta.get("generation") or 0), used_by, endpoint, error, routers, covered)
    if status_changed(body.get("status"), status):
        ctx.kube.patch_status(kind, meta["namespace"], meta["name"], status)
        if error:
            ctx.event(body, "Warning", "InvalidSpec", error)
        before = {c.get("type"): c for c in (body.get("status") or {}).get("conditions") or []}
        was = before.get(COLD_START_COVERED, {})
        if covered is not None and covered["status"] == "False" and was.get("message") != covered["message"]:
            ctx.event(body, "Warning", covered["reason"], covered["message"])
    if error:
        raise kopf.PermanentError(error)


# ----------------------------------------------------------------------------------------------- RoutingPolicy
def reconcile_routing_policy(
    ctx: OperatorContext, watched: Watched, namespace: str, name: str, logger: logging.Logger
) -> None:
    with _unless_namespace_goes(namespace, logger):
        _reconcile_routing_policy(ctx, watched, namespace, name, logger)


def _reconcile_routing_policy(
    ctx: OperatorContext, watched: Watched, namespace: str, name: str, logger: logging.Logger
) -> None:
    body = ctx.kube.get("RoutingPolicy", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    try:
        check_name("RoutingPolicy", name)
        spec = parse_routing_policy(body.get("spec"))
    except ConfigError as e:
        _write_policy_status(ctx, "RoutingPolicy", body, [], None, str(e))
        return
    backends = []
    used_by = []
    key_owners = []  # the ModelDeployments whose internal keys the routers mount
    at_zero = []  # those that may scale to zero: the routers hold their requests through a cold start
    md_specs = watched.model_deployment_specs(namespace)
    for md_name in watched.users_of(namespace, "routingPolicyRef", name):
        used_by.append(md_name)
        try:
            check_name("ModelDeployment", md_name)
            md_spec = parse_model_deployment(md_specs[md_name])
            cache_name = md_spec.cache_policy_ref
            cp_spec = watched.cache_policy_spec(namespace, cache_name) if cache_name else None
            cache = parse_cache_policy(cp_spec) if cp_spec is not None else None
            config = build_runtime_config(md_spec, cache)
        except (ConfigError, ValueError) as e:
            # An invalid ModelDeployment reports itself; the router just leaves it out.
            logger.info("router %s skips ModelDeployment %s: %s", name, md_name, e)
            continue
        builtin = source_kind(md_spec.model.source) == "builtin"
        key_owners.append(md_name)
        if md_spec.autoscaling is not None and md_spec.autoscaling.min_replicas == 0:
            at_zero.append(md_name)
        if md_spec.disaggregation is not None:  # one backend per role's Service
            backends += router_backends(md_name, namespace, md_spec, cache, builtin)
        else:
            backends.append(build_backend(md_name, namespace, config, builtin, adapters=md_spec.adapters))
    try:
        router_config = build_router_config(
            namespace, spec, backends, body["metadata"].get("generation"), rp_name=name
        )
    except ValueError as e:  # e.g. a modelRoute naming a backend that does not exist (yet)
        _write_policy_status(ctx, "RoutingPolicy", body, used_by, None, f"router config: {e}")
        return
    children = [
        build_router_config_map(name, router_config),
        build_router_service_account(name),
        build_router_role_binding(name),
        build_router_deployment(name, router_config, ctx.image, key_owners),
        build_router_service(name),
    ]
    _adopt_and_apply(ctx, body, children)
    endpoint = service_url(router_names(name).service, namespace, ROUTER_PORT)
    # Routers apply policy edits live: report which generation each router pod runs.
    selector = ",".join(f"{k}={v}" for k, v in router_selector(name).items())
    routers = routers_status(ctx.kube.list("Pod", namespace, selector), fetch_metrics)
    cold_starts = {md: _cold_start(ctx, namespace, md) for md in at_zero}
    covered = cold_start_coverage(spec.queue_timeout_seconds, cold_starts)
    _write_policy_status(ctx, "RoutingPolicy", body, used_by, endpoint, None, routers, covered)


def _cold_start(ctx: OperatorContext, namespace: str, md_name: str) -> float | None:
    body = ctx.kube.get("ModelDeployment", namespace, md_name) or {}
    value = ((body.get("status") or {}).get("autoscaling") or {}).get("coldStartSeconds")
    return float(value) if isinstance(value, int | float) else None


def reconcile_routers(
    ctx: OperatorContext,
    watched: Watched,
    namespace: str,
    logger: logging.Logger,
    names: Collection[str] | None = None,
) -> None:
    """The routers of the RoutingPolicies in `names` (those a ModelDeployment that came, went, changed or
    moved named before and after), or every one in the namespace."""
    for rp_name in _existing(watched.routing_policy_names(namespace), names):
        try:
            reconcile_routing_policy(ctx, watched, namespace, rp_name, logger)
        except kopf.PermanentError as e:
            logger.warning("RoutingPolicy %s/%s: %s", namespace, rp_name, e)
