"""What a simulation measured: latency percentiles, goodput under the SLO, cache hits, load spread, preemptions,
replica-seconds, GPU-hours and cost — as a JSON-able dict (stable: same seed, same bytes) and a table.

Per-request figures are what a client measures: TTFT = first token - arrival (router queueing included),
TPOT = (last token - first token) / (output tokens - 1), E2E = last token - arrival; ITL is every gap between
consecutive tokens of a request, kept in a histogram of 1%-wide log bins (there are too many to keep).
TTFT is also split into the three parts that sum to it (`router_queue`, `pod_queue`, `prefill`: where a
request waited, and what its own steps cost), and `queue` is the first two together.
A request is *good* when its TTFT <= slo.ttft_s and its TPOT <= slo.tpot_s; the fleet *meets* the SLO when
the p99 TTFT and p99 TPOT do and nothing was left unfinished or rejected.

With LoRA adapters (`workload.adapters`), `lora`: adapter loads and swaps (loads that evicted another
adapter) in all and per replica, swaps per minute, the most adapters any pod held at once, how long
requests waited on their pod for an adapter's load (or for room to load it), and how many pods served each
adapter (the most requested one's, and the mean), and for adapters with a minCopies how many pods hold
them at the end and how often the operator found every minimum held. SLO attainment is
`slo.goodput_fraction`: the share of arrived requests whose TTFT <= slo.ttft_s and TPOT <= slo.tpot_s.

With `breakdown`, the same per-request figures per tenant and/or per priority (`by_tenant`, `by_priority`):
what one class of traffic saw beside the others (a light tenant beside a flood, interactive beside batch).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import numpy as np
from tokenfleet.sim.hardware import gpu_profile, parse_prices

_LOG_BIN = math.log(1.01)


def _r(x: float) -> float:
    return float(f"{x:.6g}")


def _pcts(values) -> dict[str, float]:
    if len(values) == 0:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": _r(p50), "p90": _r(p90), "p99": _r(p99), "mean": _r(a.mean()), "max": _r(a.max())}


class _Class:
    """The per-request figures of one tenant or one priority."""

    __slots__ = ("arrived", "finished", "good", "output_tokens", "preempted", "preemptions", "rejected")
    __slots__ += ("e2e", "tpot", "ttft", "ttft_parts")

    def __init__(self) -> None:
        self.arrived = self.finished = self.good = self.output_tokens = 0
        self.preempted = self.preemptions = self.rejected = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.e2e: list[float] = []
        self.ttft_parts = _TTFTParts()

    def summary(self, duration: float) -> dict:
        return {
            "requests": {
                "arrived": self.arrived,
                "finished": self.finished,
                "rejected": self.rejected,
                "unfinished": self.arrived - self.finished - self.rejected,
                "preempted": self.preempted,
            },
            "preemptions": self.preemptions,  # of its finished requests
            "latency_s": {
                "ttft": _pcts(self.ttft),
                "tpot": _pcts(self.tpot),
                "e2e": _pcts(self.e2e),
                **self.ttft_parts.summary(),
            },
            "goodput_fraction": _r(self.good / self.arrived) if self.arrived else 0.0,
            "goodput_rps": _r(self.good / duration),
            "output_tokens_per_s": _r(self.output_tokens / duration),
        }


class _TTFTParts:
    """Where a request's time to first token went, in three consecutive parts that sum to it: `router_queue`
    (arrival -> it reached its pod: the router's queue and the hop there), `pod_queue` (-> its engine first
    scheduled it: the pod's waiting queue, and an adapter's load when it waited for one) and `prefill`
    (-> its first token: vLLM's prefill time, the steps that ran its prompt, and any it spent preempted).
    A disaggregated request's parts are its prefill phase's."""

    __slots__ = ("pod_queue", "prefill", "router_queue")

    def __init__(self) -> None:
        self.router_queue: list[float] = []
        self.pod_queue: list[float] = []
        self.prefill: list[float] = []

    def add(self, rec) -> None:
        self.router_queue.append(rec.reached - rec.request.arrival)
        self.pod_queue.append(rec.first_scheduled - rec.reached)
        self.prefill.append(rec.first_token - rec.first_scheduled)

    def summary(self) -> dict:
        return {
            "router_queue": _pcts(self.router_queue),
            "pod_queue": _pcts(self.pod_queue),
            "prefill": _pcts(self.prefill),
        }


_CLASS_OF = {"tenant": lambda sreq: sreq.tenant or "", "priority": lambda sreq: str(sreq.priority)}


class Collector:
    def __init__(self, config) -> None:
        self.config = config
        self.num_arrived = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.e2e: list[float] = []
        self.queue: list[float] = []
        self.ttft_parts = _TTFTParts()
        self.good = 0
        self.num_finished = 0
        self.rejected: list[str] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.cut_short = 0  # ended by the context length before their output length
        self.preempted_requests = 0
        self.timeline: dict[str, list[float]] = {
            k: [] for k in ("t", "waiting", "running", "kv_usage", "ready", "replicas", "ttft_p50")
        }
        self._tick_ttft: list[float] = []
        # breakdown -> class name -> its figures (empty unless the config asks for a breakdown)
        self._by: dict[str, dict[str, _Class]] = {dim: {} for dim in config.breakdown}
        # LoRA: adapter -> {replica: requests of it served there}; waits for an adapter on the pod.
        self._adapters = config.uses_adapters
        self.adapter_pods: dict[str, dict[str, int]] = defaultdict(dict)
        self.adapter_wait: list[float] = []

    def _classes(self, sreq) -> list[_Class]:
        out = []
        for dim, classes in self._by.items():
            name = _CLASS_OF[dim](sreq)
            c = classes.get(name)
            if c is None:
                c = classes[name] = _Class()
            out.append(c)
        return out

    # ---- feeds -----------------------------------------------------------------------------------------

    def arrived(self, sreq) -> None:
        self.num_arrived += 1
        if self._by:
            for c in self._classes(sreq):
                c.arrived += 1

    def admitted(self, record) -> None:
        pass

    def first_token(self, ttft: float) -> None:
        self._tick_ttft.append(ttft)

    def finished(self, rec) -> None:
        if rec.rejected is not None:
            self.rejected.append(rec.rejected)
            if self._by:
                for c in self._classes(rec.request):
                    c.rejected += 1
            return
        req = rec.request
        ttft = rec.first_token - req.arrival
        n_out = rec.num_emitted  # what the replica produced (a length limit may end it early)
        tpot = (rec.last_token - rec.first_token) / (n_out - 1) if n_out > 1 else 0.0
        self.ttft.append(ttft)
        self.tpot.append(tpot)
        self.e2e.append(rec.last_token - req.arrival)
        self.queue.append(rec.first_scheduled - req.arrival)
        self.ttft_parts.add(rec)
        slo = self.config.slo
        self.good += ttft <= slo.ttft_s and tpot <= slo.tpot_s
        self.num_finished += 1
        self.prompt_tokens += len(req.prompt)
        self.cached_tokens += rec.num_cached_tokens
        self.output_tokens += n_out
        self.cut_short += n_out < len(req.output)
        self.preempted_requests += rec.num_preemptions > 0
        if self._adapters and req.adapter is not None:
            pods = self.adapter_pods[req.adapter]
            pods[rec.replica] = pods.get(rec.replica, 0) + 1
            self.adapter_wait.append(rec.adapter_wait)
        if self._by:
            good = ttft <= slo.ttft_s and tpot <= slo.tpot_s
            for c in self._classes(req):
                c.finished += 1
                c.good += good
                c.ttft.append(ttft)
                c.tpot.append(tpot)
                c.e2e.append(rec.last_token - req.arrival)
                c.ttft_parts.add(rec)
                c.output_tokens += n_out
                c.preempted += rec.num_preemptions > 0
                c.preemptions += rec.num_preemptions

    def tick(self, t: float, waiting: int, running: int, kv: float, ready: int, replicas: int) -> None:
        tl = self.timeline
        tl["t"].append(_r(t))
        tl["waiting"].append(waiting)
        tl["running"].append(running)
        tl["kv_usage"].append(_r(kv))
        tl["ready"].append(ready)
        tl["replicas"].append(replicas)
        tl["ttft_p50"].append(_r(float(np.median(self._tick_ttft))) if self._tick_ttft else 0.0)
        self._tick_ttft = []

    # ---- summary ---------------------------------------------------------------------------------------

    @staticmethod
    def _itl_pcts(pods) -> dict[str, float]:
        bins: dict[int, int] = defaultdict(int)
        for pod in pods:
            for k, n in pod.replica.itl_bins.items():
                bins[k] += n
        count = sum(bins.values())
        if not count:
            return _pcts([])
        keys = sorted(bins)

        def center(k: int) -> float:
            return math.exp((k + 0.5) * _LOG_BIN)

        out = {}
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            rank, seen = q * count, 0
            for k in keys:
                seen += bins[k]
                if seen >= rank:
                    out[name] = _r(center(k))
                    break
        # Mean and max from the bins too: within 0.5% of the exact figures, like the percentiles.
        out["mean"] = _r(sum(n * center(k) for k, n in bins.items()) / count)
        out["max"] = _r(center(keys[-1]))
        return out

    @staticmethod
    def _disaggregation(sim) -> dict | None:
        if sim.handoffs is None:
            return None
        h = sim.handoffs
        return {**h.summary(), "transfer_s": _pcts(h.transfer_seconds)}

    def _lora(self, sim, end: float) -> dict | None:
        if not self._adapters:
            return None
        states = {name: p.replica.adapters for name, p in sim.pods.items() if p.replica.adapters is not None}
        loads = sum(a.loads for a in states.values())
        swaps = sum(a.swaps for a in states.values())
        served = self.adapter_pods
        # The most requested adapter (ties: the first by name), and how many pods served it.
        top = min(served, key=lambda a: (-sum(served[a].values()), a), default=None)
        return {
            "adapter_loads": loads,
            "adapter_swaps": swaps,
            "swaps_per_min": _r(swaps * 60.0 / max(end, 1e-9)),
            "max_held": max((a.max_held for a in states.values()), default=0),
            # Pods' 503 lora_slots_busy, and the requests the router sent to another pod after one.
            "pod_refusals": sum(a.refusals for a in states.values()),
            "retried_elsewhere": sim.adapter_retries,
            "per_replica": {name: {"loads": a.loads, "swaps": a.swaps} for name, a in states.items()},
            "adapters_served": len(served),
            "adapter_wait_s": _pcts(self.adapter_wait),
            "top_adapter": top,
            "top_adapter_requests": sum(served[top].values()) if top is not None else 0,
            "top_adapter_pods": len(served[top]) if top is not None else 0,
            "pods_per_adapter_mean": _r(sum(len(p) for p in served.values()) / len(served))
            if served
            else 0.0,
            # minCopies (lora.min_copies): the pods holding each such adapter at the end, and the share of
            # the operator's ticks after the first that found every minimum held already.
            "min_copies_held": {
                name: sum(name in a.loaded() for a in states.values()) for name in sim.config.lora.min_copies
            },
            "min_copies_met": _r(sim.pin_ticks_met / (sim.pin_ticks - 1)) if sim.pin_ticks > 1 else None,
        }

    def results(self, sim, end: float) -> dict:
        cfg = self.config
        pods = sim.pods
        replica_seconds = sum(p.retired - p.created for p in pods.values())
        gpus_per_replica = cfg.fleet.tp
        gpu_hours = replica_seconds * gpus_per_replica / 3600.0
        price = cfg.fleet.price_per_gpu_hour
        if price is None:
            price = parse_prices(None)[gpu_profile(cfg.fleet.gpu).name] if cfg.fleet.gpu != "cpu" else 0.0
        served = {name: p.replica.num_served for name, p in pods.items()}
        busy = {name: p.replica.busy_seconds / max(p.retired - p.created, 1e-9) for name, p in pods.items()}
        unfinished = self.num_arrived - self.num_finished - len(self.rejected)
        ttft, tpot = _pcts(self.ttft), _pcts(self.tpot)
        met = (
            ttft["p99"] <= cfg.slo.ttft_s
            and tpot["p99"] <= cfg.slo.tpot_s
            and unfinished == 0
            and not self.rejected
        )
        duration = max(end, 1e-9)
        by = {
            f"by_{dim}": {name: c.summary(duration) for name, c in sorted(classes.items())}
            for dim, classes in self._by.items()
        }
        return {
            "config": json.loads(cfg.model_dump_json()),
            "requests": {
                "arrived": self.num_arrived,
                "finished": self.num_finished,
                "rejected": len(self.rejected),
                "unfinished": unfinished,
                "preempted": self.preempted_requests,
                "cut_short": self.cut_short,
            },
            "latency_s": {
                "ttft": ttft,
                "tpot": tpot,
                "itl": self._itl_pcts(pods.values()),
                "e2e": _pcts(self.e2e),
                "queue": _pcts(self.queue),
                **self.ttft_parts.summary(),
            },
            "slo": {
                "ttft_s": cfg.slo.ttft_s,
                "tpot_s": cfg.slo.tpot_s,
                "met": bool(met),
                "goodput_fraction": _r(self.good / self.num_arrived) if self.num_arrived else 0.0,
                "goodput_rps": _r(self.good / duration),
            },
            "throughput": {
                "requests_per_s": _r(self.num_finished / duration),
                "output_tokens_per_s": _r(self.output_tokens / duration),
            },
            "cache": {
                "prefix_hit_rate": _r(self.cached_tokens / self.prompt_tokens) if self.prompt_tokens else 0.0,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
            },
            "load": {
                "served_max": max(served.values(), default=0),
                "served_min": min(served.values(), default=0),
                "busy_fraction_max": _r(max(busy.values(), default=0.0)),
                "busy_fraction_min": _r(min(busy.values(), default=0.0)),
                # What a request arriving mid-step waits for, and what its own step costs.
                "step_s_mean": _r(
                    sum(p.replica.busy_seconds for p in pods.values())
                    / max(sum(p.replica.num_steps for p in pods.values()), 1)
                ),
                "per_replica_served": served,
            },
            "preemptions": sum(p.replica.scheduler.num_preemptions_total for p in pods.values()),
            "routing": dict(sorted(sim.router.decisions.items())),
            "fleet": {
                "cost_model": sim.cost.name,
                "kv_blocks_per_replica": sim.cost.num_kv_blocks(cfg.cache.block_size),
                "replicas_peak": max([cfg.fleet.replicas, *(e[2] for e in sim.scale_events)]),
                "replica_seconds": _r(replica_seconds),
                "gpu_hours": _r(gpu_hours),
                "price_per_gpu_hour": price,
                "cost_usd": _r(gpu_hours * price),
                "scale_events": [[_r(t), a, b, why] for t, a, b, why in sim.scale_events],
            },
            "disaggregation": self._disaggregation(sim),
            "lora": self._lora(sim, end),
            "virtual_seconds": _r(end),
            "engine_steps": sum(p.replica.num_steps for p in pods.values()),
            "timeline": self.timeline,
            **by,
        }


def to_json(results: dict) -> str:
    return json.dumps(results, sort_keys=True, indent=1, allow_nan=False)


def table(results: dict) -> str:
    lat = results["latency_s"]
    rq, slo, fleet = results["requests"], results["slo"], results["fleet"]
    lines = [
        f"{'':12} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}",
    ]
    for key in ("ttft", "tpot", "itl", "e2e", "queue", "router_queue", "pod_queue", "prefill"):
        v = lat[key]
        lines.append(
            f"{key.upper():12} " + " ".join(f"{v.get(p, 0.0):9.4f}" for p in ("p50", "p90", "p99", "mean"))
        )
    lines += [
        "",
        f"requests      {rq['arrived']} arrived, {rq['finished']} finished, {rq['rejected']} rejected, "
        f"{rq['unfinished']} unfinished, {rq['preempted']} preempted ({results['preemptions']} preemptions)",
        f"SLO           TTFT <= {slo['ttft_s']} s, TPOT <= {slo['tpot_s']} s: "
        f"{'MET' if slo['met'] else 'MISSED'} (goodput {slo['goodput_fraction']:.1%}, {slo['goodput_rps']} req/s)",
        f"throughput    {results['throughput']['requests_per_s']} req/s, {results['throughput']['output_tokens_per_s']} output tok/s",
        f"prefix cache  {results['cache']['prefix_hit_rate']:.1%} of prompt tokens hit",
        f"load          served per replica max {results['load']['served_max']} / min {results['load']['served_min']}; "
        f"busy max {results['load']['busy_fraction_max']:.0%} / min {results['load']['busy_fraction_min']:.0%}",
        f"routing       {results['routing']}",
        f"fleet         {fleet['cost_model']}, peak {fleet['replicas_peak']} replicas, {fleet['replica_seconds']:.0f} replica-s, "
        f"{fleet['gpu_hours']:.3f} GPU-h, ${fleet['cost_usd']:.2f} at ${fleet['price_per_gpu_hour']}/GPU-h, "
        f"{len(fleet['scale_events'])} scale events",
        f"simulated     {results['virtual_seconds']} s, {results['engine_steps']} engine steps",
    ]
    dis = results.get("disaggregation")
    if dis:
        lines.insert(
            -1,
            f"KV transfers  {dis['transfers']}: {dis['blocks_sent']} blocks sent ({dis['bytes_sent'] / 1e9:.1f} GB), "
            f"{dis['blocks_already_on_decode_pod']} already on the decode pod; transfer p50 "
            f"{dis['transfer_s']['p50'] * 1000:.1f} ms, p99 {dis['transfer_s']['p99'] * 1000:.1f} ms",
        )
    lora = results.get("lora")
    if lora:
        lines.insert(
            -1,
            f"LoRA          {lora['adapter_loads']} adapter loads, {lora['adapter_swaps']} swaps "
            f"({lora['swaps_per_min']} per min), at most {lora['max_held']} held; {lora['pod_refusals']} "
            f"refused for want of room ({lora['retried_elsewhere']} retried elsewhere); adapter wait p99 "
            f"{lora['adapter_wait_s']['p99'] * 1000:.1f} ms; top adapter on {lora['top_adapter_pods']} pods, "
            f"{lora['pods_per_adapter_mean']} pods per adapter",
        )
    for dim in ("tenant", "priority"):
        for name, c in (results.get(f"by_{dim}") or {}).items():
            q, ttft = c["requests"], c["latency_s"]["ttft"]
            lines.append(
                f"{dim} {name:<{13 - len(dim)}} TTFT p50 {ttft['p50']:.4f} p99 {ttft['p99']:.4f} s; {q['finished']} "
                f"finished, {q['rejected']} rejected, {q['unfinished']} unfinished; goodput {c['goodput_fraction']:.1%}; "
                f"{c['output_tokens_per_s']} output tok/s; {c['preemptions']} preemptions"
            )
    return "\n".join(lines)
