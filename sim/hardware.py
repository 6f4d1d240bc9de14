"""Accelerator profiles from public datasheets, the efficiency factors the roofline applies, and prices.

Peak figures are the vendors' dense (no sparsity) numbers for the SXM / PCIe parts named. What a real
kernel reaches is a fraction of them; those fractions are the named `Efficiency` parameters rather than
constants hidden in formulas, so a profile can be refitted against measurements without code changes.

Prices are illustrative on-demand USD per GPU-hour (override them with `--price GPU=USD`); the planner
ranks by them, so the ranking is only as good as the table you give it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.sim.errors import SimInputError

GB = 1e9
TB = 1e12
TFLOPS = 1e12


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Achievable fractions of peak, and fixed costs, of a serving step."""

    memory: float = 0.80  # fraction of HBM bandwidth a decode step's weight + KV reads reach
    compute: float = 0.55  # fraction of peak FLOP/s a prefill's GEMMs and attention reach
    interconnect: float = 0.70  # fraction of link bandwidth an all-reduce reaches
    step_overhead_s: float = 0.0025  # scheduler, launch and sampling overhead per step (CUDA graphs on)
    allreduce_latency_s: float = 8e-6  # per all-reduce call (two per layer with tensor parallelism)
    activation_reserve_bytes: float = 2 * GB  # per GPU: activations, CUDA context, fragmentation


@dataclass(frozen=True, slots=True)
class GPUProfile:
    name: str
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float | None  # dense FLOP/s; None: no FP8 tensor cores (FP8 weights are upcast)
    link_bandwidth: float  # bytes/s per GPU for collectives (NVLink, else PCIe)
    price_per_hour: float  # USD per GPU-hour
    max_tp: int = 8


GPUS: dict[str, GPUProfile] = {
    p.name: p
    for p in (
        # H100 SXM5 80 GB: 3.35 TB/s HBM3, 989 TFLOPS bf16 / 1979 fp8 dense, NVLink 4 900 GB/s.
        GPUProfile("h100-sxm", 80 * GB, 3.35 * TB, 989 * TFLOPS, 1979 * TFLOPS, 900 * GB, 3.00),
        # H200 SXM 141 GB: 4.8 TB/s HBM3e, same tensor cores as H100 SXM.
        GPUProfile("h200", 141 * GB, 4.8 * TB, 989 * TFLOPS, 1979 * TFLOPS, 900 * GB, 3.80),
        # A100 SXM 80 GB: 2.039 TB/s HBM2e, 312 TFLOPS bf16 dense, no fp8, NVLink 3 600 GB/s.
        GPUProfile("a100-80gb", 80 * GB, 2.039 * TB, 312 * TFLOPS, None, 600 * GB, 1.80),
        # L4 24 GB: 300 GB/s GDDR6, 121 TFLOPS bf16 / 242 fp8 dense, PCIe Gen4 x16 (~32 GB/s each way).
        GPUProfile("l4", 24 * GB, 300 * GB, 121 * TFLOPS, 242 * TFLOPS, 32 * GB, 0.80, max_tp=4),
    )
}

ALIASES = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "a100": "a100-80gb", "h200-sxm": "h200"}


def gpu_profile(name: str, field: str = "gpu") -> GPUProfile:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise SimInputError(field, f"unknown GPU {name!r}", [*GPUS, "cpu"])
    return GPUS[key]


def parse_prices(items: list[str] | None) -> dict[str, float]:
    """`GPU=USD` overrides -> {gpu name: USD per GPU-hour}."""
    prices = {name: p.price_per_hour for name, p in GPUS.items()}
    prices["cpu"] = 0.0
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep:
            raise SimInputError("price", f"expected GPU=USD, got {item!r}")
        key = "cpu" if name.lower() == "cpu" else gpu_profile(name, "price").name
        try:
            prices[key] = float(value)
        except ValueError:
            raise SimInputError("price", f"not a number: {value!r}") from None
        if prices[key] < 0:
            raise SimInputError("price", f"must be >= 0, got {value}")
    return prices
