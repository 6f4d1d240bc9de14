"""A pod's `/metrics` text -> the figures the autoscaler needs -> one `PodSample` for the policy; and a
router's `/metrics` text -> the requests it holds for a model (`router_pending`).

Parsing goes through prometheus-client's own text parser (families, label sets, `_bucket`/`_count`
suffixes, escaping) rather than regexes. Only `tokenfleet:` series are read, and `vllm:` ones under the
same name (a pod with `metrics.naming: vllm` spells what vLLM also reports vLLM's way, same meaning and
units); a pod serving several model names is summed over them.

Counters and histograms are cumulative since the pod started, so rates and percentiles come from the
difference between the newest scrape and the one at (or just before) the start of the window. A counter
that went down means the pod restarted: the newer value is then the whole delta (as Prometheus' `rate`).
Percentiles interpolate linearly inside the bucket that holds the rank, as `histogram_quantile` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from tokenfleet.operator.autoscaling_policy import PodSample, PodState

PREFIX = "tokenfleet:"
VLLM_PREFIX = "vllm:"
TTFT = PREFIX + "time_to_first_token_seconds"
GENERATION_TOKENS = PREFIX + "generation_tokens"
# The routers' gauge of requests held because no endpoint can take them: the demand that brings a model
# back from zero replicas.
ROUTER_PENDING = "tokenfleet:router_pending_requests"
ROUTER_POD_WAITING = "tokenfleet:router_pod_waiting_requests"


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format (the scrape counts as failed: the pod is unknown)."""


@dataclass(frozen=True, slots=True)
class PodMetrics:
    """One scrape: gauges and counters summed over label sets; histograms as cumulative buckets."""

    gauges: Mapping[str, float]
    counters: Mapping[str, float]  # by family name (without `_total`)
    histograms: Mapping[
        str, tuple[tuple[float, float], ...]
    ]  # name -> ((upper bound, cumulative count), ...)

    def gauge(self, name: str) -> float:
        return self.gauges.get(PREFIX + name, 0.0)


def parse_metrics(text: str) -> PodMetrics:
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as e:
        raise MetricsParseError(f"malformed /metrics text: {e}") from e
    for family in families:
        name = family.name
        if name.startswith(VLLM_PREFIX):
            name = PREFIX + name.removeprefix(VLLM_PREFIX)
        elif not name.startswith(PREFIX):
            continue
        for sample in family.samples:
            if family.type == "gauge":
                gauges[name] = gauges.get(name, 0.0) + sample.value
            elif family.type == "counter" and sample.name.endswith("_total"):
                counters[name] = counters.get(name, 0.0) + sample.value
            elif family.type == "histogram" and sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                per = buckets.setdefault(name, {})
                per[le] = per.get(le, 0.0) + sample.value
    histograms = {name: tuple(sorted(per.items())) for name, per in buckets.items()}
    return PodMetrics(gauges, counters, histograms)


def router_pending(text: str, model: str) -> float:
    """Requests a router holds for `model` (its pending gauge); raises MetricsParseError on malformed text."""
    return router_gauges(text, model)[0]


def router_gauges(text: str, model: str) -> tuple[float, float]:
    """(requests a router holds for `model`, requests queued in the model's pods as the router last heard
    from them), from its /metrics; raises MetricsParseError on malformed text."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as e:
        raise MetricsParseError(f"malformed router /metrics: {e}") from e
    held = waiting = 0.0
    for family in families:
        if family.name not in (ROUTER_PENDING, ROUTER_POD_WAITING):
            continue
        total = sum(s.value for s in family.samples if s.labels.get("model") == model)
        if family.name == ROUTER_PENDING:
            held += total
        else:
            waiting += total
    return held, waiting


def _delta(new: float, old: float) -> float:
    return new if new < old else new - old


def bucket_deltas(
    new: Sequence[tuple[float, float]], old: Sequence[tuple[float, float]]
) -> tuple[tuple[float, float], ...]:
    """Cumulative buckets of the observations between two scrapes (a reset: the newer ones whole)."""
    before = dict(old)
    reset = any(count < before.get(le, 0.0) for le, count in new)
    return tuple((le, count if reset else count - before.get(le, 0.0)) for le, count in new)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile (0 < q < 1) of cumulative `(upper bound, count)` buckets; None without observations.

    Linear inside the bucket holding the rank (the first bucket starts at 0); a rank in the +Inf bucket
    answers the highest finite bound, as Prometheus does.
    """
    if not 0 < q < 1:
        raise ValueError(f"quantile must be in (0, 1), got {q}")
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            in_bucket = count - below
            if in_bucket <= 0:
                return upper
            return lower + (upper - lower) * (rank - below) / in_bucket
        lower, below = upper, count
    return lower


def pod_sample(
    pod: str,
    scrapes: Sequence[tuple[float, PodMetrics]],
    window_seconds: float,
    ttft_quantile: float,
) -> PodSample:
    """The policy's view of a Ready pod from its scrapes, oldest first (the newest one is "now").

    Gauges come from the newest scrape; the TTFT quantile and the output rate from the difference to the
    newest scrape at least `window_seconds` older (or the oldest one there is). One scrape only: no rate
    and no TTFT yet. No scrapes: the pod is unknown.
    """
    if not scrapes:
        return PodSample(pod, PodState.UNKNOWN)
    now, latest = scrapes[-1]
    base_time, base = scrapes[0]
    for t, m in scrapes[:-1]:
        if now - t >= window_seconds:
            base_time, base = t, m
    ttft = None
    rate = 0.0
    if base is not latest and now > base_time:
        new_buckets = latest.histograms.get(TTFT, ())
        ttft = histogram_quantile(ttft_quantile, bucket_deltas(new_buckets, base.histograms.get(TTFT, ())))
        generated = _delta(
            latest.counters.get(GENERATION_TOKENS, 0.0), base.counters.get(GENERATION_TOKENS, 0.0)
        )
        rate = generated / (now - base_time)
    return PodSample(
        pod,
        PodState.READY,
        num_waiting=latest.gauge("num_requests_waiting"),
        num_running=latest.gauge("num_requests_running"),
        kv_cache_usage=latest.gauge("kv_cache_usage_perc"),
        ttft_seconds=ttft,
        output_tokens_per_second=rate,
    )
