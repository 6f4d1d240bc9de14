"""RouterConfig: what `tokenfleet route --config PATH` reads.

The operator writes this file into the router's ConfigMap: a `routing:` dict that is the RoutingPolicy spec
(camelCase, as in the CRD) plus `backends: [{name, model, url}]`, one per ModelDeployment the policy routes.
Both spellings (camelCase and snake_case) are accepted so hand-written files for local use stay readable.
Unknown keys are rejected: a typo in a routing policy must fail loudly, not route silently by defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from tokenfleet.runtime.errors import ConfigError

Strategy = Literal["round-robin", "least-load", "prefix-affinity", "session-affinity"]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class Weights(_Spec):
    """Weights of the combined score; each scorer returns a value in [0, 1] (higher = better)."""

    prefix: float = Field(3.0, ge=0, description="Fraction of the prompt's blocks already cached on the pod.")
    queue: float = Field(2.0, ge=0, description="Min-max normalised queue length (waiting + running).")
    kv_usage: float = Field(1.0, ge=0, description="1 - the pod's KV cache usage.")


class Balance(_Spec):
    """Hot-spot guard: when both thresholds are passed, load alone decides (SGLang-style)."""

    absolute: int = Field(8, ge=0, description="max load - min load above this ...")
    relative: float = Field(1.5, ge=1.0, description="... and max load above relative * min load.")


class ModelRoute(_Spec):
    model: str = Field(description="The model name clients send.")
    backends: tuple[str, ...] = Field(
        (), description="Backend names serving it; empty = every backend of `model`."
    )
    fallback: tuple[str, ...] = Field(
        (), description="Models tried in order when no backend of `model` is healthy."
    )


class PriorityClass(_Spec):
    name: str
    priority: int = Field(0, description="Higher is served first when the router queues under load.")
    tiers: tuple[str, ...] = Field((), description="API key tiers that get this class by default.")


class Limit(_Spec):
    requests_per_minute: float | None = Field(None, gt=0)
    tokens_per_minute: float | None = Field(None, gt=0, description="Prompt + completion tokens.")


class RateLimits(Limit):
    """Per-key limits (a key is the API key, or the client address when keys are off); tiers override."""

    tiers: dict[str, Limit] = Field(default_factory=dict)


class Retries(_Spec):
    max_attempts: int = Field(3, ge=1, le=10, description="Attempts per request, the first included.")
    connect_timeout_seconds: float = Field(5.0, gt=0)
    first_byte_timeout_seconds: float = Field(120.0, gt=0, description="Until response headers (prefill).")
    idle_timeout_seconds: float = Field(60.0, gt=0, description="Longest silence inside a stream.")


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
    retries: Retries = Retries()
    router: RouterReplicas = RouterReplicas()
    session_header: str = Field("x-session-id", description="session-affinity key; else the body's `user`.")
    priority_header: str = Field("x-priority-class", description="Names a priority class.")
    max_in_flight_per_endpoint: int = Field(
        32, ge=1, description="Beyond this on every candidate, requests queue in the router by priority."
    )
    queue_timeout_seconds: float = Field(30.0, gt=0, description="Longest wait in that queue, then 429.")

    @model_validator(mode="after")
    def _check_names(self) -> RoutingSpec:
        names = [c.name for c in self.priority_classes]
        if len(names) != len(set(names)):
            raise ValueError("priorityClasses names must be unique")
        return self


class Backend(_Spec):
    name: str = Field(description="The ModelDeployment (its Service) name.")
    model: str = Field(description="The served model name.")
    url: str = Field(description="Base URL, e.g. http://name.namespace.svc:8000 (static: the pod itself).")
    tokenizer: str | None = Field(
        None,
        description="Model source to load the tokenizer from (built-in name, .gguf, HF dir); default `model`.",
    )
    block_size: int = Field(16, description="Used until the pods report theirs on the KV-event stream.")

    @model_validator(mode="after")
    def _check_url(self) -> Backend:
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


class RouterConfig(_Spec):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    routing: RoutingSpec = RoutingSpec()
    backends: tuple[Backend, ...] = ()
    discovery: Discovery = Discovery()
    api_keys: tuple[str, ...] = Field((), description="`KEY` or `KEY:TIER`; empty and no file = no auth.")
    api_key_file: str | None = Field(None, description="Same format, one per line (a mounted Secret).")
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)

    @model_validator(mode="after")
    def _check_backends(self) -> RouterConfig:
        names = [b.name for b in self.backends]
        if len(names) != len(set(names)):
            raise ValueError("backend names must be unique")
        known = set(names)
        for route in self.routing.model_routes:
            missing = [b for b in route.backends if b not in known]
            if missing:
                raise ValueError(f"modelRoutes[{route.model}]: unknown backends {missing}")
        return self

    @classmethod
    def load(cls, path: str | Path) -> RouterConfig:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
            return cls.model_validate(data)
        except (OSError, yaml.YAMLError, ValueError) as e:
            raise ConfigError(f"invalid router config {path}: {e}") from e

    def key_tiers(self) -> dict[str, str]:
        """API key -> tier ("default" when none is given)."""
        lines = list(self.api_keys)
        if self.api_key_file:
            try:
                lines += Path(self.api_key_file).read_text().splitlines()
            except OSError as e:
                raise ConfigError(f"cannot read api_key_file {self.api_key_file}: {e}") from e
        tiers: dict[str, str] = {}
        for raw in lines:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, _, tier = line.partition(":")
            tiers[key.strip()] = tier.strip() or "default"
        return tiers
