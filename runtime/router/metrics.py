"""Router metrics (Prometheus), on a registry owned by the app rather than the process-global one."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "tokenfleet:router_"


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "requests", "Requests by model and HTTP status.", ["model", "status"], registry=r
        )
        self.decisions = Counter(
            PREFIX + "decisions",
            "Routing decisions by reason (prefix_hit, load, round_robin, session, hotspot_guard, fallback).",
            ["reason"],
            registry=r,
        )
        self.prefix_match_blocks = Histogram(
            PREFIX + "prefix_match_blocks",
            "Leading prompt blocks cached on the chosen endpoint.",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.prefix_match_ratio = Histogram(
            PREFIX + "prefix_match_ratio",
            "Cached fraction of the prompt's full blocks on the chosen endpoint.",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        # The router's own cost per decision: hashing the prompt, the prefix matches, the strategy. Tens of
        # microseconds for a short prompt, milliseconds for a prompt of 100k+ tokens (bench/router_pick.py).
        self.pick_seconds = Histogram(
            PREFIX + "pick_seconds",
            "Time to pick an endpoint for a request (prompt hashing, prefix matches, strategy).",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1),
            registry=r,
        )
        # The router's part of a client's time to first token; the pod's parts are its
        # request_queue_time_seconds (waiting there) and request_prefill_time_seconds (its prompt's steps).
        self.queue_wait_seconds = Histogram(
            PREFIX + "queue_wait_seconds",
            "Time a request waited in the router's queue before it could be sent to a pod (0 when it was "
            "not held), by the model the client named.",
            ["model"],
            buckets=(1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
            registry=r,
        )
        self.in_flight = Gauge(
            PREFIX + "endpoint_in_flight", "Requests in flight per endpoint.", ["endpoint"], registry=r
        )
        self.healthy = Gauge(
            PREFIX + "endpoint_healthy", "1 when the endpoint takes traffic.", ["endpoint"], registry=r
        )
        self.events_live = Gauge(
            PREFIX + "endpoint_kv_events_live",
            "1 when the exact index follows the endpoint.",
            ["endpoint"],
            registry=r,
        )
        self.kv_event_errors = Counter(
            PREFIX + "kv_event_errors",
            "KV-event replies rejected and resynced, by reason (malformed, epoch, order).",
            ["reason"],
            registry=r,
        )
        self.retries = Counter(
            PREFIX + "retries", "Attempts retried on another endpoint.", ["reason"], registry=r
        )
        self.adapter_drains = Counter(
            PREFIX + "adapter_drains",
            "Copies of a LoRA adapter given no new requests on one pod so that a refused adapter gets a place.",
            registry=r,
        )
        self.ejections = Counter(PREFIX + "ejections", "Endpoint ejections.", ["endpoint"], registry=r)
        self.stream_errors = Counter(
            PREFIX + "stream_errors", "Streams ended with an error event after the first byte.", registry=r
        )
        self.resumes = Counter(
            PREFIX + "resumes", "Continuations sent to another endpoint after a stream broke.", registry=r
        )
        self.resume_failures = Counter(
            PREFIX + "resume_failures",
            "Broken streams not continued, or continuations refused, by reason.",
            ["reason"],
            registry=r,
        )
        self.resume_recomputed_tokens = Counter(
            PREFIX + "resume_recomputed_tokens",
            "Prompt and generated tokens continuations had to compute again (not in the new pod's cache).",
            registry=r,
        )
        self.rate_limited = Counter(PREFIX + "rate_limited", "429s by limit kind.", ["kind"], registry=r)
        self.priority_lowered = Counter(
            PREFIX + "priority_lowered",
            "Requests that asked for more urgency than their API key's tier allows (served at the tier's).",
            registry=r,
        )
        self.queue_waiting = Gauge(
            PREFIX + "queue_waiting", "Requests waiting for capacity in the router.", registry=r
        )
        # The demand signal for scaling, from zero too: requests held because no endpoint of the model
        # could take them (none ready, all ejected or at their limit), and requests a fallback serves
        # meanwhile because the model had no ready endpoint. By the model its pods serve, never an alias.
        self.pending = Gauge(
            PREFIX + "pending_requests",
            "Requests the model's own pods could not take: held in the router's queue, or served by a "
            "fallback while none of its endpoints was ready.",
            ["model"],
            registry=r,
        )
        # The other half of the demand signal: requests queued in the model's own pods, as their last load
        # reports said. Read every second by the operator between its scrapes of the pods, so a burst
        # starts new capacity at once instead of at the next periodic decision.
        self.pod_waiting = Gauge(
            PREFIX + "pod_waiting_requests",
            "Requests waiting in the queues of the model's pods, as their last load reports said.",
            ["model"],
            registry=r,
        )
        # Sleep mode: pods the router knows to be asleep, and the wakes it sent for held requests (wake.py).
        self.wakes = Counter(
            PREFIX + "wakes",
            "Wake-ups sent to sleeping pods for held requests, by backend and outcome (ok, refused, timeout, "
            "error).",
            ["backend", "outcome"],
            registry=r,
        )
        self.endpoints_asleep = Gauge(
            PREFIX + "endpoints_asleep",
            "Endpoints whose pod says it is asleep (sleep mode), by backend.",
            ["backend"],
            registry=r,
        )
        self.config_generation = Gauge(
            PREFIX + "config_generation",
            "The RoutingPolicy generation of the config in effect (-1: none given).",
            registry=r,
        )
        self.config_reloads = Counter(
            PREFIX + "config_reloads", "Config file changes applied live.", registry=r
        )
        self.config_restart_pending = Gauge(
            PREFIX + "config_restart_pending",
            "1 when the config file has changes that need a router restart.",
            registry=r,
        )

    def forget_endpoint(self, endpoint: str) -> None:
        for g in (self.in_flight, self.healthy, self.events_live):
            with contextlib.suppress(KeyError):
                g.remove(endpoint)

    def render(self) -> bytes:
        return generate_latest(self.registry)
