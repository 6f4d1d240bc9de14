"""Prometheus metrics of one server, in a per-app CollectorRegistry (no process-global state).

Names follow vLLM's under the `tokenfleet:` prefix so dashboards, HPA/KEDA adapters
and Gateway API Inference Extension endpoint pickers work unchanged. Gauges and cumulative counters are
read from `engine.stats()` at scrape time by a custom collector: the engine owns those numbers and
copying them on every step would cost the hot loop. Latency histograms are observed by the server from
each request's final `RequestOutput.metrics` and from the gaps between the deltas it receives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from tokenfleet.runtime.engine.outputs import EngineStats, RequestOutput

PREFIX = "tokenfleet:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets as vLLM uses them, so recording rules written for vLLM keep their meaning.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineStatsCollector(Collector):
    """Gauges and counters read from the engine's own cumulative stats at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:  # model still loading: expose nothing rather than misleading zeros
            return
        labels = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", stats.kv_cache_usage)
        yield gauge("num_kv_blocks_free", "Free KV-cache blocks.", stats.num_free_blocks)
        yield gauge("num_kv_blocks_total", "KV-cache blocks in the pool.", stats.num_total_blocks)
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        yield counter("num_preemptions", "Requests preempted to free KV blocks.", stats.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens processed.", stats.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter("engine_steps", "Engine steps run.", stats.num_steps)
        # Speculative decoding (vLLM's spec_decode_* names); zero when speculation is off.
        yield counter(
            "spec_decode_num_drafts", "Request-steps verified with proposals.", stats.spec_decode_num_drafts
        )
        yield counter(
            "spec_decode_num_draft_tokens", "Proposed tokens verified.", stats.spec_decode_num_draft_tokens
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Proposed tokens accepted.",
            stats.spec_decode_num_accepted_tokens,
        )
        kv = stats.kv_metrics
        if kv is not None:  # the cache policy's view, in blocks
            lookups = CounterMetricFamily(
                PREFIX + "kv_cache_lookup_blocks",
                "Prefix blocks looked up at admission, by where they were found (device, host, miss).",
                labels=["model_name", "tier"],
            )
            for tier, value in (
                ("device", kv.device_hit_blocks),
                ("host", kv.host_hit_blocks),
                ("miss", kv.miss_blocks),
            ):
                lookups.add_metric([*labels, tier], value)
            yield lookups
            evictions = CounterMetricFamily(
                PREFIX + "kv_cache_evicted_blocks",
                "Cached blocks evicted, by reason.",
                labels=["model_name", "reason"],
            )
            evictions.add_metric([*labels, "ttl"], kv.evicted_ttl_blocks)
            evictions.add_metric([*labels, "pressure"], kv.evicted_pressure_blocks)
            yield evictions
            yield gauge("kv_cache_pinned_blocks", "Blocks held by pinned prefixes.", kv.pinned_blocks)
            yield counter("kv_offload_stored_blocks", "Blocks copied device -> host.", kv.offloaded_blocks)
            yield counter("kv_offload_loaded_blocks", "Blocks copied host -> device.", kv.loaded_blocks)
            yield gauge("kv_offload_used_blocks", "Host-tier blocks in use.", kv.host_used_blocks)
            yield gauge(
                "kv_offload_total_blocks", "Host-tier capacity in blocks (0 = off).", kv.host_total_blocks
            )


class ServerMetrics:
    """The metrics one app exposes; `observe_*` are called by the request handlers."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(model_name, stats))
        labels = ["model_name"]
        self._ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between output tokens.",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self._e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to last token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self._queue = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first scheduling.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._http = Counter(
            PREFIX + "http_requests",
            "HTTP requests by route and status.",
            [*labels, "route", "status"],
            registry=self.registry,
        )

    def observe_token_gap(self, seconds: float, num_tokens: int) -> None:
        # A delta may carry several tokens (speculative decoding): spread the gap evenly over them.
        if num_tokens <= 0:
            return
        child = self._itl.labels(self.model_name)
        for _ in range(num_tokens):
            child.observe(seconds / num_tokens)

    def observe_finished(self, output: RequestOutput) -> None:
        self._success.labels(self.model_name, output.finish_reason or "unknown").inc()
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self._ttft.labels(self.model_name).observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self._queue.labels(self.model_name).observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.finished_time is not None:
            self._e2e.labels(self.model_name).observe(max(0.0, m.finished_time - m.arrival_time))

    def observe_aborted(self) -> None:
        """A request the server aborted (client gone): the engine's final output never reaches us."""
        self._success.labels(self.model_name, "abort").inc()

    def observe_http(self, route: str, status: int) -> None:
        self._http.labels(self.model_name, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
