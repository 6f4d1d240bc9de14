"""Prometheus metrics of one server, in a per-app CollectorRegistry (no process-global state).

Two namings (`metrics.naming` in RuntimeConfig, `spec.metrics.naming` on a ModelDeployment):
- `tokenfleet` (default): every metric as `tokenfleet:<name>{model_name}`;
- `vllm`: what vLLM also reports is spelled exactly as vLLM's V1 engine spells it — `vllm:<name>`, labels
  `model_name` and `engine` (one engine per pod: "0"), the same types, units and histogram buckets — so
  Gateway API Inference Extension endpoint pickers (queue: `vllm:num_requests_waiting`, KV-cache
  utilisation 0..1: `vllm:kv_cache_usage_perc`, block size and capacity: `vllm:cache_config_info`),
  KEDA/Prometheus rules and dashboards written for vLLM read our pods unchanged. Metrics vLLM has no
  counterpart for keep their `tokenfleet:` names and labels in both modes: a name never claims a meaning
  its owner did not define.

Gauges and cumulative counters are read from `engine.stats()` at scrape time by a custom collector: the
engine owns those numbers and copying them on every step would cost the hot loop. Latency histograms are
observed by the server from each request's final `RequestDelta.metrics` and from the gaps between the
deltas it receives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from tokenfleet.runtime.config import CacheConfig, RuntimeConfig
from tokenfleet.runtime.engine.outputs import EngineStats, RequestDelta

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


# Metrics vLLM defines with the same meaning, type and unit (names without prefix or `_total`).
VLLM_DEFINED = frozenset(
    {
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "cache_config_info",
        "lora_requests_info",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    }
)


@dataclass(frozen=True, slots=True)
class Naming:
    """How one naming mode spells the metrics vLLM also defines (the others never change)."""

    prefix: str
    extra_labels: tuple[tuple[str, str], ...] = ()  # (name, value) after model_name
    info_names_model: bool = True  # whether info metrics (cache_config_info) carry model_name

    def name(self, base: str) -> str:
        return (self.prefix if base in VLLM_DEFINED else PREFIX) + base

    def label_names(self, base: str) -> list[str]:
        extra = [k for k, _ in self.extra_labels] if base in VLLM_DEFINED else []
        return ["model_name", *extra]

    def label_values(self, base: str, model_name: str) -> list[str]:
        extra = [v for _, v in self.extra_labels] if base in VLLM_DEFINED else []
        return [model_name, *extra]


NAMINGS: dict[str, Naming] = {
    "tokenfleet": Naming(PREFIX),
    # vLLM's V1 engine labels each metric with its engine index; a pod runs one engine.
    "vllm": Naming("vllm:", (("engine", "0"),), info_names_model=False),
}


def cache_config_labels(cache: CacheConfig, stats: EngineStats) -> dict[str, str]:
    """The KV-cache facts vLLM's `cache_config_info` carries (label values are str() of the values, as in
    vLLM), under vLLM's field names; capacity is in blocks of the device pool and of the host tier."""
    host_blocks = stats.kv_metrics.host_total_blocks if stats.kv_metrics is not None else 0
    return {
        "block_size": str(cache.block_size),
        "cache_dtype": cache.kv_cache_dtype,
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        "num_gpu_blocks": str(stats.num_total_blocks),
        "num_cpu_blocks": str(host_blocks),
    }


class EngineStatsCollector(Collector):
    """Gauges and counters read from the engine's own cumulative stats at scrape time."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        naming: Naming = NAMINGS["tokenfleet"],
        cache: CacheConfig | None = None,
    ):
        self._model_name = model_name
        self._stats = stats
        self._naming = naming
        self._cache = cache or CacheConfig()

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:  # model still loading: expose nothing rather than misleading zeros
            return
        n = self._naming
        labels = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(n.name(name), doc, labels=n.label_names(name))
            family.add_metric(n.label_values(name, self._model_name), value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(n.name(name), doc, labels=n.label_names(name))
            family.add_metric(n.label_values(name, self._model_name), value)
            return family

        yield self._cache_config_info(stats)
        if stats.max_lora:
            yield self._lora_requests_info(stats)
            yield from self._lora_swaps(stats, labels)

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage)
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
        if stats.model_seconds_total:  # the host clock runs only where the forward runs on the host
            yield counter(
                "engine_model_seconds",
                "Seconds in the steps' model work (forward pass, logits, sampling).",
                stats.model_seconds_total,
            )
            yield counter(
                "engine_host_gap_seconds",
                "Seconds from one step's model work to the next one's while the engine stayed busy.",
                stats.host_gap_seconds_total,
            )
            yield counter("engine_host_gaps", "Gaps counted in engine_host_gap_seconds.", stats.num_host_gaps)
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

    @staticmethod
    def _lora_swaps(stats: EngineStats, labels: list[str]) -> Iterator[Metric]:
        loads = CounterMetricFamily(
            PREFIX + "lora_adapter_loads",
            "LoRA adapters loaded, by level (host: files read into host memory; device: copied into a slot).",
            labels=["model_name", "level"],
        )
        evictions = CounterMetricFamily(
            PREFIX + "lora_adapter_evictions",
            "LoRA adapters evicted to make room for another (the swap rate), by level.",
            labels=["model_name", "level"],
        )
        for level, loaded, evicted in stats.lora_swaps:
            loads.add_metric([*labels, level], loaded)
            evictions.add_metric([*labels, level], evicted)
        yield loads
        yield evictions

    def _lora_requests_info(self, stats: EngineStats) -> Metric:
        """vLLM's LoRA gauge, which LoRA-affinity schedulers (the Gateway API inference extension's) read:
        its labels list the adapters of running and of waiting requests (comma-separated) and the slot
        count; its value is the time of the reading, so the newest series is the current one."""
        family = GaugeMetricFamily(
            self._naming.name("lora_requests_info"),
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        family.add_metric(
            [
                str(stats.max_lora),
                ",".join(stats.waiting_lora_adapters),
                ",".join(stats.running_lora_adapters),
            ],
            time.time(),
        )
        return family

    def _cache_config_info(self, stats: EngineStats) -> Metric:
        """An info metric: a gauge fixed at 1 whose labels carry the facts (what vLLM exposes too)."""
        n = self._naming
        ids = dict(
            zip(
                n.label_names("cache_config_info"),
                n.label_values("cache_config_info", self._model_name),
                strict=True,
            )
        )
        if not n.info_names_model:
            del ids["model_name"]
        ids.update(cache_config_labels(self._cache, stats))
        family = GaugeMetricFamily(
            n.name("cache_config_info"), "Information of the LLMEngine CacheConfig", labels=list(ids)
        )
        family.add_metric(list(ids.values()), 1.0)
        return family


class ServerMetrics:
    """The metrics one app exposes; `observe_*` are called by the request handlers."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        naming: str = "tokenfleet",
        cache: CacheConfig | None = None,
    ):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        n = NAMINGS[naming]
        self.registry.register(EngineStatsCollector(model_name, stats, n, cache))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            family = Histogram(
                n.name(name), doc, n.label_names(name), buckets=buckets, registry=self.registry
            )
            return family.labels(*n.label_values(name, model_name))

        # vLLM's documentation strings, so `# HELP` lines read the same in both namings.
        self._ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self._itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self._e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS
        )
        self._queue = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            E2E_BUCKETS,
        )
        # With the queue time, the pod's parts of a request's TTFT (the router's own queue is
        # tokenfleet:router_queue_wait_seconds); vLLM's names, meanings and buckets.
        self._prefill = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            E2E_BUCKETS,
        )
        self._decode = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            E2E_BUCKETS,
        )
        self._success = Counter(
            n.name("request_success"),
            "Count of successfully processed requests.",
            [*n.label_names("request_success"), "finished_reason"],
            registry=self.registry,
        )
        self._success_labels = n.label_values("request_success", model_name)
        self._http = Counter(
            n.name("http_requests"),
            "HTTP requests by route and status.",
            [*n.label_names("http_requests"), "route", "status"],
            registry=self.registry,
        )
        self._truncated = Counter(
            n.name("prompt_tokens_truncated"),
            "Prompt tokens dropped to fit the context window (context_overflow: truncate).",
            n.label_names("prompt_tokens_truncated"),
            registry=self.registry,
        ).labels(*n.label_values("prompt_tokens_truncated", model_name))
        # `tokenfleet:` in both namings: vLLM's own sleep gauge has other labels and values.
        self._sleep_state = Gauge(
            PREFIX + "engine_sleep_state",
            "Sleep mode: 0 awake, 1 or 2 the level the engine sleeps at.",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name)

    @classmethod
    def from_config(cls, config: RuntimeConfig, stats: Callable[[], EngineStats | None]) -> ServerMetrics:
        return cls(config.model.name, stats, config.metrics.naming, config.cache)

    def observe_token_gap(self, seconds: float, num_tokens: int) -> None:
        # A delta may carry several tokens (speculative decoding): spread the gap evenly over them.
        if num_tokens <= 0:
            return
        for _ in range(num_tokens):
            self._itl.observe(seconds / num_tokens)

    def observe_finished(self, output: RequestDelta) -> None:
        self._success.labels(*self._success_labels, output.finish_reason or "unknown").inc()
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self._ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self._queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.first_token_time is not None:
                self._prefill.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.finished_time is not None:
            self._e2e.observe(max(0.0, m.finished_time - m.arrival_time))
            if m.first_token_time is not None:
                self._decode.observe(max(0.0, m.finished_time - m.first_token_time))

    def observe_aborted(self) -> None:
        """A request the server aborted (client gone): the engine's final output never reaches us."""
        self._success.labels(*self._success_labels, "abort").inc()

    def observe_truncated(self, num_tokens: int) -> None:
        self._truncated.inc(num_tokens)

    def set_sleep_state(self, level: int) -> None:
        self._sleep_state.set(level)

    def observe_http(self, route: str, status: int) -> None:
        self._http.labels(self.model_name, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
