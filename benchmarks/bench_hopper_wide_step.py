"""The Hopper Gluon GEMM's K step at small token tiles: 64 or 128 elements, scales in the step or a step ahead.

    PYTHONPATH=. python benchmarks/bench_hopper_wide_step.py [--ms 16,32,64,128] [--shapes 8192x8192,...]
        [--json raw.json]

``fp4fuse.kernels.triton.mm_hopper``'s consumer warpgroups run a serial chain per K step: the
step's weight scale words loaded from global memory, a wait for the step's codes in the TMA ring,
the decode into wgmma fragments, the wgmmas, a wait for the previous step's. At a 16-token tile a
64-element step holds a few hundred tensor-core cycles, less than that chain, so the chain sets
the pace. Two sweep parameters of ``mm_fp4_hopper`` shorten it per element:

* ``step_k=128``: 128-element steps (64 code bytes a row, one int64 word of 8 scales a row), half
  the chains per weight; the fragments double (registers), and the ring's stages double in size;
* ``scale_ahead=1``: each step's scale words are loaded during the step before, so their latency
  leaves the chain.

At each M this times the smallest token tile holding M (and the 128-token tile from 65 rows), both
step widths with and without the scales ahead, at ``hopper_split``'s split-K count (above 256 rows
the 128- and the shipped 256-token tiles, unsplit), against the shipped dispatch (the decode GEMM up to 128 rows,
this kernel's default launch above 256) and cuBLAS bf16, on issue 12's shapes and
Llama-3-8B's TP=2 shards. CUDA-graph replays over rotating weight copies
(``bench_ops._hopper_point``), microseconds; each variant's largest relative difference from the
shipped path's output is printed. Results in benchmarks/results/.
"""
from __future__ import annotations

import sys

import bench_ops  # benchmarks/, this script's folder

#: issue 12's three shapes, then Llama-3-8B's TP=2 shards: q/k/v, o, gate (or up), gate + up, down
SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672), (3072, 4096), (4096, 2048), (7168, 4096), (14336, 4096),
          (4096, 7168))
MS = (16, 32, 64, 128)


def _variants(hopper, m: int, n: int, k: int, sms: int) -> dict[str, dict]:
    """Name -> ``mm_fp4_hopper`` keyword arguments at one point: above ``DECODE_MAX_M`` rows the
    128- and the shipped 256-token tile unsplit (:func:`split_for`), below the smallest tile holding
    M (and the 128-token one from 65 rows) at ``hopper_split``'s count; each with the shipped ring
    depth where it fits, else the deepest that does (``max_stages``), and none under 3 stages (the
    256-token tile's 128-element steps fit only 2)."""
    if m > hopper.DECODE_MAX_M:
        splits = {128: 1, hopper.BLOCK_M: hopper.split_for(m, n, k, sms)}
    else:
        tiles = {min(b for b in hopper.BLOCK_M_CHOICES if b >= m)} | ({128} if m > 64 else set())
        splits = {block_m: hopper.hopper_split(m, n, k, sms, block_m) for block_m in tiles}
    out = {}
    for block_m, split in sorted(splits.items()):
        for step_k in hopper.STEP_K_CHOICES:
            if k % step_k:
                continue
            stages = min(hopper.STAGES, hopper.max_stages(block_m, step_k))
            if stages < 3:  # a 2-deep ring cannot overlap a step's loads with the one before
                continue
            for ahead in (0, 1):
                out[f"t{block_m}/k{step_k}/a{ahead}/s{split}"] = {
                    "block_m": block_m, "split_k": split, "step_k": step_k, "scale_ahead": ahead, "stages": stages}
    return out


def main(argv: list[str] | None = None) -> int:
    return bench_ops.hopper_sweep_main(argv, __doc__, SHAPES, MS, _variants, "WIDE_STEP", "hopper_wide_step")


if __name__ == "__main__":
    sys.exit(main())
