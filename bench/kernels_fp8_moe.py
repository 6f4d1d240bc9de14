"""FP8 GEMM and fused-MoE sections of the kernel benchmark (run them with bench/kernels.py).

fp8_gemm: the Triton FP8 GEMM in each scaling mode against the peers on the same shapes: torch bf16
matmul (`peer_ms`, the 1.6x target is ms_bf16 / ms_fp8) and `torch._scaled_mm` (per-tensor and
row-wise, in the note). Every row also checks the kernel against the torch reference on that device
(bf16 output included, which the CPU interpreter cannot check) and notes the relative error.
moe: fused_moe on the Triton path against the torch reference path (loop over experts), for Mixtral-
and OLMoE-like expert shapes, fp16/bf16 and FP8 experts.
"""

from __future__ import annotations

import torch
from kernel_harness import BenchContext, Row, rel_err, section, time_ms

LLAMA_8B_LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# (experts, top_k, hidden, intermediate): Mixtral-8x7B and OLMoE-1B-7B / Qwen-MoE-like layers.
MOE_LAYERS = {"mixtral": (8, 2, 4096, 14336), "olmoe": (64, 8, 2048, 1024)}


def _scaled_mm_ms(a_q, a_scale, w_q, w_scale) -> tuple[float | None, float | None]:
    """torch._scaled_mm per-tensor and row-wise (None where this torch/GPU does not support it)."""
    out = []
    for sa, sb in ((a_scale[:1, :1], w_scale[:1, :1]), (a_scale, w_scale.t())):
        try:
            sa_, sb_ = sa.contiguous(), sb.contiguous()
            fn = lambda: torch._scaled_mm(a_q, w_q.t(), scale_a=sa_, scale_b=sb_, out_dtype=torch.bfloat16)  # noqa: B023, E731
            fn()
            out.append(time_ms(fn))
        except (RuntimeError, TypeError):
            out.append(None)
    return out[0], out[1]


def fp8_gemm_rows(ctx: BenchContext, shapes: list[tuple[str, int, int, int]]) -> list[Row]:
    from tokenfleet.kernels.fp8_gemm import ACTIVATION_MODE, SCALINGS, fp8_gemm, fp8_gemm_ref
    from tokenfleet.kernels.fp8_quant import quantize_activation_fp8, quantize_weight_fp8

    rows = []
    for name, m, n, k in shapes:
        params = {"m": m, "n": n, "k": k}
        case = f"{name} M{m} N{n} K{k}"
        if ctx.out_of_time():
            rows.append(Row("fp8_gemm", case, params, note="skipped"))
            continue
        x = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=ctx.device, dtype=torch.bfloat16) / k**0.5
        bf16_ms = time_ms(lambda: torch.matmul(x, w.t()))  # noqa: B023
        flops = 2.0 * m * n * k
        for scaling in SCALINGS:
            w_q, w_scale = quantize_weight_fp8(w, scaling)
            a_q, a_scale = quantize_activation_fp8(x, ACTIVATION_MODE[scaling])
            out = fp8_gemm(a_q, a_scale, w_q, w_scale, scaling, out_dtype=torch.bfloat16)
            err = rel_err(out, fp8_gemm_ref(a_q, a_scale, w_q, w_scale, scaling, out_dtype=torch.float32))
            ms = time_ms(lambda: fp8_gemm(a_q, a_scale, w_q, w_scale, scaling, out_dtype=torch.bfloat16))  # noqa: B023
            quant_ms = time_ms(lambda: quantize_activation_fp8(x, ACTIVATION_MODE[scaling]))  # noqa: B023
            note = f"x{bf16_ms / ms:.2f} vs bf16; act-quant {quant_ms:.3f} ms; rel err vs ref {err:.1e}"
            if scaling == "per_channel":
                pt_ms, rw_ms = _scaled_mm_ms(a_q, a_scale, w_q, w_scale)
                note += "; _scaled_mm " + ", ".join(
                    f"{label} {v:.3f} ms" if v is not None else f"{label} n/a"
                    for label, v in (("tensor", pt_ms), ("rowwise", rw_ms))
                )
            tflops = flops / ms / 1e9
            rows.append(
                Row(
                    "fp8_gemm", f"{case} {scaling}", params | {"scaling": scaling}, ms=ms, tflops=tflops,
                    frac_of_peak=tflops / ctx.matmul_tflops, peer_ms=bf16_ms,
                    peer_frac_of_peak=flops / bf16_ms / 1e9 / ctx.matmul_tflops, note=note,
                )
            )  # fmt: skip
    return rows


@section("fp8_gemm")
def bench_fp8_gemm(ctx: BenchContext) -> list[Row]:
    ms = (1, 128, 4096) if ctx.quick else (1, 16, 64, 128, 512, 1024, 4096, 8192)
    linears = ("o", "gate_up") if ctx.quick else tuple(LLAMA_8B_LINEARS)
    shapes = [(lin, m, *LLAMA_8B_LINEARS[lin]) for lin in linears for m in ms]
    shapes.append(("square", 8192, 8192, 8192))
    return fp8_gemm_rows(ctx, shapes)


def moe_rows(ctx: BenchContext, cases: list[tuple[str, int, bool]]) -> list[Row]:
    from tokenfleet.kernels.moe import fused_moe, quantize_experts_fp8

    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float16
    rows = []
    weights: dict[tuple[str, bool], tuple] = {}
    for layer, tokens, fp8 in cases:
        e, top_k, h, inter = MOE_LAYERS[layer]
        params = {"layer": layer, "tokens": tokens, "experts": e, "top_k": top_k, "hidden": h, "inter": inter}
        case = f"{layer} E{e} top{top_k} T{tokens} {'fp8' if fp8 else str(dtype)[6:]}"
        if ctx.out_of_time():
            rows.append(Row("moe", case, params, note="skipped"))
            continue
        if (layer, fp8) not in weights:
            weights.clear()  # one layer's experts at a time: Mixtral's are ~2.8 GB in bf16
            w13 = torch.randn(e, 2 * inter, h, device=ctx.device, dtype=dtype) / h**0.5
            w2 = torch.randn(e, h, inter, device=ctx.device, dtype=dtype) / inter**0.5
            if fp8:
                w13, s13 = quantize_experts_fp8(w13)
                w2, s2 = quantize_experts_fp8(w2)
                weights[(layer, fp8)] = (w13, w2, {"w13_scale": s13, "w2_scale": s2})
            else:
                weights[(layer, fp8)] = (w13, w2, {})
        w13, w2, scales = weights[(layer, fp8)]
        hidden = torch.randn(tokens, h, device=ctx.device, dtype=dtype)
        logits = torch.randn(tokens, e, device=ctx.device, dtype=torch.float32)
        run = lambda backend: fused_moe(hidden, w13, w2, logits, top_k, True, **scales, backend=backend)  # noqa: B023, E731
        err = rel_err(run("triton"), run("torch"))
        ms = time_ms(lambda: run("triton"))  # noqa: B023
        peer_ms = time_ms(lambda: run("torch"))  # noqa: B023
        flops = 2.0 * tokens * top_k * 3 * h * inter
        # Bytes: the weights of the experts actually hit (all of them once tokens * top_k >= E, roughly).
        hit = min(e, tokens * top_k)
        weight_bytes = hit * 3 * h * inter * w13.element_size()
        rows.append(
            Row(
                "moe", case, params | {"fp8": fp8}, ms=ms, tflops=flops / ms / 1e9, gbps=weight_bytes / ms / 1e6,
                frac_of_peak=(weight_bytes / ms / 1e6 / ctx.copy_gbps) if tokens * top_k <= e
                else flops / ms / 1e9 / ctx.matmul_tflops,
                peer_ms=peer_ms, note=f"x{peer_ms / ms:.2f} vs torch loop; rel err vs ref {err:.1e}",
            )
        )  # fmt: skip
    return rows


@section("moe")
def bench_moe(ctx: BenchContext) -> list[Row]:
    tokens = (1, 256, 4096) if ctx.quick else (1, 16, 64, 256, 1024, 4096)
    cases = [(layer, t, False) for layer in MOE_LAYERS for t in tokens]
    cases += [(layer, t, True) for layer in MOE_LAYERS for t in tokens]
    return moe_rows(ctx, cases)
