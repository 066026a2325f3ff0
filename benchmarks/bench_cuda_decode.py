"""A CUDA C++ decode GEMM (``benchmarks/cuda/decode16.cu``, M <= 16) against fp4fuse's Triton one.

    PYTHONPATH=. python benchmarks/bench_cuda_decode.py [--check] [--time] [--variants 8x1x1x2x2,...]
        [--ms 1,16] [--json raw.json]

The kernel is compiled at run time by NVRTC through ``torch.cuda._compile_kernel`` (no CUDA
toolkit needed), once per variant ``NWARPSxTILESxPREFETCHxSUBxROUND`` (the macros at the top of the
.cu file: warps per CTA, 16-row tiles per warp, weight chunks loaded ahead, 128-element sub-chunks
per chunk, chunks per activation round).

* ``--check``: each variant at odd shapes (M 1 / 5 / 13 / 16, N not a power of two) and splits 1 /
  3 / 8 against the float64 reference (``mm_fp4_reference``, relative error) and the Triton kernel
  (``mm_fp4_triton``, bitwise), and a NaN block scale's propagation to its output column.
* ``--time``: CUDA-graph replays over rotating weight copies (``bench_ops``: weights cold in L2),
  microseconds per call, with cuBLAS bf16 and the Triton ``mm_fp4`` on the same operands in the same
  process; each variant at its best split of 1, 2, 4, 8, 16.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import bench_ops  # benchmarks/, this script's folder
from fp4fuse.kernels.triton.mm import mm_fp4_triton
from fp4fuse.nvfp4.format import mm_fp4_reference

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "decode16.cu")
FIELDS = ("NWARPS", "TILES", "PREFETCH", "SUB", "ROUND")
DEFAULT_VARIANTS = "8x1x1x1x4,8x1x1x2x2,8x1x3x2x4,4x1x1x4x2"
SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672), (6144, 4096), (4096, 2048), (2048, 4096), (14336, 4096),
          (4096, 7168))
SPLITS = (1, 2, 4, 8, 16)


class Variant:
    """One compiled configuration of the kernel and its launch geometry."""

    def __init__(self, spec: str) -> None:
        self.name = spec
        self.macros = dict(zip(FIELDS, (int(v) for v in spec.split("x")), strict=True))
        source = "".join(f"#define {k} {v}\n" for k, v in self.macros.items()) + open(SOURCE).read()
        self.kernel = torch.cuda._compile_kernel(source, "fp4fuse_decode16")
        self.smem = self.macros["ROUND"] * self.macros["SUB"] * 8 * 32 * 4 * 4  # bytes: decoded activation
        self.kernel.set_shared_memory_config(self.smem)
        self.threads = 32 * self.macros["NWARPS"]
        self.rows = 16 * self.macros["NWARPS"] * self.macros["TILES"]  # weight rows per CTA
        self.chunk = 128 * self.macros["SUB"]                           # K elements per chunk


class Launch:
    """The kernel at ``splits`` K splits, with its split-K workspace, for weights of ``n`` rows."""

    def __init__(self, variant: Variant, n: int, splits: int, device: torch.device) -> None:
        self.variant, self.splits = variant, splits
        self.partials = torch.empty(splits * n * 16, device=device, dtype=torch.float32)
        self.counters = torch.zeros(n, device=device, dtype=torch.int32)  # every call leaves them zero

    def __call__(self, a, b, sa, sb, alpha, out) -> torch.Tensor:
        v = self.variant
        m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
        if m > 16 or n % 16 or k % v.chunk:
            raise ValueError(f"decode16 {v.name}: needs M <= 16, N % 16 == 0 and K % {v.chunk} == 0, got {m, n, k}")
        chunks = k // v.chunk
        per_split = -(-chunks // min(self.splits, chunks))
        splits = -(-chunks // per_split)
        v.kernel(grid=(-(-n // v.rows), splits, 1), block=(v.threads, 1, 1), shared_mem=v.smem,
                 args=[a, sa, b, sb, alpha, out, self.partials, self.counters, m, n, k, splits, per_split,
                       int(out.dtype == torch.bfloat16)])
        return out


def _operands(m: int, n: int, k: int, seed: int):
    torch.manual_seed(seed)
    a, sa, ga = bench_ops.quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3)
    b, sb, gb = bench_ops.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    return a, sa, b, sb, (1.0 / (ga * gb)).float().reshape(1)


def check(variants: list[Variant], raw: dict) -> None:
    for i, (m, n, k) in enumerate(((16, 2064, 3584), (5, 4096, 1536), (1, 2048, 8192), (13, 8192, 8192),
                                   (16, 28672, 512))):
        a, sa, b, sb, alpha = _operands(m, n, k, i)
        ref = mm_fp4_reference(a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), alpha.cpu(), torch.float64)
        triton_out = mm_fp4_triton(a, b, sa, sb, alpha, torch.float32)
        for v in variants:
            for splits in (1, 3, 8):
                out = torch.full((m, n), float("nan"), device="cuda")
                Launch(v, n, splits, a.device)(a, b, sa, sb, alpha, out)
                err = float((out.double().cpu() - ref).abs().max() / ref.abs().max())
                same = torch.equal(out, triton_out)
                raw["check"].append(dict(variant=v.name, m=m, n=n, k=k, splits=splits, rel_err=err, bitwise_triton=same))
                print(f"check {v.name} {m}x{n}x{k} split {splits}: rel err {err:.2e}, bitwise Triton {same}", flush=True)
    a, sa, b, sb, alpha = _operands(7, 1024, 1024, 9)
    sb = sb.clone()
    sb.view(torch.uint8)[37, 5] = 0x7F  # a NaN block scale: output column 37 is NaN, no other
    for v in variants:
        out = torch.zeros(7, 1024, device="cuda", dtype=torch.bfloat16)
        Launch(v, 1024, 2, a.device)(a, b, sa, sb, alpha, out)
        nan = torch.isnan(out.float())
        ok = bool(nan[:, 37].all()) and int(nan.sum()) == 7
        raw["check"].append(dict(variant=v.name, nan_propagation=ok))
        print(f"check {v.name} NaN block scale -> its column only: {ok}", flush=True)


def timing(variants: list[Variant], ms: tuple[int, ...], raw: dict) -> None:
    for m, n, k, x, a, sa, alpha, weights, w_t in bench_ops._rotating_points(SHAPES, ms):
        alpha = alpha.float().reshape(1)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        us = {"cublas_bf16": bench_ops.bench_graph([lambda wt=wt: torch.mm(x, wt) for wt in w_t]) * 1e3,
              "triton": bench_ops.bench_graph([lambda wq=wq, wsq=wsq: mm_fp4_triton(a, wq, sa, wsq, alpha, torch.bfloat16)
                                               for wq, wsq, _ in weights]) * 1e3}
        best_split = {}
        for v in variants:
            for splits in SPLITS:
                launch = Launch(v, n, splits, a.device)
                t = bench_ops.bench_graph([lambda wq=wq, wsq=wsq: launch(a, wq, sa, wsq, alpha, out)
                                           for wq, wsq, _ in weights]) * 1e3
                if t < us.get(v.name, float("inf")):
                    us[v.name], best_split[v.name] = t, splits
        raw["time"].append(dict(m=m, n=n, k=k, us=us, best_split=best_split))
        line = ", ".join(f"{v.name} {us[v.name]:.1f} (split {best_split[v.name]}, {us['triton'] / us[v.name]:.2f}x Triton)"
                         for v in variants)
        print(f"time {m}x{n}x{k}: cuBLAS bf16 {us['cublas_bf16']:.1f} us, Triton {us['triton']:.1f} us | {line}",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--time", action="store_true")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--ms", default="1,16")
    p.add_argument("--json")
    args = p.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    t0 = time.time()
    variants = [Variant(spec) for spec in args.variants.split(",")]
    print(f"compiled {len(variants)} variants with NVRTC in {time.time() - t0:.1f} s", flush=True)
    raw: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "check": [], "time": []}
    if args.check:
        check(variants, raw)
    if args.time:
        timing(variants, tuple(int(v) for v in args.ms.split(",")), raw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
