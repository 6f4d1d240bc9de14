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

`num_kv_blocks(block_size)` sizes the KV cache as the engine would: what the memory budget leaves after the
weights and an activation reserve.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.hardware import Efficiency, GPUProfile
from tokenfleet.sim.model_profile import ModelProfile

DEFAULT_EFFICIENCY = Efficiency()


@dataclass(frozen=True, slots=True)
class BatchShape:
    num_tokens: int  # tokens fed (prompt chunks + decodes + speculative proposals)
    num_seqs: int
    num_samples: int  # positions that produce logits
    attn_work: float  # sum over new tokens of their context length (tokens x tokens)
    kv_read_tokens: int  # sum over sequences of the context read (cached + new)


def batch_shape(scheduled) -> BatchShape:
    """From `SchedulerOutput.scheduled` (tuples: id, token_ids, start_pos, block_ids, sample, spec_ids)."""
    num_tokens = num_samples = kv = 0
    attn = 0.0
    for _, token_ids, start, _, sample, spec in scheduled:
        q = len(token_ids) + len(spec)
        num_tokens += q
        num_samples += sample
        kv += start + q
        attn += q * (start + (q + 1) * 0.5)
    return BatchShape(num_tokens, len(scheduled), num_samples, attn, kv)


class CostModel(Protocol):
    name: str

    def step_seconds(self, shape: BatchShape) -> float: ...

    def num_kv_blocks(self, block_size: int) -> int: ...


@dataclass(frozen=True, slots=True)
class RooflineCost:
    gpu: GPUProfile
    model: ModelProfile
    tp: int = 1
    efficiency: Efficiency = DEFAULT_EFFICIENCY
    gpu_memory_utilization: float = 0.9

    @property
    def name(self) -> str:
        return f"{self.gpu.name}x{self.tp}"

    def step_seconds(self, shape: BatchShape) -> float:
        if shape.num_seqs == 0:
            return 0.0
        m, g, e, tp = self.model, self.gpu, self.efficiency, self.tp
        per_layer_dense = m.attn_params_per_layer
        lm_head = m.vocab_size * m.hidden_size
        mlp_active = m.active_mlp_params_per_layer
        flops = 2.0 * shape.num_tokens * m.num_layers * (per_layer_dense + mlp_active)
        flops += 2.0 * shape.num_samples * lm_head
        flops += 4.0 * m.num_layers * m.num_heads * m.head_dim * shape.attn_work
        fp8 = m.weight_bytes_per_param <= 1.0 and g.fp8_flops is not None
        peak = g.fp8_flops if fp8 else g.bf16_flops
        t_compute = flops / (peak * e.compute * tp)

        if m.num_experts:
            touched = m.num_experts * (1.0 - (1.0 - m.experts_per_token / m.num_experts) ** shape.num_tokens)
            mlp_read = touched * m.expert_params + m.hidden_size * m.num_experts
        else:
            mlp_read = m.mlp_params_per_layer
        weight_bytes = (m.num_layers * (per_layer_dense + mlp_read) + lm_head) * m.weight_bytes_per_param
        kv_bytes = (shape.kv_read_tokens + shape.num_tokens) * m.kv_bytes_per_token
        t_memory = (weight_bytes + kv_bytes) / (g.hbm_bandwidth * e.memory * tp)

        t_comm = 0.0
        if tp > 1:
            act_bytes = shape.num_tokens * m.hidden_size * 2.0  # bf16 activations
            ring = 2.0 * (tp - 1) / tp * act_bytes / (g.link_bandwidth * e.interconnect)
            t_comm = 2 * m.num_layers * (ring + e.allreduce_latency_s)
        return max(t_compute, t_memory) + t_comm + e.step_overhead_s

    def num_kv_blocks(self, block_size: int) -> int:
        m, g = self.model, self.gpu
        budget = g.memory_bytes * self.gpu_memory_utilization - self.efficiency.activation_reserve_bytes
        free = budget * self.tp - m.weight_bytes
        return max(0, int(free // (block_size * m.kv_bytes_per_token)))


@dataclass(frozen=True, slots=True)
class LinearCost:
    """step = base + per_token x tokens + per_seq x seqs + per_sample x samples + per_attn x attention work."""

    base_s: float
    per_token_s: float
    per_seq_s: float
    per_sample_s: float
    per_attn_s: float
    kv_cache_bytes: float
    model: ModelProfile
    name: str = "cpu"

    def step_seconds(self, shape: BatchShape) -> float:
        if shape.num_seqs == 0:
            return 0.0
        t = (
            self.base_s
            + self.per_token_s * shape.num_tokens
            + self.per_seq_s * shape.num_seqs
            + self.per_sample_s * shape.num_samples
            + self.per_attn_s * shape.attn_work
        )
        return max(t, self.base_s)

    def num_kv_blocks(self, block_size: int) -> int:
        return max(0, int(self.kv_cache_bytes // (block_size * self.model.kv_bytes_per_token)))

    def to_json(self) -> str:
        data = asdict(self)
        data["model"] = self.model.name
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def load(cls, path: Path, model: ModelProfile) -> LinearCost:
        try:
            data = json.loads(Path(path).read_text())
            data["model"] = model
            return cls(**data)
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise SimInputError(
                "cpu_profile", f"cannot load {path}: {e}", "a file written by `tokenfleet simulate calibrate`"
            ) from e
