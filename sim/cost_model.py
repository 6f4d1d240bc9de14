"""How long one engine step takes, from what the real scheduler put in it.

A step is summarised as a `BatchShape` (tokens fed, sequences, sampled positions, attention work, KV read).
Two models answer `step_seconds(shape)`, chosen from a registry:

- `roofline` (GPUs): max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth) + all-reduces + a fixed
  step overhead. FLOPs = 2 x active params x tokens (LM head only for sampled positions) + attention
  (4 x layers x q-heads x head_dim x each new token's context). Bytes = the weights read once per step (for
  MoE only the experts the step's tokens touch: E x (1 - (1 - k/E)^tokens) per layer) + every sequence's
  KV context + the new KV written. Tensor parallelism divides FLOPs, bytes and the KV pool by TP and adds
  two ring all-reduces of the step's activations per layer.
- `linear` (the calibrated `cpu` profile): a least-squares fit of the real engine's step times on this
  machine against the same shape features (calibrate.py).

A step whose batch runs LoRA adapters lasts longer by `LoRAStepCost`: a fraction of the base step for the
LoRA kernels (a fixed part, and a part per distinct adapter in the batch). It applies to either model.

`num_kv_blocks(block_size)` sizes the KV cache as the engine would: what the memory budget leaves after the
weights and an activation reserve.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from operator import itemgetter, mul
from pathlib import Path
from typing import Protocol

from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.hardware import Efficiency, GPUProfile
from tokenfleet.sim.model_profile import ModelProfile

DEFAULT_EFFICIENCY = Efficiency()
_token_ids, _start_pos, _sample = itemgetter(1), itemgetter(2), itemgetter(4)


@dataclass(frozen=True, slots=True)
class BatchShape:
    num_tokens: int  # tokens fed (prompt chunks + decodes + speculative proposals)
    num_seqs: int
    num_samples: int  # positions that produce logits
    attn_work: float  # sum over new tokens of their context length (tokens x tokens)
    kv_read_tokens: int  # sum over sequences of the context read (cached + new)


def batch_shape(output) -> BatchShape:
    """From a `SchedulerOutput`: its plain decodes (`decodes`, columns: one token each, sampled) and its other
    entries (`others` tuples: id, token_ids, start_pos, block_ids, sample, spec_ids).

    Runs once per simulated step over every scheduled request, so it is written as C-level passes (map,
    sum) rather than a Python loop per request: sum over requests of q x (start + (q + 1) / 2) for q new
    tokens = sum(q x start) + (sum(q^2) + sum(q)) / 2, and a plain decode (q = 1) needs neither product.
    """
    decodes, others = output.decodes, output.others
    num_decodes = len(decodes)
    decode_start = sum(decodes.start_pos)
    num_tokens = output.num_batched_tokens - num_decodes  # the others' token ids + speculative proposals
    qs = list(map(len, map(_token_ids, others)))
    starts = list(map(_start_pos, others))
    sum_q, sum_start = sum(qs), sum(starts)
    if sum_q != num_tokens:  # speculative proposals ride along: count them per request
        qs = [len(e[1]) + len(e[5]) for e in others]
        sum_q = sum(qs)
    if sum_q == len(qs):  # every other entry gets one token too
        attn = sum_start + sum_q
    else:
        attn = sum(map(mul, qs, starts)) + (sum(map(mul, qs, qs)) + sum_q) / 2
    return BatchShape(
        num_decodes + sum_q,
        num_decodes + len(qs),
        num_decodes + sum(map(_sample, others)),
        decode_start + num_decodes + attn,
        decode_start + num_decodes + sum_start + sum_q,
    )


class CostModel(Protocol):
    name: str
    # What serving adds to every request outside the engine's steps (HTTP, validation, the router and
    # pod hops, the engine loop picking it up, the first event's way back): a request reaches its
    # replica this long after it arrived.
    request_overhead_s: float

    def step_seconds(self, shape: BatchShape) -> float: ...

    def num_kv_blocks(self, block_size: int) -> int: ...


@dataclass(frozen=True, slots=True)
class RooflineCost:
    gpu: GPUProfile
    model: ModelProfile
    tp: int = 1
    efficiency: Efficiency = DEFAULT_EFFICIENCY
    gpu_memory_utilization: float = 0.9
    request_overhead_s: float = 0.0  # a GPU fleet's network and HTTP hops are small against its SLOs
    # Per-step constants, derived once (a simulated hour is millions of steps).
    _k: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        m, g, e, tp = self.model, self.gpu, self.efficiency, self.tp
        per_layer_dense = m.attn_params_per_layer
        lm_head = m.vocab_size * m.hidden_size
        fp8 = m.weight_bytes_per_param <= 1.0 and g.fp8_flops is not None
        flops_per_s = (g.fp8_flops if fp8 else g.bf16_flops) * e.compute * tp
        bytes_per_s = g.hbm_bandwidth * e.memory * tp
        dense_weight_bytes = (m.num_layers * per_layer_dense + lm_head) * m.weight_bytes_per_param
        # MoE: the experts read depend on the step's tokens (step_seconds adds them).
        mlp_bytes = 0.0 if m.num_experts else m.num_layers * m.mlp_params_per_layer * m.weight_bytes_per_param
        ring = 2.0 * (tp - 1) / tp * m.hidden_size * 2.0 / (g.link_bandwidth * e.interconnect)  # per token
        k = (
            2.0 * m.num_layers * (per_layer_dense + m.active_mlp_params_per_layer) / flops_per_s,  # per token
            2.0 * lm_head / flops_per_s,  # per sampled position
            4.0 * m.num_layers * m.num_heads * m.head_dim / flops_per_s,  # per unit of attention work
            (dense_weight_bytes + mlp_bytes) / bytes_per_s,
            m.kv_bytes_per_token / bytes_per_s,
            2 * m.num_layers * ring if tp > 1 else 0.0,  # all-reduces per token
            2 * m.num_layers * e.allreduce_latency_s if tp > 1 else 0.0,
            e.step_overhead_s,
            bytes_per_s,
        )
        object.__setattr__(self, "_k", k)

    @property
    def name(self) -> str:
        return f"{self.gpu.name} tp{self.tp}"

    def step_seconds(self, shape: BatchShape) -> float:
        if shape.num_seqs == 0:
            return 0.0
        per_token, per_sample, per_attn, weights_s, per_kv, comm_token, comm_fixed, overhead, bw = self._k
        n = shape.num_tokens
        t_compute = per_token * n + per_sample * shape.num_samples + per_attn * shape.attn_work
        t_memory = weights_s + per_kv * (shape.kv_read_tokens + n)
        m = self.model
        if m.num_experts:
            touched = m.num_experts * (1.0 - (1.0 - m.experts_per_token / m.num_experts) ** n)
            mlp_read = m.num_layers * (touched * m.expert_params + m.hidden_size * m.num_experts)
            t_memory += mlp_read * m.weight_bytes_per_param / bw
        t_comm = comm_token * n + comm_fixed
        return max(t_compute, t_memory) + t_comm + overhead

    def num_kv_blocks(self, block_size: int) -> int:
        m, g = self.model, self.gpu
        budget = g.memory_bytes * self.gpu_memory_utilization - self.efficiency.activation_reserve_bytes
        free = budget * self.tp - m.weight_bytes
        return max(0, int(free // (block_size * m.kv_bytes_per_token)))


@dataclass(frozen=True, slots=True)
class LoRAStepCost:
    """A step with adapters lasts (1 + fixed + per_adapter x distinct adapters) times its base cost.

    An assumption, not a fit: the batched LoRA kernels (segmented SGMV for prefill runs, gathered BGMV for
    decode: two launches per hooked projection, `kernels/lora.py`) read each distinct adapter's A and B
    once per step and add two thin matmuls per projection, a small fraction of the base model's weights
    and FLOPs; on a GPU the launches and gathers cost a few percent of a decode step, and more adapters
    (more weights to read, longer gathers) add to it. The defaults (3 % + 1 % per adapter: 11 % at 8
    distinct adapters) sit in that range for rank-16 adapters on an 8B model; `lora.step_overhead` and
    `lora.step_overhead_per_adapter` set them. A step with adapters also runs eagerly (compiled decode
    serves only steps without them); that is left inside the fixed part."""

    fixed: float = 0.03
    per_adapter: float = 0.01

    def factor(self, num_adapters: int) -> float:
        return 1.0 + self.fixed + self.per_adapter * num_adapters if num_adapters else 1.0


@dataclass(frozen=True, slots=True)
class CoreUsage:
    """How many of the host's cores one engine effectively keeps busy, from the measured slowdown of two
    engines computing at once (calibrate.py): with several engines on one host, steps stretch once their
    demand exceeds the cores."""

    host_cores: int
    prefill: float  # while a step holds prompt tokens
    decode: float  # while every sequence decodes

    def of(self, shape: BatchShape) -> float:
        return self.decode if shape.num_tokens == shape.num_seqs else self.prefill


@dataclass(frozen=True, slots=True)
class LinearCost:
    """step = base + per_token x tokens + per_seq x seqs + per_sample x samples + per_attn x attention work
    + per_kv_read x context read (the cached KV a step gathers: what a prefix hit still costs).

    `request_overhead_s`: fitted only from timings taken through a served pod (a client's time to first
    token is overhead + one prefill step; its later gaps are steps alone).

    `small_batch_extra_s[n]`: what a step of exactly n tokens costs beyond the linear terms, for the few
    smallest n calibrated apart. On a CPU the BLAS multiplies one row by the weights as a matrix-vector
    product and two or three rows about one row at a time, and only from four rows on packs a matrix
    product: measured on 2 cores with the default model's projections, 18.7 / 35.3 / 51.0 / 43.4 ms of
    linear layers per step at 1 / 2 / 3 / 4 rows. A step of two or three decodes thus costs nearly twice or
    three times one, which no line in tokens follows, and a fit without it made one pod serving a few
    streams at a time 40-50 % faster in the simulator than for real."""

    base_s: float
    per_token_s: float
    per_seq_s: float
    per_sample_s: float
    per_attn_s: float
    kv_cache_bytes: float
    model: ModelProfile
    name: str = "cpu"
    request_overhead_s: float = 0.0
    cores: CoreUsage | None = None  # measured by a served calibration
    per_kv_read_s: float = 0.0
    small_batch_extra_s: tuple[float, ...] = ()  # indexed by the step's tokens; () or shorter: none

    def step_seconds(self, shape: BatchShape) -> float:
        if shape.num_seqs == 0:
            return 0.0
        t = (
            self.base_s
            + self.per_token_s * shape.num_tokens
            + self.per_seq_s * shape.num_seqs
            + self.per_sample_s * shape.num_samples
            + self.per_attn_s * shape.attn_work
            + self.per_kv_read_s * shape.kv_read_tokens
        )
        extra = self.small_batch_extra_s
        if shape.num_tokens < len(extra):
            t += extra[shape.num_tokens]
        return max(t, self.base_s)

    def num_kv_blocks(self, block_size: int) -> int:
        return max(0, int(self.kv_cache_bytes // (block_size * self.model.kv_bytes_per_token)))

    def to_json(self) -> str:
        data = asdict(self)
        data["model"] = self.model.name  # asdict made `cores` a plain dict
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def load(cls, path: Path, model: ModelProfile) -> LinearCost:
        try:
            data = json.loads(Path(path).read_text())
            data["model"] = model
            if data.get("cores") is not None:
                data["cores"] = CoreUsage(**data["cores"])
            data["small_batch_extra_s"] = tuple(data.get("small_batch_extra_s", ()))
            return cls(**data)
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise SimInputError(
                "cpu_profile", f"cannot load {path}: {e}", "a file written by `tokenfleet simulate calibrate`"
            ) from e
