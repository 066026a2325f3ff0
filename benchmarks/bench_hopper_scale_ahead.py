"""The Hopper Gluon GEMM's shipped 256-token tile with its weight scales loaded a step ahead, or not.

    PYTHONPATH=. python benchmarks/bench_hopper_scale_ahead.py [--ms 200,256,512,1024,2048]
        [--shapes 8192x8192,...] [--rounds 3] [--json raw.json]

``mm_fp4_hopper``'s ``scale_ahead=1`` loads a K step's weight scale words during the step before,
out of the consumer's per-step chain; the results of 2026-11-27 (benchmarks/results/) measured it
only at 16-128-token tiles. Above ``DECODE_MAX_M`` rows (and from ``SPLIT_MIN_M`` rows on large
weights) the shipped dispatch takes the 256-token tile (with the scales ahead since 2026-11-28, on
this script's results). This script times that launch with the scales in the step (``a0``) and
ahead (``a1``) at the shipped split-K count, with the shipped dispatch and cuBLAS bf16, over
``--rounds`` interleaved rounds (``bench_ops.hopper_sweep_main``: CUDA-graph replays over rotating
weight copies, the median of the rounds per variant, microseconds). ``scale_ahead`` moves loads
only: the sums, and so the output bits, are the launch's own (the largest relative difference from
the shipped output is printed). Results in benchmarks/results/.
"""
from __future__ import annotations

import sys

import bench_ops  # benchmarks/, this script's folder

#: issue 12's three shapes, then Llama-3-8B's TP=2 shards: q/k/v, o, gate + up, down
SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672), (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168))
MS = (200, 256, 512, 1024, 2048)
ROUNDS = 3


def _variants(hopper, m: int, n: int, k: int, sms: int) -> dict[str, dict]:
    split = hopper.split_for(m, n, k, sms)
    return {f"a{ahead}": {"block_m": hopper.BLOCK_M, "split_k": split, "scale_ahead": ahead} for ahead in (0, 1)}


def main(argv: list[str] | None = None) -> int:
    return bench_ops.hopper_sweep_main(argv, __doc__, SHAPES, MS, _variants, "AHEAD", "hopper_scale_ahead",
                                       default_rounds=ROUNDS)


if __name__ == "__main__":
    sys.exit(main())
