"""The Hopper Gluon GEMM with one or two K steps of wgmmas queued while the next step is decoded.

    PYTHONPATH=. python benchmarks/bench_hopper_queue_depth.py [--ms 16,64,128,192,256,1024]
        [--shapes 8192x8192,...] [--rounds 1] [--json raw.json]

``fp4fuse.kernels.triton.mm_hopper``'s consumers decode step i + 1 while step i's wgmmas run, then
wait for step i's before they decode step i + 2 (``queue_depth=1``, shipped). The decode's chain
then sits between two steps' MMAs: if the chain from "step i - 1's wgmmas done" to "step i + 1's
issued" takes D cycles and one step's wgmmas T, a step takes max(T, (D + T) / 2). The K-step
series of the twenty-eighth session (0.51 us a step at the 128-token tile, 0.67 us at the
256-token tile, whose MMAs are twice as long) fit D of about 1300 cycles in both. With
``queue_depth=2`` a consumer waits for step i - 1's wgmmas after issuing step i + 1's, which
bounds a step by max(T, (D + T) / 3): at most the MMAs' time at the 256-token tile, about 2/3 of
today's at the 128-token one. ``scale_ahead=2`` loads each step's scale words two steps early, so
their global-memory latency fits the shorter steps.

At each M this times the smallest token tile holding M (and the 128-token tile from 65 rows, the
256-token one above 128) at ``hopper_split``'s split-K count (above ``DECODE_MAX_M`` the 256-token
tile, ``split_for``'s), with: the shipped launch (``d1/a1``), two steps queued (``d2/a1``), also
with the scales two steps ahead (``d2/a2``), and two steps queued over the deepest ring of at most
8 stages that fits (``d2/a1/deep``); against the shipped dispatch and cuBLAS bf16, as CUDA-graph
replays over rotating weight copies (``bench_ops.hopper_sweep_main``), microseconds. The queue
depth and the scales' timing move no sum: every variant's output is the shipped launch's bits
(the largest relative difference from the shipped path's output is printed). Results in
benchmarks/results/.
"""
from __future__ import annotations

import sys

import bench_ops  # benchmarks/, this script's folder

#: issue 12's three shapes, then Llama-3-8B's TP=2 shards: q/k/v, o, gate + up, down
SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672), (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168))
MS = (16, 64, 128, 192, 256, 1024)
DEEPEST_RING = 8


def _variants(hopper, m: int, n: int, k: int, sms: int) -> dict[str, dict]:
    """Name -> ``mm_fp4_hopper`` keyword arguments at one point (module docstring)."""
    if m > hopper.DECODE_MAX_M:
        splits = {hopper.BLOCK_M: hopper.split_for(m, n, k, sms)}
    else:
        tiles = {min(b for b in hopper.BLOCK_M_CHOICES if b >= m)} | ({128} if m > 64 else set())
        tiles |= {hopper.BLOCK_M} if m > 128 else set()
        splits = {block_m: hopper.hopper_split(m, n, k, sms, block_m) for block_m in tiles}
    out = {}
    for block_m, split in sorted(splits.items()):
        base = {"block_m": block_m, "split_k": split}
        deep = min(DEEPEST_RING, hopper.max_stages(block_m))
        out[f"t{block_m}/s{split}/d1/a1"] = base
        out[f"t{block_m}/s{split}/d2/a1"] = {**base, "queue_depth": 2}
        out[f"t{block_m}/s{split}/d2/a2"] = {**base, "queue_depth": 2, "scale_ahead": 2}
        if deep > hopper.STAGES:
            out[f"t{block_m}/s{split}/d2/a1/deep"] = {**base, "queue_depth": 2, "stages": deep}
    return out


def main(argv: list[str] | None = None) -> int:
    return bench_ops.hopper_sweep_main(argv, __doc__, SHAPES, MS, _variants, "QUEUE", "hopper_queue_depth")


if __name__ == "__main__":
    sys.exit(main())
