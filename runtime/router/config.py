"""RouterConfig: what `tokenfleet route --config PATH` reads.

The operator writes this file into the router's ConfigMap: a `routing:` dict that is the RoutingPolicy spec
(camelCase, as in the CRD) plus `backends: [{name, model, url}]`, one per ModelDeployment the policy routes.
Both spellings (camelCase and snake_case) are accepted so hand-written files for local use stay readable.
Unknown keys are rejected: a typo in a routing policy must fail loudly, not route silently by defaults.

Priority has one meaning everywhere — RoutingPolicy classes, the request body's `priority`, the
`x-tokenfleet-priority` header and the engine: a LOWER number is served sooner and preempted later (vLLM's
convention; 0 is the default, negative numbers go ahead of it). The router translates in one place only,
a class name (or an API key's tier) -> that number (`RouterApp.priority`), and forwards it unchanged.

The router re-reads this file when it changes (a ConfigMap update): `LIVE_FIELDS` apply at once, without
a restart, keeping the prefix index and in-flight streams; the rest (`RESTART_FIELDS`) needs a new router
process and is reported as pending at `/v1/config`. The operator hashes only the restart-only part into the
router pods' template, so editing a RoutingPolicy no longer rolls its routers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from tokenfleet.runtime.config_file import load_config
from tokenfleet.runtime.errors import ConfigError

Strategy = Literal["round-robin", "least-load", "prefix-affinity", "session-affinity"]
Role = Literal["both", "prefill", "decode"]
# The pod (and Service) label naming a disaggregated pod's role; the operator sets it on both. A backend of
# role `both` learns each endpoint's role from it (the pod's label, else its EndpointSlice's).
ROLE_LABEL = "serving.tokenfleet.dev/role"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class Weights(_Spec):
    """Weights of the combined score; each scorer returns a value in [0, 1] (higher = better)."""

    prefix: float = Field(3.0, ge=0, description="Fraction of the prompt's blocks already cached on the pod.")
    queue: float = Field(2.0, ge=0, description="Min-max normalised queue length (waiting + running).")
    kv_usage: float = Field(1.0, ge=0, description="1 - the pod's KV cache usage.")


class Balance(_Spec):
    """Hot-spot guards, both on: a bound on the work each endpoint is sent, and SGLang's queue rule.

    Work bound: among the last `window` routing decisions, an endpoint that was sent more than
    `max_ratio` x (the least-served candidate's count + 1) is not eligible. It acts on every request, also
    while queues are short, so affinity cannot skew the work pods get by more than about that ratio.
    Queue rule: when max load - min load > `absolute` AND max load > `relative` * min load, load alone
    decides (it needs queues to build up before it acts).
    """

    absolute: int = Field(8, ge=0, description="max load - min load above this ...")
    relative: float = Field(1.5, ge=1.0, description="... and max load above relative * min load.")
    max_ratio: float | None = Field(
        1.4,
        ge=1.0,
        description="Most recent requests an endpoint may be sent, relative to the least-served candidate "
        "(+1); null = affinity unbounded.",
    )
    window: int = Field(256, ge=8, description="Recent routing decisions the work bound counts.")


class WeightedBackend(_Spec):
    backend: str = Field(min_length=1, description="A backend (ModelDeployment) name.")
    weight: float = Field(ge=0, description="Its share of the route's requests (relative to the others).")


# How many fallback hops a request may take from the model it named: a chain an operator can still read.
MAX_FALLBACK_DEPTH = 3


class ModelRoute(_Spec):
    model: str = Field(min_length=1, description="The model name clients send (a served name or an alias).")
    backends: tuple[str, ...] = Field(
        (), description="Backend names serving it; empty (and no `split`) = every backend of `model`."
    )
    split: tuple[WeightedBackend, ...] = Field(
        (),
        max_length=64,
        description="Weighted backends instead of `backends` (a canary: 95/5). Each request goes to one, "
        "chosen by its session key (the same session stays on the same backend) or at random without one.",
    )
    fallback: tuple[str, ...] = Field(
        (),
        description="Models tried in order when the chosen backend has no ready endpoint, fails before the "
        "first byte, or has `maxQueued` requests waiting; a fallback's own route (its split and fallbacks) "
        f"applies, at most {MAX_FALLBACK_DEPTH} hops from the model the client named.",
    )
    max_queued: int | None = Field(
        None,
        ge=0,
        description="Requests that may wait in the router for this route's backend before new ones go to "
        "a fallback that can take them now; null = they wait (up to the queue's bounds) for the primary.",
    )

    @model_validator(mode="after")
    def _check_split(self) -> ModelRoute:
        if self.split and self.backends:
            raise ValueError(f"modelRoutes[{self.model}]: give `backends` or `split`, not both")
        names = [w.backend for w in self.split]
        if len(names) != len(set(names)):
            raise ValueError(f"modelRoutes[{self.model}].split: a backend appears twice")
        if self.split and not sum(w.weight for w in self.split) > 0:
            raise ValueError(f"modelRoutes[{self.model}].split: the weights must sum to a positive number")
        return self


class PriorityClass(_Spec):
    name: str
    priority: int = Field(
        0,
        description="Lower is served sooner and preempted later, in the router's queue and on the pod "
        "(the request body's `priority` has the same meaning); 0 is the default.",
    )
    tiers: tuple[str, ...] = Field((), description="API key tiers that get this class by default.")
    min_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="The least fraction of the requests the router sends that go to this class while it has "
        "requests waiting, however much more urgent work waits (so a lower class never starves).",
    )


class SecretKeyRef(_Spec):
    """A key of a Secret in the resource's namespace, mounted as a file (updates reach it live)."""

    name: str = Field(min_length=1, description="The Secret's name.")
    key: str = Field("keys", min_length=1, description="Its entry holding the API keys, one per line.")


class Limit(_Spec):
    requests_per_minute: float | None = Field(None, gt=0)
    tokens_per_minute: float | None = Field(None, gt=0, description="Prompt + completion tokens.")


class RateLimits(Limit):
    """Per-key limits (a key is the API key, or the client address when keys are off); tiers override."""

    tiers: dict[str, Limit] = Field(default_factory=dict)


class FairShareSpec(_Spec):
    """Fair share between tenants in the router's queue (virtual token counters, fair_share.py)."""

    enabled: bool = Field(
        False, description="Within a priority, the tenant that has received the least service goes first."
    )
    tenant_header: str | None = Field(
        None,
        description="A header naming the tenant (set by a trusted gateway in front); default: the API key "
        "(the client address when keys are off).",
    )
    input_token_weight: float = Field(1.0, ge=0, description="Service counted per prompt token.")
    output_token_weight: float = Field(2.0, ge=0, description="Service counted per generated token.")
    tier_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Share per API key tier (default 1): a tenant of weight 2 gets twice the service of one "
        "of weight 1 when both wait.",
    )

    @model_validator(mode="after")
    def _check_weights(self) -> FairShareSpec:
        bad = sorted(t for t, w in self.tier_weights.items() if not w > 0)
        if bad:
            raise ValueError(f"fairShare.tierWeights: weights must be positive ({', '.join(bad)})")
        return self


class Retries(_Spec):
    max_attempts: int = Field(3, ge=1, le=10, description="Attempts per request, the first included.")
    connect_timeout_seconds: float = Field(5.0, gt=0)
    first_byte_timeout_seconds: float = Field(120.0, gt=0, description="Until response headers (prefill).")
    idle_timeout_seconds: float = Field(60.0, gt=0, description="Longest silence inside a stream.")
    max_resumes: int = Field(
        2,
        ge=0,
        le=10,
        description="Continuations of one request on other endpoints when its stream breaks after the first "
        "byte (a pod dying or draining); 0 turns resuming off.",
    )


class RouterReplicas(_Spec):
    replicas: int = Field(1, ge=0)


class RoutingSpec(_Spec):
    """The RoutingPolicy spec as the operator writes it."""

    strategy: Strategy = "prefix-affinity"
    weights: Weights = Weights()
    balance: Balance = Balance()
    model_routes: tuple[ModelRoute, ...] = ()
    priority_classes: tuple[PriorityClass, ...] = ()
    rate_limits: RateLimits = RateLimits()
    fair_share: FairShareSpec = FairShareSpec()
    retries: Retries = Retries()
    router: RouterReplicas = RouterReplicas()
    session_header: str = Field("x-session-id", description="session-affinity key; else the body's `user`.")
    priority_header: str = Field("x-priority-class", description="Names a priority class.")
    max_in_flight_per_endpoint: int = Field(
        32, ge=1, description="Beyond this on every candidate, requests queue in the router by priority."
    )
    queue_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="Longest wait in the router's queue: 429 when endpoints are at their limits, 503 with "
        "Retry-After when none is ready (all loading or ejected).",
    )
    max_queued: int = Field(1024, ge=0, description="Requests the router holds at once; beyond it, 429.")
    api_key_secret: SecretKeyRef | None = Field(
        None,
        description="API keys (`KEY` or `KEY:TIER` per line) the routers require; rotation applies live.",
    )

    @model_validator(mode="after")
    def _check_names(self) -> RoutingSpec:
        names = [c.name for c in self.priority_classes]
        if len(names) != len(set(names)):
            raise ValueError("priorityClasses names must be unique")
        if sum(c.min_share for c in self.priority_classes) > 1:
            raise ValueError("priorityClasses: the minShare values must not add up to more than 1")
        routes = [r.model for r in self.model_routes]
        if len(routes) != len(set(routes)):
            raise ValueError("modelRoutes: a model appears twice")
        _check_fallback_chains(self.model_routes)
        return self


def _check_fallback_chains(routes: tuple[ModelRoute, ...]) -> None:
    """No cycle and no chain longer than MAX_FALLBACK_DEPTH hops; the error names the field that closes it."""
    by_model = {r.model: r for r in routes}

    def walk(model: str, path: tuple[str, ...]) -> None:
        route = by_model.get(model)
        for i, fb in enumerate(route.fallback if route is not None else ()):
            field = f"modelRoutes[{model}].fallback[{i}]"
            if fb in path:
                raise ValueError(f"{field}: {fb!r} closes a cycle ({' -> '.join((*path, fb))})")
            if len(path) >= MAX_FALLBACK_DEPTH + 1:
                raise ValueError(
                    f"{field}: the chain {' -> '.join((*path, fb))} is longer than {MAX_FALLBACK_DEPTH} hops"
                )
            walk(fb, (*path, fb))

    for route in routes:
        walk(route.model, (route.model,))


class AdapterCopies(_Spec):
    """How many pods must and may hold one LoRA adapter (a ModelDeployment's `adapters[]` minCopies and
    maxCopies)."""

    min_copies: int = Field(
        0,
        ge=0,
        description="Pods the operator keeps it pinned on; a place is never made by draining below it.",
    )
    max_copies: int | None = Field(
        None,
        ge=1,
        description="The most pods holding it at once: while that many do, its requests go only to them "
        "(never a spill that loads another copy).",
    )


class Backend(_Spec):
    name: str = Field(description="The ModelDeployment (its Service) name.")
    model: str = Field(description="The served model name.")
    url: str = Field(description="Base URL, e.g. http://name.namespace.svc:8000 (static: the pod itself).")
    tokenizer: str | None = Field(
        None,
        description="Model source to load the tokenizer from (built-in name, .gguf, HF dir); default `model`.",
    )
    block_size: int = Field(16, description="Used until the pods report theirs on the KV-event stream.")
    adapters: tuple[str, ...] = Field(
        (),
        description="LoRA adapters its pods serve beside `model`: a request naming one goes to this backend "
        "(the pods' own list, on /load, makes its prefix matches exact).",
    )
    adapter_copies: dict[str, AdapterCopies] = Field(
        default_factory=dict, description="Per adapter of `adapters`: its minimum and maximum copies, if set."
    )
    internal_key_file: str | None = Field(
        None,
        description="The deployment's internal key (a mounted Secret, re-read live): every router -> pod call "
        "(proxied requests, KV events, models, load, holds, tokenizer) authenticates with it.",
    )
    role: Role = Field(
        "both",
        description="Prefill/decode disaggregation: a model with prefill and decode endpoints runs each prompt "
        "on a prefill pod and generates on a decode pod, moving the KV between them. `prefill`/`decode`: every "
        f"endpoint of this backend has that role; `both`: each endpoint's own `{ROLE_LABEL}` label says "
        "(kubernetes discovery; one Service may then select both roles), unlabelled ones serve whole requests.",
    )

    @model_validator(mode="after")
    def _check_url(self) -> Backend:
        if "#" in self.name:  # `name#role` names the endpoints of one role of a backend (endpoints.py)
            raise ValueError(f"backend {self.name!r}: a name cannot contain '#'")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"backend {self.name!r}: url must be http(s)://host[:port], got {self.url!r}")
        return self

    @property
    def service(self) -> tuple[str, str | None, int]:
        """(service, namespace or None, port) from a cluster URL `http://svc.ns.svc[.cluster.local]:port`."""
        parts = urlsplit(self.url)
        labels = (parts.hostname or "").split(".")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return labels[0], (labels[1] if len(labels) > 1 else None), port


class Discovery(_Spec):
    mode: Literal["static", "kubernetes"] = Field(
        "static", description="static: each backend URL is one endpoint; kubernetes: its EndpointSlices."
    )
    namespace: str | None = Field(None, description="Default namespace for backend Services (kubernetes).")
    probe_interval_seconds: float = Field(0.5, gt=0, description="How often /load is read (and /health).")
    health_every: int = Field(4, ge=1, description="Probe /health every Nth load poll.")
    failure_threshold: int = Field(3, ge=1, description="Consecutive failures before an endpoint is ejected.")
    ejection_seconds: float = Field(5.0, gt=0, description="First ejection; doubles on each re-ejection.")
    max_ejection_seconds: float = Field(60.0, gt=0)
    kv_events: bool = Field(True, description="Follow the pods' KV-event streams (exact prefix index).")
    approximate_index_blocks: int = Field(200_000, ge=1, description="LRU bound of the approximate index.")


class Peers(_Spec):
    """The other replicas of this router: they share what each admitted per API key, so a RoutingPolicy's
    rate limits hold fleet-wide rather than per router (quota_peers.py)."""

    urls: tuple[str, ...] = Field((), description="Peer routers' base URLs (static; may include this one).")
    service: str | None = Field(
        None, description="The routers' Service: its EndpointSlices list the replicas (kubernetes discovery)."
    )
    port: int = Field(8080, ge=1, le=65535, description="The routers' port behind that Service.")
    interval_seconds: float = Field(0.5, gt=0, description="How often each peer's usage is read.")


class RouterConfig(_Spec):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    routing: RoutingSpec = RoutingSpec()
    backends: tuple[Backend, ...] = ()
    discovery: Discovery = Discovery()
    peers: Peers = Peers()
    api_keys: tuple[str, ...] = Field((), description="`KEY` or `KEY:TIER`; empty and no file = no auth.")
    api_key_file: str | None = Field(
        None, description="Same format, one per line (a mounted Secret); re-read when it changes."
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    generation: int | None = Field(
        None, description="The RoutingPolicy generation this file renders (reported at /v1/config)."
    )

    @model_validator(mode="after")
    def _check_backends(self) -> RouterConfig:
        names = [b.name for b in self.backends]
        if len(names) != len(set(names)):
            raise ValueError("backend names must be unique")
        known = set(names)
        served = {b.model for b in self.backends} | {r.model for r in self.routing.model_routes}
        for route in self.routing.model_routes:
            missing = [b for b in (*route.backends, *(w.backend for w in route.split)) if b not in known]
            if missing:
                field = "split" if route.split else "backends"
                raise ValueError(f"modelRoutes[{route.model}].{field}: unknown backends {missing}")
            for i, fb in enumerate(route.fallback):
                if fb not in served:
                    raise ValueError(
                        f"modelRoutes[{route.model}].fallback[{i}]: no backend or route serves {fb!r}"
                    )
        return self

    @classmethod
    def load(cls, path: str | Path) -> RouterConfig:
        return load_config(cls, path, "router config")

    def key_tiers(self) -> dict[str, str]:
        """API key -> tier ("default" when none is given)."""
        lines = list(self.api_keys)
        if self.api_key_file:
            try:
                lines += Path(self.api_key_file).read_text().splitlines()
            except OSError as e:
                raise ConfigError(f"cannot read api_key_file {self.api_key_file}: {e}") from e
        return parse_key_lines(lines)


def parse_key_lines(lines) -> dict[str, str]:
    """`KEY` or `KEY:TIER` lines (blank lines and `#` comments skipped) -> {key: tier}."""
    tiers: dict[str, str] = {}
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, _, tier = line.partition(":")
        tiers[key.strip()] = tier.strip() or "default"
    return tiers


# What a running router applies on a config change (dotted snake_case paths; a name covers its subtree).
# `routing.router` (replica count) is the operator's business, so a change to it needs nothing here.
LIVE_FIELDS: frozenset[str] = frozenset({"routing", "backends", "api_keys", "api_key_file", "generation"})
# Everything else: the listening socket, discovery (probe tasks and watches are built at start), limits
# of the HTTP server. Listed for `/v1/config` and the operator's pod-template hash.
RESTART_FIELDS: tuple[str, ...] = tuple(
    sorted(name for name in RouterConfig.model_fields if name not in LIVE_FIELDS)
)


def restart_only(config: RouterConfig) -> dict:
    """The restart-only part of `config` (snake_case JSON), e.g. to hash into a pod template."""
    data = config.model_dump(mode="json")
    return {k: v for k, v in data.items() if k in RESTART_FIELDS}
