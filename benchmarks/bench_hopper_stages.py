"""The Hopper Gluon GEMM's ring depth at small token tiles: does a deeper TMA ring feed it?

    PYTHONPATH=. python benchmarks/bench_hopper_stages.py [--ms 16,64,128,256] [--json raw.json]

``fp4fuse.kernels.triton.mm_hopper`` streams each K step (64 elements) of its weight codes and
activation halves through a ring of ``stages`` shared-memory buffers. A step's MMA work grows with
the token tile: at 256 tokens a 4-deep ring holds about 4,000 tensor-core cycles of work in flight,
at 128 tokens half that and at 16-64 tokens a few hundred, less than the latency of a weight load
from HBM. Count: the weight must arrive at HBM bandwidth / multiprocessors (about 13 bytes a cycle on
an H100) over that latency (about 1,500 cycles loaded), some 19 KiB in flight per multiprocessor,
where a ring of 4 holds at most 16 KiB of weight codes. This script times, at each M, the smallest
token tile holding M, the 128-token tile from 64 rows and the 256-token one above 128 rows, each at
ring depths ``STAGES_TRIED`` (up to ``max_stages``), with ``hopper_split``'s split-K count (and a
register cap fitting two programs a multiprocessor at 16-64 tokens), against the shipped dispatch
and cuBLAS bf16, on two of issue 12's shapes (8192^2, 28672 x 8192) and Llama-3-8B's TP=2 gate/up
and down shards.

CUDA-graph replays over rotating weight copies (``bench_ops._hopper_point``), microseconds; each
variant's largest relative difference from the shipped path's output is printed (other split
counts sum K in another order). Results in benchmarks/results/.
"""
from __future__ import annotations

import sys

import bench_ops  # benchmarks/, this script's folder

SHAPES = ((8192, 8192), (14336, 4096), (4096, 7168), (28672, 8192))
MS = (16, 64, 128, 256)
STAGES_TRIED = (4, 6, 8, 12)
#: ptxas cap giving two programs a multiprocessor (``bench_ops.HOPPER_SMALL_REGISTERS``).
TWO_PROGRAM_REGISTERS = 80


def _variants(hopper, m: int, n: int, k: int, sms: int) -> dict[str, dict]:
    """Name -> ``mm_fp4_hopper`` keyword arguments at one point."""
    tiles = {min(b for b in hopper.BLOCK_M_CHOICES if b >= m)}
    if m >= 64:
        tiles.add(128)
    if m > 128:
        tiles.add(256)
    out = {}
    for block_m in sorted(tiles):
        for stages in sorted({s for s in STAGES_TRIED if s <= hopper.max_stages(block_m)}):
            split = hopper.hopper_split(m, n, k, sms, block_m)
            out[f"t{block_m}/st{stages}/s{split}"] = {"block_m": block_m, "split_k": split, "stages": stages}
            if block_m <= 64:
                split2 = hopper.hopper_split(m, n, k, 2 * sms, block_m)
                out[f"t{block_m}/st{stages}/s{split2}/r{TWO_PROGRAM_REGISTERS}"] = {
                    "block_m": block_m, "split_k": split2, "stages": stages, "max_registers": TWO_PROGRAM_REGISTERS}
    return out


def main(argv: list[str] | None = None) -> int:
    return bench_ops.hopper_sweep_main(argv, __doc__, SHAPES, MS, _variants, "STAGES", "hopper_stages")


if __name__ == "__main__":
    sys.exit(main())
