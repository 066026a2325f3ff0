"""The Hopper Gluon GEMM's weight codes loaded as contiguous words in fragment order, or in K order.

    PYTHONPATH=. python benchmarks/bench_hopper_fragment_order.py [--ms 16,64,128,192,256,1024,2048]
        [--shapes 8192x8192,...] [--rounds 3] [--json raw.json]

``mm_fp4_hopper``'s ``fragment_order`` (``fp4fuse/kernels/triton/mm_hopper.py``, module docstring):
each consumer thread loads 8 contiguous code bytes of each of its weight rows a 64-element step
(one scale each) and the step's K order is the wgmma fragments' own, with the activation decoded in
that order (``decode_activation``), instead of 2-byte loads in K order with a scale shift per byte
pair. The ncu profile of 2026-11-28 (``2026-11-28-queue-depth-packed-h200.md``) found the consumers
bound by the decode's instruction stream; this form takes about a third of a step's instructions
off (offline SASS).

At each M: up to 128 rows (where the shipped dispatch runs the decode GEMM) the smallest token tile
holding M and, from 65 rows, the 128-token tile, at ``hopper_split``'s split-K count; above, the
dispatch's launch (the 256-token tile, ``split_for``'s count); each with ``fragment_order`` on
(``f1``) and off (``f0``); against the shipped dispatch and cuBLAS bf16, over ``--rounds`` interleaved rounds of
CUDA-graph replays over rotating weight copies (``bench_ops.hopper_sweep_main``), microseconds.
The two forms' sums differ in the last bits (which products share a wgmma); the largest relative
difference from the shipped path's output is printed. Results in benchmarks/results/.
"""
from __future__ import annotations

import sys

import bench_ops  # benchmarks/, this script's folder

#: issue 12's three shapes, then Llama-3-8B's TP=2 shards: q/k/v, o, gate + up, down
SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672), (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168))
MS = (16, 64, 128, 192, 256, 1024, 2048)
ROUNDS = 2


def _variants(hopper, m: int, n: int, k: int, sms: int) -> dict[str, dict]:
    """Name -> ``mm_fp4_hopper`` keyword arguments at one point (module docstring)."""
    if m > hopper.DECODE_MAX_M:
        splits = {hopper.BLOCK_M: hopper.split_for(m, n, k, sms)}
    else:
        tiles = {min(b for b in hopper.BLOCK_M_CHOICES if b >= m)} | ({128} if m > 64 else set())
        splits = {block_m: hopper.hopper_split(m, n, k, sms, block_m) for block_m in tiles}
    return {f"t{block_m}/s{split}/f{int(order)}": {"block_m": block_m, "split_k": split, "fragment_order": order}
            for block_m, split in sorted(splits.items()) for order in (False, True)}


def main(argv: list[str] | None = None) -> int:
    return bench_ops.hopper_sweep_main(argv, __doc__, SHAPES, MS, _variants, "FRAG", "hopper_fragment_order",
                                       default_rounds=ROUNDS)


if __name__ == "__main__":
    sys.exit(main())
