"""Pod /metrics -> autoscaler sample, and router /metrics -> requests held, on the text the runtime server and
the router really expose."""

from __future__ import annotations

import pytest
from tokenfleet.operator.autoscaling_policy import PodState
from tokenfleet.operator.pod_metrics import (
    MetricsParseError,
    bucket_deltas,
    histogram_quantile,
    parse_metrics,
    pod_sample,
    router_pending,
)
from tokenfleet.runtime.engine.outputs import EngineStats, RequestDelta, RequestMetrics
from tokenfleet.runtime.router.metrics import RouterMetrics
from tokenfleet.runtime.server.metrics import ServerMetrics


class Pod:
    """A real ServerMetrics registry whose engine figures the test sets."""

    def __init__(self) -> None:
        self.stats = EngineStats()
        self.metrics = ServerMetrics("m", lambda: self.stats)
        self._n = 0

    def finish(self, ttft: float) -> None:
        self._n += 1
        timing = RequestMetrics(
            arrival_time=0.0, first_scheduled_time=0.0, first_token_time=ttft, finished_time=ttft
        )
        self.metrics.observe_finished(
            RequestDelta(f"r{self._n}", [], "", None, True, "stop", 1, 1, 0, metrics=timing)
        )

    def scrape(self):
        return parse_metrics(self.metrics.render().decode())


def test_gauges_counters_and_ttft_window_from_real_exposition():
    pod = Pod()
    pod.stats = EngineStats(num_running=3, num_waiting=5, kv_cache_usage=0.4, generation_tokens_total=1000)
    for _ in range(50):
        pod.finish(9.0)  # old, slow requests: before the window
    first = pod.scrape()
    pod.stats = EngineStats(num_running=2, num_waiting=7, kv_cache_usage=0.6, generation_tokens_total=1600)
    for i in range(10):
        pod.finish(0.03 if i < 9 else 3.0)
    second = pod.scrape()
    sample = pod_sample("pod-a", [(100.0, first), (160.0, second)], window_seconds=60, ttft_quantile=0.5)
    assert sample.state is PodState.READY
    assert (sample.num_waiting, sample.num_running, sample.kv_cache_usage) == (7, 2, 0.6)
    assert sample.output_tokens_per_second == pytest.approx(600 / 60)
    # Only the window's 10 requests count: p50 lies in the (0.02, 0.04] bucket, not near 9 s.
    assert 0.02 < sample.ttft_seconds <= 0.04
    p95 = pod_sample("pod-a", [(100.0, first), (160.0, second)], 60, 0.95).ttft_seconds
    assert 2.5 < p95 <= 5.0


def test_single_scrape_has_gauges_but_no_rate_or_ttft():
    pod = Pod()
    pod.stats = EngineStats(num_waiting=2)
    pod.finish(0.5)
    sample = pod_sample("p", [(0.0, pod.scrape())], 60, 0.9)
    assert sample.num_waiting == 2 and sample.ttft_seconds is None and sample.output_tokens_per_second == 0


def test_no_scrape_is_unknown():
    assert pod_sample("p", [], 60, 0.9).state is PodState.UNKNOWN


def test_counter_reset_after_a_pod_restart_uses_the_new_value():
    old = Pod()
    old.stats = EngineStats(generation_tokens_total=5000)
    for _ in range(20):
        old.finish(1.0)
    restarted = Pod()
    restarted.stats = EngineStats(generation_tokens_total=300)
    for _ in range(4):
        restarted.finish(0.05)
    sample = pod_sample("p", [(0.0, old.scrape()), (30.0, restarted.scrape())], 30, 0.5)
    assert sample.output_tokens_per_second == pytest.approx(10.0)
    assert 0.04 < sample.ttft_seconds <= 0.06


def test_histogram_quantile_matches_prometheus_interpolation():
    buckets = ((0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (float("inf"), 20.0))
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.75)
    assert histogram_quantile(0.9, ((1.0, 0.0), (float("inf"), 5.0))) == 1.0  # rank in +Inf: highest bound
    assert histogram_quantile(0.9, ((1.0, 0.0), (float("inf"), 0.0))) is None
    assert bucket_deltas(((1.0, 5.0), (2.0, 9.0)), ((1.0, 2.0), (2.0, 3.0))) == ((1.0, 3.0), (2.0, 6.0))
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, buckets)


def test_malformed_text_is_a_parse_error():
    with pytest.raises(MetricsParseError):
        parse_metrics('tokenfleet:num_requests_waiting{model_name="m" 3\n')


def test_router_pending_reads_one_models_gauge_from_the_routers_exposition():
    router = RouterMetrics()
    router.pending.labels("chat").set(3)
    router.pending.labels("other").set(5)  # someone else's demand is not ours
    text = router.render().decode()
    assert router_pending(text, "chat") == 3
    assert router_pending(text, "absent") == 0
    with pytest.raises(MetricsParseError):
        router_pending('tokenfleet:router_pending_requests{model="chat" 3\n', "chat")
