"""Adapter slots on the device, and the hooks that add each step's LoRA deltas to the model's projections.

Every targetable projection of every layer (the fused q/k/v, o, the fused gate/up, down) owns
preallocated stacked weights for `max_loras` slots, so serving an adapter never allocates: loading one is a
copy into a slot. A fused projection keeps its slices' A matrices stacked along the rank, so one shrink
reads x once for q, k and v, and one expand per slice writes its columns of the output:

    h = x @ [A_q; A_k; A_v][slot].T          # [T, 3R], one shrink
    y[:, q cols] += s_q[slot] * h[:, 0:R]  @ B_q[slot].T       # one expand per slice
    y[:, k cols] += s_k[slot] * h[:, R:2R] @ B_k[slot].T ...

Ranks below `max_rank` are zero-padded (zero rows of A, zero columns of B add nothing), and a slice the
adapter does not target stays zero. The deltas are added by forward hooks on the base projections, so the
model's parameters, their names and everything that reads them (checkpoint loading, the weight cache,
sleep mode) stay as they are. A step without any adapter, or a projection no slot in the step targets,
costs one attribute read per projection; a compiled decode step is traced with `batch` None, so its graph
holds no LoRA work at all (steps with adapters run eagerly).

Under tensor parallelism every rank has slots of its own shard's widths and holds its part of each adapter
(lora_adapter.shard_adapter): for a column-parallel projection (q/k/v, gate/up) all of A and its rows of
B; for a row-parallel one (o, down) its columns of A and all of B, whose partial delta the projection's
existing all-reduce adds up with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tokenfleet.kernels.lora import LoRABatch, lora_expand, lora_shrink
from tokenfleet.runtime.model.lora_adapter import LoRAAdapterWeights, projection_shapes
from torch import nn

# Fused projection (the module's attribute name) -> the HF projections it computes, in slice order.
_FUSED_SLICES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(eq=False)
class _Projection:
    layer: int
    names: tuple[str, ...]  # HF projection per slice
    out_sizes: tuple[int, ...]
    rank: int
    a: torch.Tensor  # [S, slices * R, in]
    b: tuple[torch.Tensor, ...]  # per slice [S, out_i, R]
    scale: torch.Tensor  # fp32 [slices, S]
    owner: LoRASlots
    active: set[int] = field(default_factory=set)  # slots whose adapter targets any slice here

    def load(self, slot: int, adapter: LoRAAdapterWeights) -> None:
        r_max = self.rank
        self.a[slot].zero_()
        self.active.discard(slot)
        for i, name in enumerate(self.names):
            b = self.b[i][slot]
            b.zero_()
            self.scale[i, slot] = 0.0
            module = adapter.modules.get((self.layer, name))
            if module is None:
                continue
            r = module.rank
            self.a[slot, i * r_max : i * r_max + r].copy_(module.a, non_blocking=True)
            b[:, :r].copy_(module.b, non_blocking=True)
            self.scale[i, slot] = module.scaling
            self.active.add(slot)

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        """Forward hook: output += the step's LoRA delta (in place)."""
        batch = self.owner.batch
        if batch is None or self.active.isdisjoint(batch.slots):
            return None
        # Unchecked: the stacks are this projection's own, the batch the runner's for this step's tokens.
        h = lora_shrink(args[0], self.a, batch, validate=False)
        r, start = self.rank, 0
        for i, n in enumerate(self.out_sizes):
            lora_expand(
                h[:, i * r : (i + 1) * r],
                self.b[i],
                self.scale[i],
                batch,
                output[:, start : start + n],
                validate=False,
            )
            start += n
        return output


class LoRASlots:
    """`max_loras` device slots on every targetable projection of `model`, hooked into its forward.

    `batch` is the step's token -> slot map (kernels.lora.LoRABatch), set by the model runner around the
    forward of a step that uses adapters and None otherwise (a draft's or proposer's own forward then runs
    the base model).
    """

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device):
        arch = model.arch
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.batch: LoRABatch | None = None
        self.projections: list[_Projection] = []
        self._handles = []
        shapes = projection_shapes(arch)
        for layer_idx, layer in enumerate(model.model.layers):
            for parent in (layer.self_attn, layer.mlp):
                for attr, names in _FUSED_SLICES.items():
                    module = getattr(parent, attr, None)
                    if module is None:
                        continue  # an MoE block: no dense gate/up/down
                    in_features = shapes[names[0]][0]
                    outs = tuple(shapes[n][1] for n in names)
                    proj = _Projection(
                        layer=layer_idx,
                        names=names,
                        out_sizes=outs,
                        rank=max_rank,
                        a=torch.zeros(
                            max_loras, len(names) * max_rank, in_features, dtype=dtype, device=device
                        ),
                        b=tuple(
                            torch.zeros(max_loras, n, max_rank, dtype=dtype, device=device) for n in outs
                        ),
                        scale=torch.zeros(len(names), max_loras, dtype=torch.float32, device=device),
                        owner=self,
                    )
                    self.projections.append(proj)
                    self._handles.append(module.register_forward_hook(proj))

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + sum(b.nbytes for b in p.b) for p in self.projections)

    def load(self, slot: int, adapter: LoRAAdapterWeights) -> None:
        """Copy `adapter` into `slot` (between steps; the previous occupant is overwritten)."""
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot} outside 0..{self.max_loras - 1}")
        for proj in self.projections:
            proj.load(slot, adapter)

    def detach(self) -> None:
        """Remove the hooks: the model computes the base projections only."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
