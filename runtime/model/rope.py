"""Rotary position embeddings: inverse frequencies per scaling type and a precomputed cos/sin cache.

Non-interleaved ("rotate half") layout, as in HF checkpoints. GGUF files store Q/K rows permuted for GGML's
interleaved RoPE; the GGUF loader undoes that so one implementation serves both sources.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.arch import RopeScaling
from torch import nn


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _linear(
    inv_freq: torch.Tensor, s: RopeScaling, head_dim: int, theta: float
) -> tuple[torch.Tensor, float]:
    return inv_freq / s.factor, 1.0


def _llama3(
    inv_freq: torch.Tensor, s: RopeScaling, head_dim: int, theta: float
) -> tuple[torch.Tensor, float]:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    original = s.original_max_position_embeddings or 8192
    low_freq_wavelen = original / s.low_freq_factor
    high_freq_wavelen = original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled), 1.0


def _yarn(inv_freq: torch.Tensor, s: RopeScaling, head_dim: int, theta: float) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate low frequencies, extrapolate high ones, linear ramp between the dims that complete
    # beta_fast and beta_slow rotations over the original context; temperature-correct the attention.
    original = s.original_max_position_embeddings or 4096

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (inv_freq / s.factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
    return inv_freq, float(attention_factor)


def _longrope(
    inv_freq: torch.Tensor, s: RopeScaling, head_dim: int, theta: float
) -> tuple[torch.Tensor, float]:
    # Phi-3 within its original context: each frequency divided by its short factor; cos/sin scaled by
    # sqrt(1 + ln(factor) / ln(original)) (HF's default), factor being the whole extension ratio.
    if len(s.short_factor) != head_dim // 2:
        raise ConfigError(
            f"longrope short_factor has {len(s.short_factor)} entries, expected {head_dim // 2}"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (torch.tensor(s.short_factor, dtype=torch.float32) * theta**exponents)
    attention_factor = s.attention_factor
    if attention_factor is None:
        original = s.original_max_position_embeddings or 4096
        attention_factor = math.sqrt(1 + math.log(s.factor) / math.log(original)) if s.factor > 1 else 1.0
    return inv_freq, float(attention_factor)


ScalingFn = Callable[[torch.Tensor, RopeScaling, int, float], tuple[torch.Tensor, float]]
ROPE_SCALINGS: dict[str, ScalingFn] = {
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], factor applied to cos and sin)."""
    inv_freq = default_inv_freq(head_dim, theta)
    if scaling is None:
        return inv_freq, 1.0
    return ROPE_SCALINGS[scaling.rope_type](inv_freq, scaling, head_dim, theta)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hkv, D] by gathering cached cos/sin rows at `positions`."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer(
            "cos", torch.empty(max_positions, head_dim, dtype=torch.float32), persistent=False
        )
        self.register_buffer(
            "sin", torch.empty(max_positions, head_dim, dtype=torch.float32), persistent=False
        )
        if self.cos.device.type != "meta":
            self.build_tables()

    @torch.no_grad()
    def build_tables(self) -> None:
        """Fill the cos/sin tables in place (after `to_empty` when the model was built on the meta device)."""
        # Computed on the CPU in fp32 whatever the model dtype (angles at position 8k need the mantissa),
        # so every device gets bit-identical tables.
        inv_freq, attention_factor = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos.copy_(emb.cos() * attention_factor)
        self.sin.copy_(emb.sin() * attention_factor)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
