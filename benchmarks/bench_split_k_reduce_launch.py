"""The decode GEMM's split-K reduction in the GEMM's last program, or in a second launch over all multiprocessors.

    PYTHONPATH=. python benchmarks/bench_split_k_reduce_launch.py [--json raw.json]

With more than one K split, ``fp4fuse.kernels.triton.mm_decode``'s ``finish_tile`` has every program
store its fp32 partial tile and take an arrival; the last program of a tile to arrive reads all the
tile's partials alone and writes the output. At 64 rows a partial tile is 128 x 64 fp32 (32 KiB),
and one program reading 4-12 of them was 15-31% of the call (benchmarks/results/
2026-11-26-split-k-tail-e2e-2xh200.md). Here the same partials are summed by a second launch instead,
``_sum_tiles_kernel``: programs of ``ROWS`` weight rows x the tile's activation rows, over every
multiprocessor, each element summed in split order and scaled by the same epilogue
(``mm_decode._store_output``), so the output must be bitwise the shipped one (checked; the script
stops otherwise).

Columns, CUDA-graph replays over rotating weight copies (``bench_ops``), microseconds, median of
``ROUNDS`` interleaved rounds, one process: ``shipped`` (``decode_config_for``'s configuration, one
launch); ``stores`` (a copy of the module whose ``finish_tile`` only stores the partial: the GEMM
without arrival or reduction, wrong values); ``two-launch/R`` (``stores`` + ``_sum_tiles_kernel`` with
``R`` rows a program); ``two-launch/16 x2 split``: the same with twice the K splits, where K has the
steps (other K ranges, so other bits: not compared); ``bf16`` (cuBLAS). Only products whose shipped configuration splits K.
Results in benchmarks/results/.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

import bench_ops  # benchmarks/, this script's folder
import bench_split_k_tail
from fp4fuse.kernels.triton import decode, mm_decode
from fp4fuse.kernels.triton.alpha import alpha_meta, alpha_operands

SHAPES = ((3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168), (8192, 8192), (8192, 28672))
MS = (16, 32, 64, 96, 128)
ROWS = (8, 16, 32)
ROUNDS = 3

#: ``finish_tile``'s arrival and last-program reduction (``bench_split_k_tail._SHIPPED`` inside),
#: verbatim: what the ``stores`` copy drops.
_ARRIVAL = ('''        # every thread's partial is written before thread 0 releases the arrival
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == n_split - 1:
''' + bench_split_k_tail._SHIPPED + '''            _store_output(total, alpha_ptr, alpha_b_ptr, out_ptr, rows_m, cols_n, M, N,
                          ALPHA_FROM_SCALES, ALPHA_DIV_RN)
            tl.store(count_ptr + tile, 0)
''')


@triton.jit
def _sum_tiles_kernel(part_ptr, alpha_ptr, alpha_b_ptr, out_ptr, M, N, n_split,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                      ALPHA_FROM_SCALES: tl.constexpr, ALPHA_DIV_RN: tl.constexpr):
    """Program ``(tile, row chunk)``: ``ROWS`` weight rows of the tile's partials (the decode GEMM's
    workspace layout ``[tile, split, BLOCK_N, BLOCK_M]``, tiles M-fastest) summed in split order,
    then ``_store_output``."""
    TILE: tl.constexpr = BLOCK_N * BLOCK_M
    tile = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    cols_n = (tile // tiles_m) * BLOCK_N + r
    rows_m = (tile % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_tile = r[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tile_base = part_ptr + tile.to(tl.int64) * n_split * TILE
    total = tl.load(tile_base + in_tile)
    for sp in range(1, n_split):
        total += tl.load(tile_base + sp * TILE + in_tile)
    mm_decode._store_output(total, alpha_ptr, alpha_b_ptr, out_ptr, rows_m, cols_n, M, N,
                            ALPHA_FROM_SCALES, ALPHA_DIV_RN)


def two_launch(stores, cfg, rows: int, a, b, sa, sb, alpha, ws) -> torch.Tensor:
    """``stores.mm_fp4_decode`` (partials only) then ``_sum_tiles_kernel`` on its workspace."""
    m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
    out = stores.mm_fp4_decode(a, b, sa, sb, alpha, torch.bfloat16, cfg, ws)
    plan = mm_decode._plan(cfg, m, n, k)
    _sum_tiles_kernel[(plan.tiles, cfg.block_n // rows)](
        ws.partials, *alpha_operands(alpha), out, m, n, plan.split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        ROWS=rows, **alpha_meta(alpha), num_warps=4)
    return out


def run(stores) -> list[dict]:
    sms = decode.num_sms(torch.device("cuda"))
    rows_out = []
    for m, n, k, x, a, sa, alpha, weights, w_t in bench_ops._rotating_points(SHAPES, MS):
        cfg = mm_decode.decode_config_for(m, n, k, sms)
        split, _ = decode.split_ranges(triton.cdiv(k // 2, cfg.block_k // 2), cfg.split_k)
        if split == 1:
            continue
        scfg = stores.DecodeConfig(**dataclasses.asdict(cfg))
        ws = stores.empty_decode_workspace(*mm_decode.decode_workspace_numel(m, n, k, cfg), a.device)
        shipped = mm_decode.mm_fp4_decode(a, weights[0][0], sa, weights[0][1], alpha, torch.bfloat16, cfg)
        variants = {"shipped": None, "stores": None}
        variants.update({f"two-launch/{r}": r for r in ROWS if r <= cfg.block_n})
        double = dataclasses.replace(scfg, split_k=2 * cfg.split_k)
        doubled = decode.split_ranges(triton.cdiv(k // 2, cfg.block_k // 2), double.split_k)[0] > split
        for name, r in variants.items():
            if r is not None:
                got = two_launch(stores, scfg, r, a, weights[0][0], sa, weights[0][1], alpha, ws)
                if not torch.equal(got, shipped):
                    raise RuntimeError(f"{name} changed the bits at m={m} {n}x{k}")
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(ROUNDS):
            for name, r in variants.items():
                if name == "shipped":
                    ms = bench_ops.decode_graph_ms(a, sa, alpha, weights, cfg)
                elif name == "stores":
                    ms = bench_ops.decode_graph_ms(a, sa, alpha, weights, cfg, stores)
                else:
                    ms = bench_ops.bench_graph([functools.partial(two_launch, stores, scfg, r, a, wq, sa, wsq, alpha, ws)
                                                for wq, wsq, _ in weights])
                times[name].append(1e3 * ms)
            if doubled:  # twice the splits (other K ranges, so other bits): what a cheaper reduction buys
                ws2 = stores.empty_decode_workspace(*mm_decode.decode_workspace_numel(m, n, k, double), a.device)
                times.setdefault("two-launch/16 x2 split", []).append(1e3 * bench_ops.bench_graph(
                    [functools.partial(two_launch, stores, double, 16, a, wq, sa, wsq, alpha, ws2)
                     for wq, wsq, _ in weights]))
        us = {name: sorted(t)[ROUNDS // 2] for name, t in times.items()}
        bf16 = 1e3 * bench_ops.bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t])
        row = {"m": m, "n": n, "k": k, "cfg": bench_ops._cfg_str(cfg), "split": split,
               "partial_mib": mm_decode.decode_workspace_numel(m, n, k, cfg)[0] * 4 / 2**20, "us": us, "bf16_us": bf16}
        rows_out.append(row)
        best = min((t, name) for name, t in us.items() if name.startswith("two-launch"))
        print(f"m={m} {n}x{k} {row['cfg']} split {split} partials {row['partial_mib']:.1f} MiB | "
              + " ".join(f"{name} {t:.1f}" for name, t in us.items())
              + f" | best two-launch {best[1]} {us['shipped'] / best[0]:.2f}x shipped | bf16 {bf16:.1f}", flush=True)
    return rows_out


def main(argv: list[str] | None = None) -> int:
    args = bench_ops.script_args(__doc__, argv)
    if args is None:
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        stores = bench_ops.patched_module(mm_decode, "mm_decode_stores", {_ARRIVAL: ""}, tmp)
        rows = run(stores)
    bench_ops.write_raw(args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
