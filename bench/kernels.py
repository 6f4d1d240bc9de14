"""Kernel benchmark: achieved GB/s and TFLOP/s as fractions of this GPU's peaks, measured in the same run.

    python bench/kernels.py [--quick] [--sections decode,prefill,fp8_gemm,moe] [--out DIR] [--budget SECONDS]

The harness (roofline references, registry, table, files) is bench/kernel_harness.py. This file holds the
attention sections and is the entry point; bench/kernels_fp8_moe.py adds the FP8 GEMM and fused-MoE
sections. Each attention row reports the kernel's time, its achieved GB/s (decode: memory-bound, all K/V
bytes read) or TFLOP/s (prefill: compute-bound, causal FLOPs), the fraction of the measured peak, and the
same figures for the peer: torch's scaled_dot_product_attention over contiguous K/V of the same shapes.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from kernel_harness import BenchContext, Row, run, section, time_ms

LAYOUTS = {"8B": (32, 8, 128), "70B": (64, 8, 128)}  # (q heads, kv heads, head dim) of one attention layer
KV_BUDGET_BYTES = 12 * 2**30  # per tensor set; larger cases are listed as skipped


def _decode_kernel(
    ctx: BenchContext, batch: int, context: int, hq: int, hkv: int, d: int, block_size: int = 16
) -> partial:
    """paged_decode_attention of one new token per sequence over a fresh cache, ready to time; keyword
    arguments added to the partial (block_n, num_splits) override the launcher's defaults."""
    from tokenfleet.kernels.paged_attention import paged_decode_attention

    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, hkv, d, device=ctx.device, dtype=ctx.dtype)
    v_cache = torch.randn_like(k_cache)
    # Shuffled physical blocks: what a serving cache looks like after a while.
    block_tables = torch.randperm(num_blocks, device=ctx.device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=ctx.device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=ctx.device)
    q = torch.randn(batch, hq, d, device=ctx.device, dtype=ctx.dtype)
    return partial(
        paged_decode_attention,
        *(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, d**-0.5),
        max_query_len=1,
        max_seq_len=context,
    )


def _decode_row(ctx: BenchContext, layout: str, batch: int, context: int) -> Row:
    import torch.nn.functional as F

    hq, hkv, d = LAYOUTS[layout]
    params = {"layout": layout, "batch": batch, "context": context, "hq": hq, "hkv": hkv, "d": d}
    case = f"{layout} b{batch} ctx{context}"
    kv_bytes = 2 * batch * context * hkv * d * ctx.dtype.itemsize
    if kv_bytes > KV_BUDGET_BYTES or ctx.out_of_time():
        return Row("decode", case, params, note="skipped")
    kernel = _decode_kernel(ctx, batch, context, hq, hkv, d)
    ms = time_ms(kernel)
    q = kernel.args[0]
    del kernel  # frees the paged cache before the peer's contiguous copy is allocated
    # Peer: SDPA over contiguous K/V [B, Hkv, ctx, D] (GQA through enable_gqa).
    kc = torch.randn(batch, hkv, context, d, device=ctx.device, dtype=ctx.dtype)
    vc = torch.randn_like(kc)
    peer = partial(
        F.scaled_dot_product_attention, q.view(batch, hq, 1, d), kc, vc, scale=d**-0.5, enable_gqa=True
    )
    peer_ms = time_ms(peer)
    gbps = kv_bytes / ms / 1e6
    return Row(
        "decode",
        case,
        params,
        ms=ms,
        gbps=gbps,
        frac_of_peak=gbps / ctx.copy_gbps,
        peer_ms=peer_ms,
        peer_frac_of_peak=kv_bytes / peer_ms / 1e6 / ctx.copy_gbps,
    )


@section("decode")
def bench_decode(ctx: BenchContext) -> list[Row]:
    batches = (1, 32, 128) if ctx.quick else (1, 8, 32, 64, 128, 256)
    contexts = (512, 4096, 32768) if ctx.quick else (512, 2048, 4096, 8192, 32768)
    rows = [_decode_row(ctx, layout, b, c) for layout in LAYOUTS for b in batches for c in contexts]
    torch.cuda.empty_cache()
    return rows + _decode_tile_sweep(ctx)


def _decode_tile_sweep(ctx: BenchContext) -> list[Row]:
    """Key-tile width and split count at the target shape (batch 32, context 4k, 8B layout): tuning data."""
    hq, hkv, d = LAYOUTS["8B"]
    batch, context = 32, 4096
    kernel = _decode_kernel(ctx, batch, context, hq, hkv, d)
    kv_bytes = 2 * batch * context * hkv * d * ctx.dtype.itemsize
    rows = []
    for block_n in (16, 32, 64, 128):
        for num_splits in (1, 2, 4, 8):
            if ctx.out_of_time():
                return rows
            ms = time_ms(partial(kernel, block_n=block_n, num_splits=num_splits))
            gbps = kv_bytes / ms / 1e6
            params = {"batch": batch, "context": context, "block_n": block_n, "num_splits": num_splits}
            rows.append(
                Row(
                    "decode_tiles",
                    f"bn{block_n} splits{num_splits}",
                    params,
                    ms=ms,
                    gbps=gbps,
                    frac_of_peak=gbps / ctx.copy_gbps,
                )
            )
    return rows


def _causal_flops(num_new: int, context: int, hq: int, d: int) -> float:
    """QK^T and PV over the visible keys: query i sees context + i + 1 keys; 2 matmuls x 2 FLOPs/MAC."""
    visible = num_new * context + num_new * (num_new + 1) / 2
    return 4.0 * hq * d * visible


def _prefill_kernel(
    ctx: BenchContext, tokens: int, prefix: int, hq: int, hkv: int, d: int, block_size: int = 16
) -> partial:
    """prefill_attention of `tokens` new tokens after `prefix` cached ones, ready to time; keyword arguments
    added to the partial (tiles, warps, stages) override the launcher's defaults."""
    from tokenfleet.kernels.prefill_attention import prefill_attention

    q = torch.randn(tokens, hq, d, device=ctx.device, dtype=ctx.dtype)
    k = torch.randn(tokens, hkv, d, device=ctx.device, dtype=ctx.dtype)
    v = torch.randn_like(k)
    blocks = max(1, -(-(prefix + tokens) // block_size))
    k_cache = torch.randn(blocks, block_size, hkv, d, device=ctx.device, dtype=ctx.dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(blocks, device=ctx.device).view(1, blocks).int()
    seq_lens = torch.tensor([prefix + tokens], dtype=torch.int32, device=ctx.device)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device=ctx.device)
    return partial(
        prefill_attention,
        *(q, k, v, k_cache, v_cache, block_tables, seq_lens, qsl, d**-0.5),
        max_query_len=tokens,
    )


def _prefill_row(ctx: BenchContext, layout: str, tokens: int, prefix: int) -> Row:
    import torch.nn.functional as F

    hq, hkv, d = LAYOUTS[layout]
    params = {"layout": layout, "tokens": tokens, "prefix": prefix, "hq": hq, "hkv": hkv, "d": d}
    case = f"{layout} {tokens} tok" + (f" +{prefix} cached" if prefix else "")
    if ctx.out_of_time():
        return Row("prefill", case, params, note="skipped")
    kernel = _prefill_kernel(ctx, tokens, prefix, hq, hkv, d)
    ms = time_ms(kernel)
    q = kernel.args[0]
    del kernel
    # Peer: SDPA on contiguous [1, H, L, D]; with a cached prefix the causal mask is shifted by it.
    total = prefix + tokens
    qp = q.transpose(0, 1)[None]
    kp = torch.randn(1, hkv, total, d, device=ctx.device, dtype=ctx.dtype)
    vp = torch.randn_like(kp)
    causal = {"is_causal": True}
    if prefix:
        causal = {"attn_mask": torch.ones(tokens, total, dtype=torch.bool, device=ctx.device).tril(prefix)}
    peer_ms = time_ms(
        partial(F.scaled_dot_product_attention, qp, kp, vp, scale=d**-0.5, enable_gqa=True, **causal)
    )
    flops = _causal_flops(tokens, prefix, hq, d)
    tflops = flops / ms / 1e9
    return Row(
        "prefill",
        case,
        params,
        ms=ms,
        tflops=tflops,
        frac_of_peak=tflops / ctx.matmul_tflops,
        peer_ms=peer_ms,
        peer_frac_of_peak=flops / peer_ms / 1e9 / ctx.matmul_tflops,
    )


@section("prefill")
def bench_prefill(ctx: BenchContext) -> list[Row]:
    sizes = [(512, 0), (4096, 0), (2048, 6144)]
    if not ctx.quick:
        sizes = [(512, 0), (1024, 0), (2048, 0), (4096, 0), (8192, 0), (2048, 6144)]
    rows = [_prefill_row(ctx, layout, tokens, prefix) for layout in LAYOUTS for tokens, prefix in sizes]
    torch.cuda.empty_cache()
    return rows + _prefill_tile_sweep(ctx)


def _prefill_tile_sweep(ctx: BenchContext) -> list[Row]:
    """Tile shapes / warps / stages at the target shape (4k tokens, head dim 128): tuning data."""
    hq, hkv, d = LAYOUTS["8B"]
    tokens = 4096
    kernel = _prefill_kernel(ctx, tokens, 0, hq, hkv, d)
    flops = _causal_flops(tokens, 0, hq, d)
    configs = [
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (128, 64, 4, 3),
        (64, 64, 4, 3),
        (128, 32, 4, 4),
        (128, 64, 8, 2),
    ]
    rows = []
    for block_m, block_n, warps, stages in configs:
        if ctx.out_of_time():
            break
        tiles = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}
        try:
            ms = time_ms(partial(kernel, **tiles))
        except Exception as e:  # e.g. out of shared memory for a config: record it, keep sweeping
            rows.append(
                Row("prefill_tiles", f"{block_m}x{block_n} w{warps} s{stages}", note=f"failed: {e!s:.80}")
            )
            continue
        tflops = flops / ms / 1e9
        rows.append(
            Row(
                "prefill_tiles",
                f"{block_m}x{block_n} w{warps} s{stages}",
                tiles,
                ms=ms,
                tflops=tflops,
                frac_of_peak=tflops / ctx.matmul_tflops,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    import kernels_fp8_moe  # noqa: F401  (registers the fp8_gemm and moe sections, after these two)

    return run(__doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    sys.exit(main())
