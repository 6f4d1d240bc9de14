"""The kernel benchmark's harness: roofline references, the section registry, timing, the table and files.

Every kernel section (bench/kernels.py: attention; bench/kernels_fp8_moe.py: FP8 GEMM and fused MoE)
registers with `@section(name)`, takes the run's `BenchContext` and returns `Row`s; `run()` measures the
roofline references once, runs the chosen sections, prints one table and writes one JSON + CSV. The
registry lives here, not in the script that is run, so a section module imports the harness and never the
entry script (which, run as `__main__`, would be a second copy with a second registry).

Roofline references, measured first on the same device and in the same process: copy bandwidth (a large
device-to-device copy, bytes read + written) and the bf16 matmul peak (torch.matmul of 8192^3). Memory-bound
rows report GB/s as a fraction of the first, compute-bound rows TFLOP/s as a fraction of the second.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class BenchContext:
    device: torch.device
    dtype: torch.dtype
    quick: bool
    copy_gbps: float  # measured device copy bandwidth (read + write bytes per second)
    matmul_tflops: float  # measured bf16 dense matmul peak
    deadline: float  # time.monotonic() after which sections stop adding rows

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline


@dataclass(frozen=True, slots=True)
class Row:
    section: str
    case: str
    params: dict = field(default_factory=dict)
    ms: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    frac_of_peak: float | None = None  # of copy_gbps (memory-bound rows) or matmul_tflops (compute-bound)
    peer_ms: float | None = None
    peer_frac_of_peak: float | None = None
    note: str = ""


Section = Callable[[BenchContext], list[Row]]
SECTIONS: dict[str, Section] = {}


def section(name: str) -> Callable[[Section], Section]:
    def register(fn: Section) -> Section:
        SECTIONS[name] = fn
        return fn

    return register


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of `fn` (Triton's do_bench: warm-up, L2 flush between runs, CUDA events)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of a kernel's output against its reference, in fp32."""
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def measure_copy_gbps(device: torch.device) -> float:
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device=device).random_()  # 512 MiB: far beyond L2
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: torch.matmul(a, b))
    return 2 * n**3 / ms / 1e9


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Row]) -> None:
    print(
        f"{'section':<14}{'case':<30}{'ms':>9}{'GB/s':>9}{'TFLOP/s':>9}{'of peak':>9}{'peer ms':>9}{'peer pk':>9}  note"
    )
    for r in rows:
        print(
            f"{r.section:<14}{r.case:<30}{_fmt(r.ms, '.3f'):>9}{_fmt(r.gbps, '.0f'):>9}{_fmt(r.tflops, '.1f'):>9}"
            f"{_fmt(r.frac_of_peak, '.1%'):>9}{_fmt(r.peer_ms, '.3f'):>9}{_fmt(r.peer_frac_of_peak, '.1%'):>9}  {r.note}"
        )


def write_results(out_dir: Path, ctx: BenchContext, rows: list[Row]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "device": torch.cuda.get_device_name(ctx.device),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_gbps": ctx.copy_gbps,
        "bf16_matmul_tflops": ctx.matmul_tflops,
    }
    (out_dir / "kernels_bench.json").write_text(
        json.dumps({**header, "rows": [asdict(r) for r in rows]}, indent=1)
    )
    names = [f.name for f in fields(Row) if f.name != "params"]
    with (out_dir / "kernels_bench.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*names, "params"])
        for r in rows:
            writer.writerow([getattr(r, n) for n in names] + [json.dumps(r.params)])


def run(description: str, argv: list[str] | None = None) -> int:
    """The command line of bench/kernels.py over every registered section."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a few shapes per section (about a minute)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {sorted(SECTIONS)}")
    parser.add_argument("--out", type=Path, help="directory for kernels_bench.json / .csv")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds; later rows are marked skipped")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench/kernels.py needs a CUDA GPU and none is visible (torch.cuda.is_available() is False). "
            "On CPU the kernels' correctness is covered by tests/kernels under TRITON_INTERPRET=1.",
            file=sys.stderr,
        )
        return 2
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {sorted(SECTIONS)}")
    start = time.monotonic()
    device = torch.device("cuda")
    copy_gbps = measure_copy_gbps(device)
    matmul_tflops = measure_matmul_tflops(device, torch.bfloat16)
    print(
        f"{torch.cuda.get_device_name(device)}: copy {copy_gbps:.0f} GB/s, bf16 matmul {matmul_tflops:.0f} TFLOP/s"
    )
    ctx = BenchContext(device, torch.bfloat16, args.quick, copy_gbps, matmul_tflops, start + args.budget)
    rows: list[Row] = []
    for name in args.sections.split(","):
        rows += SECTIONS[name](ctx)
        torch.cuda.empty_cache()
    print_table(rows)
    if args.out:
        write_results(args.out, ctx, rows)
    return 0
