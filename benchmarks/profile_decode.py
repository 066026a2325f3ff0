"""The decode GEMM at M x N x K (default 16 x 8192 x 8192) through ``torch.ops.fp4fuse.mm_fp4``, for a
profiler to attach to; the stall table in benchmarks/results/ came from::

    ncu -k regex:_mm_decode_kernel -s 2 -c 1 --section SourceCounters --section WarpStateStats \
        -o decode python benchmarks/profile_decode.py
    ncu -i decode.ncu-rep --page source --csv --print-source sass > decode_sass.csv
"""
from __future__ import annotations

import argparse

import torch

import fp4fuse  # noqa: F401  (registers torch.ops.fp4fuse)
from fp4fuse.nvfp4 import format as nvfp4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--calls", type=int, default=4)
    args = p.parse_args()
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16)
    gx = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    gw = nvfp4.global_scale_from_amax(w.float().abs().amax()).reshape(1)
    a, sa = torch.ops.fp4fuse.scaled_fp4_quant(x, gx)
    b, sb = torch.ops.fp4fuse.scaled_fp4_quant(w, gw)
    alpha = torch.reciprocal(gx * gw)
    for _ in range(args.calls):
        torch.ops.fp4fuse.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
