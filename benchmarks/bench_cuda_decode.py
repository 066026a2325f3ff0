"""A CUDA C++ decode GEMM (``benchmarks/cuda/decode16.cu``, M <= 16) against fp4fuse's Triton one.

    PYTHONPATH=. python benchmarks/bench_cuda_decode.py [--check] [--time] [--stream]
        [--variants 8x1x1x2x2,PREPACKED+TAIL_PAR=4:4x1x1x2x2,...] [--ms 1,16] [--shapes 8192x8192,...]
        [--json raw.json]

The kernel is compiled at run time by NVRTC through ``torch.cuda._compile_kernel`` (no CUDA
toolkit needed), once per variant ``[SWITCHES:]NWARPSxTILESxPREFETCHxSUBxROUND``: the geometry
macros at the top of the .cu file (warps per CTA, 16-row tiles per warp, weight chunks loaded ahead,
128-element sub-chunks per chunk, chunks per activation round), optionally preceded by probe switches
joined by ``+`` (``NAME`` or ``NAME=VALUE``; the list and what each does is in the .cu file's header).
Switches marked "timing only" there make the output wrong on purpose: such variants are timed, not
checked.

* ``--check``: each exact variant at odd shapes (M 1 / 5 / 13 / 16, N not a power of two) and the
  splits it allows against the float64 reference (``mm_fp4_reference``, relative error) and the Triton
  kernel (``mm_fp4_triton``, bitwise), and a NaN block scale's propagation to its output column.
* ``--time``: CUDA-graph replays over rotating weight copies (``bench_ops``: weights cold in L2),
  microseconds per call, with cuBLAS bf16 and the Triton ``mm_fp4`` on the same operands in the same
  process; each variant at its best split of those it allows (1, 2, 4, 8, 16; a cluster variant
  exactly its cluster size); the weight's floor (its codes and scales at the copy bandwidth measured
  in the process, ``bench_ops.weight_floor_us``); each exact variant's output compared bitwise with
  the plain kernel of the same chunk size at the same split. The Triton column goes through
  ``mm_fp4_triton``, which allocates (and zero-fills) its split-K workspace per call; the CUDA
  variants reuse theirs.
* ``--stream``: the same weights' bytes read by a plain streaming kernel
  (``benchmarks/cuda/stream_read.cu``, best of its grid shapes): the weight-read floor of a launch.
* ``--shapes 8192x8192,...`` (N x K) replaces ``SHAPES`` for ``--time`` and ``--stream``.
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

CUDA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda")
SOURCE = os.path.join(CUDA_DIR, "decode16.cu")
STREAM_SOURCE = os.path.join(CUDA_DIR, "stream_read.cu")
FIELDS = ("NWARPS", "TILES", "PREFETCH", "SUB", "ROUND")
DEFAULT_VARIANTS = "8x1x1x1x4,8x1x1x2x2,8x1x3x2x4,4x1x1x4x2"
SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672), (6144, 4096), (4096, 2048), (2048, 4096), (14336, 4096),
          (4096, 7168))
SPLITS = (1, 2, 4, 8, 16)
#: Probe switches whose output is wrong on purpose (decode16.cu's header).
TIMING_ONLY = frozenset(("LOAD_ONLY", "NO_MMA", "NO_ACT", "NO_TAIL", "PREPACKED", "TAIL_NOFENCE", "TAIL_NOREDUCE"))


class Variant:
    """One compiled configuration of the kernel and its launch geometry."""

    def __init__(self, spec: str) -> None:
        self.name = spec
        tags, _, geometry = spec.rpartition(":")
        self.macros = dict(zip(FIELDS, (int(v) for v in geometry.split("x")), strict=True))
        self.switches = dict(t.split("=", 1) if "=" in t else (t, "1") for t in tags.split("+") if t)
        defines = {**self.switches, **self.macros}
        source = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + open(SOURCE).read()
        self.kernel = torch.cuda._compile_kernel(source, "fp4fuse_decode16")
        sub, warps = self.macros["SUB"], self.macros["NWARPS"]
        self.threads = 32 * warps
        self.rows = 16 * warps // int(self.switches.get("KSPLIT_WARPS", 1)) * self.macros["TILES"]  # weight rows per CTA
        self.chunk = 128 * sub                          # K elements per chunk
        self.cluster = int(self.switches.get("CLUSTER_TAIL", 0)) or None
        self.max_split = int(self.switches["TAIL_PAR"]) if "TAIL_PAR" in self.switches else None
        self.exact = not TIMING_ONLY.intersection(self.switches)
        self.smem = self.macros["ROUND"] * sub * 8 * 32 * 4 * 4  # bytes: decoded activation
        if "SMEM_RING" in self.switches:
            self.smem += warps * (self.macros["PREFETCH"] + 1) * (2 * sub * 512 + 2 * 32 * 2 * sub)
        if "CLUSTER_PUSH" in self.switches:
            self.smem += self.cluster * self.rows * 16 * 4
        self.kernel.set_shared_memory_config(self.smem)

    def splits(self, choices: tuple[int, ...], k: int | None = None) -> tuple[int, ...]:
        """The split counts of ``choices`` this variant computes (a cluster variant: its cluster size,
        where K's chunks give exactly that many splits)."""
        if self.cluster:
            return (self.cluster,) if k is None or effective_splits(k // self.chunk, self.cluster) == self.cluster else ()
        return tuple(s for s in choices if self.max_split is None or s <= self.max_split)

    def plain(self) -> Variant:
        """The kernel without switches and with this variant's chunk size (its K order)."""
        return Variant(f"8x1x1x{self.macros['SUB']}x2")


def effective_splits(chunks: int, splits: int) -> int:
    """How many K ranges a launch asked for ``splits`` makes of ``chunks`` chunks (each range whole
    chunks, the last possibly shorter)."""
    per_split = -(-chunks // min(splits, chunks))
    return -(-chunks // per_split)


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
        splits = effective_splits(chunks, self.splits)
        per_split = -(-chunks // splits)
        if v.cluster and splits != v.cluster:
            raise ValueError(f"decode16 {v.name}: a cluster of {v.cluster} needs {v.cluster} splits, got {splits}")
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
    exact = [v for v in variants if v.exact]
    for i, (m, n, k) in enumerate(((16, 2064, 3584), (5, 4096, 1536), (1, 2048, 8192), (13, 8192, 8192),
                                   (16, 28672, 512))):
        a, sa, b, sb, alpha = _operands(m, n, k, i)
        ref = mm_fp4_reference(a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), alpha.cpu(), torch.float64)
        triton_out = mm_fp4_triton(a, b, sa, sb, alpha, torch.float32)
        for v in exact:
            for splits in v.splits((1, 3, 8), k):
                out = torch.full((m, n), float("nan"), device="cuda")
                Launch(v, n, splits, a.device)(a, b, sa, sb, alpha, out)
                err = float((out.double().cpu() - ref).abs().max() / ref.abs().max())
                same = torch.equal(out, triton_out)
                raw["check"].append(dict(variant=v.name, m=m, n=n, k=k, splits=splits, rel_err=err, bitwise_triton=same))
                print(f"check {v.name} {m}x{n}x{k} split {splits}: rel err {err:.2e}, bitwise Triton {same}", flush=True)
    a, sa, b, sb, alpha = _operands(7, 1024, 1024, 9)
    sb = sb.clone()
    sb.view(torch.uint8)[37, 5] = 0x7F  # a NaN block scale: output column 37 is NaN, no other
    for v in exact:
        out = torch.zeros(7, 1024, device="cuda", dtype=torch.bfloat16)
        Launch(v, 1024, v.cluster or 2, a.device)(a, b, sa, sb, alpha, out)
        nan = torch.isnan(out.float())
        ok = bool(nan[:, 37].all()) and int(nan.sum()) == 7
        raw["check"].append(dict(variant=v.name, nan_propagation=ok))
        print(f"check {v.name} NaN block scale -> its column only: {ok}", flush=True)


def timing(variants: list[Variant], ms: tuple[int, ...], shapes: tuple, ceil: bench_ops.Ceilings, raw: dict) -> None:
    for m, n, k, x, a, sa, alpha, weights, w_t in bench_ops._rotating_points(shapes, ms):
        alpha = alpha.float().reshape(1)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        us = {"cublas_bf16": bench_ops.bench_graph([lambda wt=wt: torch.mm(x, wt) for wt in w_t]) * 1e3,
              "triton": bench_ops.bench_graph([lambda wq=wq, wsq=wsq: mm_fp4_triton(a, wq, sa, wsq, alpha, torch.bfloat16)
                                               for wq, wsq, _ in weights]) * 1e3}
        best_split, same = {}, {}
        for v in variants:
            for splits in v.splits(SPLITS, k):
                launch = Launch(v, n, splits, a.device)
                t = bench_ops.bench_graph([lambda wq=wq, wsq=wsq: launch(a, wq, sa, wsq, alpha, out)
                                           for wq, wsq, _ in weights]) * 1e3
                if t < us.get(v.name, float("inf")):
                    us[v.name], best_split[v.name] = t, splits
            if v.exact and v.name in best_split:
                wq, wsq, _ = weights[0]
                got, ref = (torch.full((m, n), float("nan"), device="cuda") for _ in range(2))
                Launch(v, n, best_split[v.name], a.device)(a, wq, sa, wsq, alpha, got)
                Launch(v.plain(), n, best_split[v.name], a.device)(a, wq, sa, wsq, alpha, ref)
                same[v.name] = torch.equal(got, ref)
        floor = bench_ops.weight_floor_us(ceil, n, k)
        raw["time"].append(dict(m=m, n=n, k=k, us=us, best_split=best_split, floor_us=floor, bitwise_plain=same))
        line = ", ".join(f"{v.name} {us[v.name]:.1f} (split {best_split[v.name]}, {us['triton'] / us[v.name]:.2f}x Triton"
                         + (f", bitwise plain {same[v.name]}" if v.name in same else "") + ")" for v in variants
                         if v.name in us)
        print(f"time {m}x{n}x{k}: floor {floor:.1f} us, cuBLAS bf16 {us['cublas_bf16']:.1f} us, "
              f"Triton {us['triton']:.1f} us | {line}", flush=True)


def stream(shapes: tuple, ceil: bench_ops.Ceilings, raw: dict) -> None:
    """The plain streaming kernel over each shape's NVFP4 weight bytes, best of its grid shapes."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    source = open(STREAM_SOURCE).read()
    kernels = {u: torch.cuda._compile_kernel(f"#define UNROLL {u}\n" + source, "stream_read") for u in (2, 4, 8)}
    for n, k in shapes:
        nbytes = n * k // 2 + n * k // 16
        bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(bench_ops.ROTATIONS)]
        best = (float("inf"), None)
        for unroll, kernel in kernels.items():
            for per_sm in (1, 2, 4, 8):
                for threads in (256, 512):
                    grid = sms * per_sm
                    out = torch.empty(grid * threads, dtype=torch.int32, device="cuda")
                    t = bench_ops.bench_graph([lambda b=b, kernel=kernel, grid=grid, threads=threads, out=out: kernel(
                        grid=(grid, 1, 1), block=(threads, 1, 1), args=[b, nbytes // 16, out]) for b in bufs]) * 1e3
                    best = min(best, (t, (unroll, per_sm, threads)))
        floor = bench_ops.weight_floor_us(ceil, n, k)
        raw["stream"].append(dict(n=n, k=k, bytes=nbytes, floor_us=floor, us=best[0], unroll_ctas_per_sm_threads=best[1]))
        print(f"stream {n}x{k}: {nbytes / 1e6:.1f} MB, floor {floor:.1f} us, streaming kernel {best[0]:.1f} us "
              f"({nbytes / best[0] / 1e3:.0f} GB/s; unroll, CTAs a multiprocessor, threads {best[1]})", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--time", action="store_true")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--ms", default="1,16")
    p.add_argument("--shapes", help="N x K points, comma-separated (default: SHAPES)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    shapes = SHAPES if not args.shapes else tuple(tuple(int(d) for d in s.split("x")) for s in args.shapes.split(","))
    raw: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "check": [], "time": [],
                 "stream": []}
    if args.time or args.stream:  # the copy bandwidth both floors are taken at, measured once
        ceil = bench_ops.measure_ceilings()
        raw["copy_gbs"] = ceil.copy_gbs
        print(f"copy bandwidth {ceil.copy_gbs:.0f} GB/s", flush=True)
    if args.check or args.time:
        t0 = time.time()
        variants = [Variant(spec) for spec in args.variants.split(",")]
        print(f"compiled {len(variants)} variants with NVRTC in {time.time() - t0:.1f} s", flush=True)
        if args.check:
            check(variants, raw)
        if args.time:
            timing(variants, tuple(int(v) for v in args.ms.split(",")), shapes, ceil, raw)
    if args.stream:
        stream(shapes, ceil, raw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
