"""The Hopper Gluon GEMM's shipped 256-token tile with its weight scales loaded a step ahead, or not.

    PYTHONPATH=. python benchmarks/bench_hopper_scale_ahead.py [--ms 200,256,512,1024,2048]
        [--shapes 8192x8192,...] [--rounds 3] [--json raw.json]

``mm_fp4_hopper``'s ``scale_ahead=1`` loads a K step's weight scale words during the step before,
out of the consumer's per-step chain; the results of 2026-11-27 (benchmarks/results/) measured it
only at 16-128-token tiles. Above ``DECODE_MAX_M`` rows (and from ``SPLIT_MIN_M`` rows on large
weights) the shipped dispatch takes the 256-token tile (with the scales ahead since 2026-11-28, on
this script's results). This script times that launch with the scales in the step (``a0``) and
ahead (``a1``) at the shipped
split-K count, with the shipped dispatch and cuBLAS bf16, over ``--rounds`` interleaved rounds
(CUDA-graph replays over rotating weight copies, ``bench_ops._hopper_point``; the median of the
rounds per variant, microseconds). ``scale_ahead`` moves loads only: the sums, and so the output
bits, are the launch's own (the largest relative difference from the shipped output is printed).
Results in benchmarks/results/.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton

import bench_ops  # benchmarks/, this script's folder
from fp4fuse.kernels.triton import mm as triton_mm

#: issue 12's three shapes, then Llama-3-8B's TP=2 shards: q/k/v, o, gate + up, down
SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672), (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168))
MS = (200, 256, 512, 1024, 2048)
ROUNDS = 3


def _variants(hopper, m: int, n: int, k: int, sms: int) -> dict[str, dict]:
    split = hopper.split_for(m, n, k, sms)
    return {f"a{ahead}": {"block_m": hopper.BLOCK_M, "split_k": split, "scale_ahead": ahead} for ahead in (0, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--json", help="raw results as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or triton_mm.hopper_kernels() is None:
        print("this sweep needs an sm_90 GPU and Triton 3.6 (the Gluon GEMM)", file=sys.stderr)
        return 2
    hopper = triton_mm.hopper_kernels()
    shapes = tuple(tuple(int(d) for d in s.split("x")) for s in args.shapes.split(","))
    ms = tuple(int(v) for v in args.ms.split(","))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
    rows = []
    for m, n, k, x, a, sa, alpha, weights, w_t in bench_ops._rotating_points(shapes, ms):
        rounds, worst = [], 0.0
        for _ in range(args.rounds):
            us, diff = bench_ops._hopper_point(a, sa, alpha, x, weights, w_t, _variants(hopper, m, n, k, sms))
            rounds.append(us)
            worst = max(worst, diff)
        median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        print(f"AHEAD m={m:<5d} n={n:<6d} k={k:<6d} " + " ".join(f"{key}={v:.1f}" for key, v in median.items())
              + f" | a1 vs a0 {median['a0'] / median['a1']:.3f}x, a1 vs bf16 {median['bf16'] / median['a1']:.2f}x,"
              f" a0 vs bf16 {median['bf16'] / median['a0']:.2f}x; rel diff {worst:.1e}", flush=True)
        rows.append({"m": m, "n": n, "k": k, "us": median, "rounds": rounds, "max_rel_diff_vs_shipped": worst})
    bench_ops.write_raw(args.json, hopper_scale_ahead=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
