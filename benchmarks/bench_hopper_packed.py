"""The Hopper Gluon GEMM on a packed weight: each TMA load one contiguous block instead of 128 rows' 32 bytes.

    PYTHONPATH=. python benchmarks/bench_hopper_packed.py [--ms 16,32,64,128,256] [--shapes 8192x8192,...]
        [--json raw.json]

``fp4fuse.kernels.triton.mm_hopper`` reads a 64-element K step of a 128-row weight tile as one TMA
box of 128 rows x 32 bytes of the linear ``[N, K/2]`` weight, and the rows' scale words as 4
bytes a row: 32-byte pieces K/2 bytes apart, while a program moves to the next 32 bytes of the
same rows only a step later. ``bench_hopper_queue_depth.py`` found the K step's time nearly the
same at 16-, 128- and 256-token tiles and unmoved by queueing a second step of wgmmas, so neither
the tensor cores nor the decode chain sets it. This script tests the weight's access pattern:
``mm_hopper.pack_weight`` copies the codes and scale words in the order the kernel reads them
(tile, step, row), so each step's codes are one contiguous 4 KiB block and its scale words 512
bytes. The codes, scales and sums are the same, so the output is the linear weight's bits.

At each M: the smallest token tile holding M (and the 256-token tile above 128 rows) at
``hopper_split``'s split-K count, on the linear weight (``lin``), on the packed one (``packed``),
and packed with two steps queued over the deepest ring of at most 8 stages (``packed/d2``);
against the shipped dispatch (``mm_fp4_triton``) and cuBLAS bf16, as CUDA-graph replays over
rotating weight copies (``bench_ops.bench_graph``), microseconds. Results in benchmarks/results/.
"""
from __future__ import annotations

import argparse
import functools
import sys

import torch
import triton

import bench_ops  # benchmarks/, this script's folder
from fp4fuse.kernels.triton import mm as triton_mm

#: issue 12's three shapes, then Llama-3-8B's TP=2 shards: q/k/v, o, gate + up, down
SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672), (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168))
MS = (16, 32, 64, 128, 256)
DEEPEST_RING = 8


def _launches(hopper, m: int, n: int, k: int, sms: int) -> dict[str, dict]:
    """Name prefix -> ``mm_fp4_hopper`` keyword arguments of each token tile timed at M."""
    tiles = {min(b for b in hopper.BLOCK_M_CHOICES if b >= m)} | ({hopper.BLOCK_M} if m > 128 else set())
    return {f"t{b}/s{hopper.hopper_split(m, n, k, sms, b)}": {"block_m": b, "split_k": hopper.hopper_split(m, n, k, sms, b)}
            for b in sorted(tiles)}


def time_point(hopper, m, n, k, a, sa, alpha, x, weights, w_t, sms) -> tuple[dict[str, float], float]:
    """Microseconds of each variant at one point, and the largest relative difference of any
    variant's output from the linear launch's (0.0 expected: the same sums)."""
    packs = [hopper.pack_weight(wq, wsq) for wq, wsq, _ in weights]
    us = {"shipped": bench_ops.bench_graph([functools.partial(triton_mm.mm_fp4_triton, a, wq, sa, wsq, alpha,
                                                              torch.bfloat16) for wq, wsq, _ in weights]) * 1e3,
          "bf16": bench_ops.bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t]) * 1e3}
    worst = 0.0
    for prefix, launch in _launches(hopper, m, n, k, sms).items():
        deep = min(DEEPEST_RING, hopper.max_stages(launch["block_m"]))
        forms = {"lin": ({}, False), "packed": ({}, True), "packed/d2": ({"queue_depth": 2, "stages": deep}, True)}
        reference = None
        for name, (extra, packed) in forms.items():
            if name == "packed/d2" and deep <= 2:
                continue

            def call(i, extra=extra, packed=packed):
                wq, wsq, _ = weights[i]
                return hopper.mm_fp4_hopper(a, wq, sa, wsq, alpha, torch.bfloat16, **launch, **extra,
                                            packed=packs[i] if packed else None)
            got = call(0).float()
            reference = got if reference is None else reference
            worst = max(worst, ((got - reference).norm() / reference.norm()).item())
            us[f"{prefix}/{name}"] = bench_ops.bench_graph([functools.partial(call, i)
                                                            for i in range(len(weights))]) * 1e3
    return us, worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", help="comma-separated row counts (default: %s)" % ",".join(map(str, MS)))
    parser.add_argument("--shapes", help="comma-separated NxK weight shapes")
    parser.add_argument("--json", help="raw results as JSON")
    args = parser.parse_args(argv)
    hopper = triton_mm.hopper_kernels() if torch.cuda.is_available() else None
    if hopper is None:
        print("this benchmark needs an sm_90 GPU and Triton 3.6 (the Gluon GEMM)", file=sys.stderr)
        return 2
    shapes = tuple(tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")) if args.shapes else SHAPES
    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else MS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
    rows = []
    for m, n, k, x, a, sa, alpha, weights, w_t in bench_ops._rotating_points(shapes, ms):
        us, worst = time_point(hopper, m, n, k, a, sa, alpha, x, weights, w_t, sms)
        rows.append(bench_ops._report_point("PACKED", m, n, k, us, worst, {}))
    bench_ops.write_raw(args.json, hopper_packed=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
