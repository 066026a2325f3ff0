"""Variants of the decode GEMM (``fp4fuse.kernels.triton.mm_decode``) that were measured and not kept,
each against the shipped launch and cuBLAS bf16 in the same process (results: benchmarks/results/).

    PYTHONPATH=. python benchmarks/bench_decode_variants.py --tma [--json raw.json]
    PYTHONPATH=. python benchmarks/bench_decode_variants.py --occupancy [--json raw.json]

Both time CUDA-graph replays over 4 rotating weight copies (``bench_ops.bench_graph``), microseconds
per call, on random codes and scales (every e4m3 scale in [0.25, 4.25)).

``--tma``: ``_tma_kernel`` below is ``_decode_program`` with every operand read through a host
tensor descriptor (TMA: one thread issues a bulk copy, no per-thread address registers), at 3 to 8
pipeline stages and 256 / 512 K elements a step, M = 16 (activation decoded in the kernel) and
M = 128 (activation pre-decoded). TMA needs 16-byte rows in a box: the scale tile of a 128-element
step is 8 bytes wide, so the pre-decoded variant runs 256-element steps only.

``--occupancy``: the shipped kernel at configurations that fit more programs on a multiprocessor
(fewer stages, a register cap, 64-element steps), split-K filling that many programs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ops import ROTATIONS, bench_graph  # noqa: E402

from fp4fuse.kernels.triton import mm_decode  # noqa: E402
from fp4fuse.kernels.triton.mm_decode import DecodeConfig, filling_split, finish_tile, permuted_planes  # noqa: E402

SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672), (6144, 4096), (4096, 4096), (4096, 14336))


@triton.jit(do_not_specialize=["M", "iters_per_split", "n_split"])
def _tma_kernel(a_desc, as_desc, b_desc, bs_desc, alpha_ptr, out_ptr, part_ptr, count_ptr,
                M, N, KB, iters_per_split, n_split,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PARTIAL: tl.constexpr, PREDECODED: tl.constexpr, STAGES: tl.constexpr):
    """``mm_decode._decode_program`` with descriptor loads (out-of-range rows and columns read
    zeros); the same products in the same order."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = tile % tiles_m
    pid_n = tile // tiles_m
    BKB: tl.constexpr = BLOCK_K // 2
    n0 = pid_n * BLOCK_N
    m0 = pid_m * BLOCK_M
    cols_n = n0 + tl.arange(0, BLOCK_N)
    rows_m = m0 + tl.arange(0, BLOCK_M)
    kb_begin = split * iters_per_split * BKB
    kb_end = tl.minimum(kb_begin + iters_per_split * BKB, KB)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb0 in tl.range(kb_begin, kb_end, BKB, num_stages=STAGES):
        w_lo, w_hi = permuted_planes(b_desc.load([n0, kb0]), bs_desc.load([n0, kb0 // 8]), BLOCK_K, True)
        if PREDECODED:
            x_lo = a_desc.load([m0, kb0])
            x_hi = as_desc.load([m0, kb0])
        else:
            x_lo, x_hi = permuted_planes(a_desc.load([m0, kb0]), as_desc.load([m0, kb0 // 8]), BLOCK_K, True)
        acc = tl.dot(w_lo, tl.trans(x_lo), acc)
        acc = tl.dot(w_hi, tl.trans(x_hi), acc)
    finish_tile(acc, alpha_ptr, alpha_ptr, out_ptr, part_ptr, count_ptr, tile, split, n_split, rows_m, cols_n, M, N,
                PARTIAL, False, False)


def tma_mm(a, sa, b, sb, alpha, cfg: DecodeConfig, workspace: mm_decode.DecodeWorkspace):
    """``mm_fp4_decode(..., config=cfg, workspace=workspace)`` through ``_tma_kernel`` (bf16 out); the
    activation pre-decoded above 64 rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, n, kb = a.shape[0], b.shape[0], b.shape[1]
    bm, bn, bk, bkb = cfg.block_m, cfg.block_n, cfg.block_k, cfg.block_k // 2
    plan = mm_decode._plan(cfg, m, n, 2 * kb)
    predecoded = m > mm_decode.INKERNEL_DECODE_MAX_M
    if predecoded:
        lo, hi = mm_decode.predecode_activation(a, sa, bk)
        a_desc, as_desc = TensorDescriptor.from_tensor(lo, [bm, bkb]), TensorDescriptor.from_tensor(hi, [bm, bkb])
    else:
        a_desc, as_desc = TensorDescriptor.from_tensor(a, [bm, bkb]), TensorDescriptor.from_tensor(sa, [bm, bk // 16])
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    extra = {} if cfg.max_registers is None else {"maxnreg": cfg.max_registers}
    _tma_kernel[(plan.tiles, plan.split)](
        a_desc, as_desc, TensorDescriptor.from_tensor(b, [bn, bkb]), TensorDescriptor.from_tensor(sb, [bn, bk // 16]),
        alpha, out, workspace.partials, workspace.counters, m, n, kb, plan.iters_per_split, plan.split,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PARTIAL=plan.split > 1, PREDECODED=predecoded, STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra)
    return out


def _operands(m: int, n: int, k: int):
    codes = lambda rows: torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, device="cuda")  # noqa: E731
    scales = lambda rows: (torch.rand(rows, k // 16, device="cuda") * 4 + 0.25).to(torch.float8_e4m3fn)  # noqa: E731
    weights = [(codes(n), scales(n)) for _ in range(ROTATIONS)]
    return codes(m), scales(m), weights, torch.full((1,), 0.37, device="cuda")


def _bf16_us(m: int, n: int, k: int) -> float:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(ROTATIONS)]
    return bench_graph([lambda w=w: torch.mm(x, w.t()) for w in ws]) * 1e3


def _shipped_us(a, sa, weights, alpha, cfg) -> float:
    m, n, k = a.shape[0], weights[0][0].shape[0], a.shape[1] * 2
    ws = mm_decode.empty_decode_workspace(*mm_decode.decode_workspace_numel(m, n, k, cfg), a.device)
    return bench_graph([lambda b=b, sb=sb: mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.bfloat16, cfg, ws)
                        for b, sb in weights]) * 1e3


def tma_sweep() -> list[dict]:
    rows = []
    for (n, k), m in itertools.product(SHAPES, (16, 128)):
        a, sa, weights, alpha = _operands(m, n, k)
        cfg = mm_decode.decode_config_for(m, n, k)
        ref = mm_decode.mm_fp4_decode(a, weights[0][0], sa, weights[0][1], alpha, torch.bfloat16)
        row = {"m": m, "n": n, "k": k, "bf16_us": _bf16_us(m, n, k), "shipped_us": _shipped_us(a, sa, weights, alpha, cfg),
               "variants": {}}
        if m <= 16:
            cands = [(16, 64, 256, cfg.split_k, 4, st, rg) for st, rg in ((3, 128), (4, 128), (6, 128), (8, None))]
            cands += [(16, 64, 512, max(1, cfg.split_k // 2), 4, st, None) for st in (3, 4)]
        else:
            cands = [(128, 64, 256, cfg.split_k, 4, 3, None)]
        for bm, bn, bk, split, warps, stages, regs in cands:
            if k % bk:
                continue
            c = DecodeConfig(bm, bn, bk, split, warps, stages, max_registers=regs)
            ws = mm_decode.empty_decode_workspace(*mm_decode.decode_workspace_numel(m, n, k, c), a.device)
            name = f"{bm}x{bn}x{bk} s{split} st{stages}" + (f" r{regs}" if regs else "")
            got = tma_mm(a, sa, *weights[0], alpha, c, ws)
            us = bench_graph([lambda b=b, sb=sb, c=c, ws=ws: tma_mm(a, sa, b, sb, alpha, c, ws) for b, sb in weights]) * 1e3
            row["variants"][name] = {"us": us, "bitwise": bool(torch.equal(got, ref))}
        rows.append(row)
        _print_row(row, cfg)
    return rows


def occupancy_sweep() -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for m, (n, k) in itertools.product((128, 16), SHAPES):
        a, sa, weights, alpha = _operands(m, n, k)
        cfg = mm_decode.decode_config_for(m, n, k, sms)
        row = {"m": m, "n": n, "k": k, "bf16_us": _bf16_us(m, n, k), "shipped_us": _shipped_us(a, sa, weights, alpha, cfg),
               "variants": {}}
        tiles = triton.cdiv(n, 64)
        if m > mm_decode.INKERNEL_DECODE_MAX_M:
            cands = {f"bk{bk} st{st} {per}/SM": DecodeConfig(128, 64, bk, filling_split(tiles, k, sms, per, bk), 4, st,
                                                             predecode=True)
                     for bk, st, per in ((128, 2, 3), (128, 2, 2), (64, 3, 3), (64, 4, 3), (64, 3, 2), (128, 3, 3))}
        else:
            cands = {f"st{st} r{regs} {per}/SM": DecodeConfig(16, 64, 256, filling_split(tiles, k, sms, per, 256), 4, st,
                                                              max_registers=regs, scale_words=True)
                     for st, regs, per in ((2, 128, 5), (2, 96, 6), (3, 96, 5), (3, 104, 5), (2, 80, 8), (3, 128, 6))}
        for name, c in cands.items():
            row["variants"][f"{name} s{c.split_k}"] = {"us": _shipped_us(a, sa, weights, alpha, c)}
        rows.append(row)
        _print_row(row, cfg)
    return rows


def _print_row(row: dict, cfg: DecodeConfig) -> None:
    variants = " | ".join(f"{name}: {v['us']:.1f}" + ("" if v.get("bitwise", True) else " (other bits)")
                          for name, v in row["variants"].items())
    print(f"M={row['m']} N={row['n']} K={row['k']} bf16 {row['bf16_us']:.1f} | shipped "
          f"[{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.split_k}] {row['shipped_us']:.1f} | {variants}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tma", action="store_true", help="descriptor (TMA) loads and deeper pipelines")
    p.add_argument("--occupancy", action="store_true", help="configurations fitting more programs per SM")
    p.add_argument("--json", help="raw results as JSON")
    args = p.parse_args()
    torch.manual_seed(0)
    raw = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    print(raw, flush=True)
    if args.tma:
        raw["tma"] = tma_sweep()
    if args.occupancy:
        raw["occupancy"] = occupancy_sweep()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
