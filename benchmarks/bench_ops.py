"""Benchmark fp4fuse's single-GPU ops against same-process baselines; writes a dated markdown table.

    PYTHONPATH=. python benchmarks/bench_ops.py [--out results.md] [--sweep] [--json raw.json]

Measured (medians of CUDA-event timings via ``triton.testing.do_bench``, which clears the L2 before
every timed call, so weights are read from HBM as in a real decode step):

1. Ceilings: device-to-device copy bandwidth (bytes read + written) and cuBLAS bf16 8192^3 rate.
2. ``scaled_fp4_quant`` on 16384x8192 bf16 (bytes: read x + write q + s) as % of the copy
   bandwidth, for every exact division mode with its SASS instructions per element; RMSNorm on
   the same shape; RMSNorm (+ residual add) + quantize fused vs the two Triton kernels back to
   back. ``run_quant_norm()`` runs only this part.
3. ``mm_fp4`` at M in {1, 16, 128, 1024, 8192} x (N, K) in {(8192, 8192), (28672, 8192),
   (8192, 28672)} against cuBLAS bf16 ``torch.mm`` on the same shapes and against a naive torch
   dequantize-then-matmul (table lookup + repeat_interleave of the scales + torch.mm), with the
   floor max(bytes / copy bandwidth, flops / cuBLAS rate). Small M is also timed as CUDA-graph
   replays over 4 rotating weight copies (no launch gaps, weights cold in L2).
4. ``--sweep``: the launch-configuration sweep that chose the defaults in triton_mm.py and
   triton_quant.py (printed and written to the JSON).
5. ``--decode-sweep`` (only this, after the ceilings): the one-launch decode GEMM
   (``fp4fuse.kernels.triton.mm_decode``) over a grid of launch configurations at the TP=2
   Llama-3-8B shard shapes and the 8192/28672 shapes, M in {1, 16, 64, 128}, against the current
   ``mm_fp4_triton`` and cuBLAS bf16, with ``do_bench`` (L2 cleared) and as CUDA-graph replays over
   rotating weight copies; one summary line per (shape, M) with the best configuration, the
   default's time and the floor (fp4 weight + scale bytes / copy bandwidth).
6. ``--wide-step-sweep`` (only this, after the ceilings): the decode GEMM at M in {1, 16, 32, 64}:
   the shipped configuration, the 128-K-step rule and the 256-K-step tile at several split counts,
   as CUDA-graph replays against cuBLAS bf16 (``wide_step_sweep``).
7. ``--mid-sweep`` (only this, after the ceilings): M in 64..2048 at Llama-3-8B's TP=1 linear shapes
   and 8192^2, every GEMM path as CUDA-graph replays over rotating weights: the shipped dispatch,
   the tiled kernel, dequantize + cuBLAS, the decode kernel at several tiles with and without the
   pre-decoded activation, and cuBLAS bf16.
8. ``--scale-words-sweep`` (only this, after the ceilings): the decode GEMM's shipped configuration at
   M <= 64 with the activation's block scales loaded as int32 words and byte by byte
   (``scale_words_sweep``).
9. ``--dequant-sweep`` (only this, after the ceilings): the dequantize + cuBLAS path's weight
   dequantization at several launch configurations against a copy of the same bytes
   (``dequant_sweep``).
10. ``--hopper-sweep`` (only this, after the ceilings): M in 257..4096 at the issue-12 shapes and
    Llama-3-8B's TP=2 shard shapes: the Hopper Gluon GEMM (``fp4fuse.kernels.triton.mm_hopper``,
    both token tiles) against the shipped dispatch, dequantize + cuBLAS and cuBLAS bf16, as
    CUDA-graph replays (``hopper_sweep``).
11. ``--quant-sweep`` (only this, after the ceilings): the quantization's launches on 16384x8192
    bf16 -- blocks per program, warps, one chunk a program or a persistent grid -- as % of the copy
    bandwidth, each output compared bitwise with the shipped launch's (``quant_sweep``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

import torch
import triton
from triton.testing import do_bench

import fp4fuse  # noqa: F401  (registers torch.ops.fp4fuse)
from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.kernels.triton import mm as triton_mm, mm_decode, quant as triton_quant

logger = logging.getLogger(__name__)

MM_MS = (1, 16, 128, 1024, 8192)
MM_SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672))
GRAPH_MAX_M = 128
ROTATIONS = 4


def script_args(doc: str, argv: list[str] | None, flags: tuple[str, ...] = ()) -> argparse.Namespace | None:
    """The arguments of a GPU benchmark script documented by ``doc``: ``--json`` and ``flags``
    (each a switch). None, after a line on stderr, where there is no CUDA GPU."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flag in flags:
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--json", help="raw results as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{os.path.basename(sys.argv[0])} needs a CUDA GPU", file=sys.stderr)
        return None
    return args


def write_raw(path: str | None, **results: Any) -> None:
    """``results`` as JSON at ``path`` (nothing where None), after the device and the torch and
    Triton versions."""
    if path:
        raw = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               **results}
        with open(path, "w") as f:
            json.dump(raw, f, indent=1)


def patched_module(module: Any, name: str, replacements: dict[str, str], directory: str) -> Any:
    """A copy of ``module`` whose source has each key of ``replacements`` (found verbatim exactly once,
    or RuntimeError) replaced by its value, written to ``directory`` as ``{name}.py`` and imported from
    there (Triton reads a kernel's source from its file)."""
    import importlib.util
    source = open(module.__file__).read()
    for old, new in replacements.items():
        if source.count(old) != 1:
            raise RuntimeError(f"patched_module({name}): {module.__name__}'s source changed; this text is not "
                               f"there exactly once:\n{old}")
        source = source.replace(old, new)
    path = os.path.join(directory, f"{name}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    copy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy  # dataclasses look their module up while it executes
    spec.loader.exec_module(copy)
    return copy


def bench(fn, warmup: int = 10, rep: int = 40) -> float:
    """Median milliseconds of ``fn`` (L2 cleared before each call)."""
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fns: list, reps: int = 20) -> float:
    """Milliseconds per call of ``fns`` (called in rotation) replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for fn in fns:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(fns)))
    return sorted(times)[len(times) // 2]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gs = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    q, s = torch.ops.fp4fuse.scaled_fp4_quant(x, gs)
    return q, s, gs


_LUT = {}


def naive_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The emulation fp4fuse replaces: table lookup of codes, repeat_interleave of the scales."""
    if q.device not in _LUT:
        _LUT[q.device] = nvfp4._E2M1_TABLE.to(device=q.device, dtype=torch.bfloat16)
    codes = torch.stack((q & 0xF, q >> 4), dim=-1).flatten(-2)
    return _LUT[q.device][codes.long()] * s.to(torch.bfloat16).repeat_interleave(16, dim=1)


def naive_mm(a, b, sa, sb, alpha):
    return (naive_dequant(a, sa) @ naive_dequant(b, sb).t()) * alpha


@dataclasses.dataclass
class Ceilings:
    copy_gbs: float
    mm_tflops: float


def measure_ceilings() -> Ceilings:
    n = 1 << 29  # 1 GiB of bf16 per buffer
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ms = bench(functools.partial(torch.empty_like(src).copy_, src))
    copy_gbs = 2 * src.numel() * 2 / ms / 1e6
    src = None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench(functools.partial(torch.mm, a, b))
    return Ceilings(copy_gbs=copy_gbs, mm_tflops=2 * 8192 ** 3 / ms / 1e9)


def _op_row(op: str, shape: str, ms: float, floor_ms: float, **extra) -> dict:
    row = {"op": op, "shape": shape, "ms": ms, "floor_ms": floor_ms, "pct_copy": 100 * floor_ms / ms, **extra}
    note = "".join(f", {k} {v}" for k, v in extra.items())
    print(f"{op} {shape}: {ms * 1e3:.1f} us, {row['pct_copy']:.0f}% of copy bandwidth{note}", flush=True)
    return row


def bench_quant(ceil: Ceilings, rows: list[dict]) -> None:
    """Quantization (every QuantDivision mode, with its SASS instructions per element), the norms, and
    RMSNorm + quantize fused vs the two Triton kernels back to back. % of copy bandwidth counts the
    bytes the op must move: read x (+ residual), write q + s (+ residual_out / norm output)."""
    from fp4fuse.kernels.triton import norm as triton_norm, norm_quant as triton_norm_quant
    m, k = 16384, 8192
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gs = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    qs_bytes = m * k // 2 + m * k // 16
    floor_ms = (m * k * 2 + qs_bytes) / ceil.copy_gbs / 1e6
    shape = f"{m}x{k} bf16"
    first = None
    for div in triton_quant.QuantDivision:
        counts = triton_quant.quant_sass_counts(div, x.dtype)
        ms = bench(functools.partial(triton_quant.scaled_fp4_quant_triton, x, gs, division=div))
        q, s = triton_quant.scaled_fp4_quant_triton(x, gs, division=div)
        first = first or (q, s.view(torch.uint8))
        same = torch.equal(q, first[0]) and torch.equal(s.view(torch.uint8), first[1])
        default = ", default" if div == triton_quant.DEFAULT_DIVISION else ""
        rows.append(_op_row(f"scaled_fp4_quant ({div.name}{default})", shape, ms, floor_ms,
                            sass_per_element=round(counts["loop_per_element"], 1), sass_loop=counts["loop"],
                            sass_total=counts["total"], same_bits_as_first_mode=same))
    w = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    eps = 1e-6
    ms = bench(functools.partial(torch.ops.fp4fuse.rms_norm, x, w, eps))
    rows.append(_op_row("rms_norm", shape, ms, (2 * m * k * 2) / ceil.copy_gbs / 1e6))
    ms = bench(functools.partial(triton_norm.rms_norm_amax_triton, x, w, eps))
    rows.append(_op_row("rms_norm + amax (Triton)", shape, ms, (2 * m * k * 2) / ceil.copy_gbs / 1e6))
    ms = bench(functools.partial(torch.ops.fp4fuse.fused_add_rms_norm, x, r, w, eps))
    rows.append(_op_row("fused_add_rms_norm", shape, ms, (4 * m * k * 2) / ceil.copy_gbs / 1e6))

    # RMSNorm + quantize: the floor is the fused op's traffic (the pair also writes and re-reads the norm output)
    def pair():
        return triton_quant.scaled_fp4_quant_triton(triton_norm.rms_norm_triton(x, w, eps), gs)

    def add_pair():
        out, res = triton_norm.fused_add_rms_norm_triton(x, r, w, eps)
        return (*triton_quant.scaled_fp4_quant_triton(out, gs), res)

    fused = functools.partial(triton_norm_quant.rms_norm_fp4_quant_triton, x, w, eps, gs)
    add_fused = functools.partial(triton_norm_quant.fused_add_rms_norm_fp4_quant_triton, x, r, w, eps, gs)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fused(), pair()))
    add_same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(add_fused(), add_pair()))
    floor_ms = (m * k * 2 + qs_bytes) / ceil.copy_gbs / 1e6
    rows.append(_op_row("rms_norm -> scaled_fp4_quant (2 Triton kernels)", shape, bench(pair), floor_ms))
    rows.append(_op_row("rms_norm_fp4_quant (fused)", shape, bench(fused), floor_ms, bit_equal_to_pair=same))
    floor_ms = (3 * m * k * 2 + qs_bytes) / ceil.copy_gbs / 1e6
    rows.append(_op_row("fused_add_rms_norm -> scaled_fp4_quant (2 Triton kernels)", shape, bench(add_pair), floor_ms))
    rows.append(_op_row("fused_add_rms_norm_fp4_quant (fused)", shape, bench(add_fused), floor_ms,
                        bit_equal_to_pair=add_same))


def run_quant_norm() -> None:
    """Only the quantization / norm part (under a minute on an H100):
    ``PYTHONPATH=. python -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_ops; bench_ops.run_quant_norm()"``"""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; Triton {triton.__version__}", flush=True)
    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbs:.0f} GB/s", flush=True)
    bench_quant(ceil, [])


def _mm_row(ceil: Ceilings, m: int, n: int, k: int, weights: list, w_bf16: list) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a, sa, ga = quantize(x)
    b, sb, gb = weights[0]
    alpha = 1.0 / (ga * gb)
    fp4_op = torch.ops.fp4fuse.mm_fp4
    w_t = [w.t() for w in w_bf16]
    row = {"m": m, "n": n, "k": k}
    row["fp4_ms"] = bench(functools.partial(fp4_op, a, b, sa, sb, alpha, torch.bfloat16))
    row["bf16_ms"] = bench(functools.partial(torch.mm, x, w_t[0]))
    row["naive_ms"] = bench(functools.partial(naive_mm, a, b, sa, sb, alpha), warmup=3, rep=10)
    row["tiled_ms"] = row["dequant_mm_ms"] = float("nan")
    if m >= 128:
        cfg = triton_mm.mm_config_for(m, n, k, a.device)
        row["tiled_ms"] = bench(functools.partial(triton_mm.mm_fp4_tiled, a, b, sa, sb, alpha, torch.bfloat16, cfg))
        row["dequant_mm_ms"] = bench(functools.partial(triton_mm.mm_fp4_dequant_mm, a, b, sa, sb, alpha))
    row["graph_fp4_ms"] = row["graph_bf16_ms"] = float("nan")
    if m <= GRAPH_MAX_M:
        row["graph_fp4_ms"] = bench_graph([
            functools.partial(fp4_op, a, wq, sa, wsq, alpha, torch.bfloat16) for wq, wsq, _ in weights])
        row["graph_bf16_ms"] = bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t])
    nbytes = (m + n) * k // 2 + (m + n) * k // 16 + m * n * 2
    row["floor_ms"] = max(nbytes / ceil.copy_gbs / 1e6, 2 * m * n * k / ceil.mm_tflops / 1e9)
    row["vs_bf16"] = row["bf16_ms"] / row["fp4_ms"]
    row["vs_naive"] = row["naive_ms"] / row["fp4_ms"]
    row["graph_vs_bf16"] = row["graph_bf16_ms"] / row["graph_fp4_ms"]
    return row


def bench_mm(ceil: Ceilings, rows: list[dict]) -> None:
    for n, k in MM_SHAPES:
        weights = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(ROTATIONS)]
        w_bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        for m in MM_MS:
            rows.append(_mm_row(ceil, m, n, k, weights, w_bf16))
            logger.info("mm %s", rows[-1])
        weights = w_bf16 = None
        torch.cuda.empty_cache()


def _sweep_case(m: int, n: int, k: int, weight: tuple, configs: list, splits: tuple) -> list[dict]:
    b, sb, gb = weight
    a, sa, ga = quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    alpha = 1.0 / (ga * gb)
    out = []
    best = None
    for base in configs:
        for split in splits:
            cfg = dataclasses.replace(base, split_k=split)
            fn = functools.partial(triton_mm.mm_fp4_tiled, a, b, sa, sb, alpha, torch.bfloat16, cfg)
            try:
                ms = bench(fn, warmup=5, rep=20)
            except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError) as exc:
                logger.warning("config %s failed: %s", cfg, exc)
                continue
            out.append({"m": m, "n": n, "k": k, "cfg": dataclasses.asdict(cfg), "ms": ms})
            if best is None or ms < best[1]:
                best = (cfg, ms)
    default = triton_mm.mm_config_for(m, n, k, a.device)
    d_ms = bench(functools.partial(triton_mm.mm_fp4_tiled, a, b, sa, sb, alpha, torch.bfloat16, default),
                 warmup=5, rep=20)
    deq = bench(functools.partial(triton_mm.mm_fp4_dequant_mm, a, b, sa, sb, alpha), warmup=5, rep=20)
    print(f"sweep m={m} n={n} k={k}: best {best[1] * 1e3:.1f} us {best[0]}  default {d_ms * 1e3:.1f} us "
          f"{default}  dequant+mm {deq * 1e3:.1f} us", flush=True)
    out.append({"m": m, "n": n, "k": k, "best": dataclasses.asdict(best[0]), "best_ms": best[1],
                "default_ms": d_ms, "dequant_mm_ms": deq})
    return out


def sweep(raw: dict) -> None:
    """Launch-configuration sweep (chose the defaults in triton_mm.py / triton_quant.py)."""
    cfg = triton_mm.MMConfig
    tiny = [cfg(16, 128, 8, 1, 4, 3), cfg(16, 256, 8, 1, 8, 3), cfg(16, 64, 8, 1, 4, 3), cfg(16, 128, 4, 1, 4, 4),
            cfg(64, 128, 4, 1, 4, 4), cfg(64, 64, 8, 1, 4, 3)]
    small = [cfg(64, 128, 4, 1, 4, 4), cfg(64, 64, 8, 1, 4, 3), cfg(64, 128, 8, 1, 4, 4), cfg(32, 128, 8, 1, 4, 3),
             cfg(64, 256, 4, 1, 4, 3)]
    large = [cfg(128, 128, 8, 1, 8, 3), cfg(128, 256, 8, 1, 8, 3), cfg(128, 128, 4, 1, 8, 4), cfg(64, 256, 4, 1, 4, 3),
             cfg(128, 256, 4, 1, 8, 4)]
    cases = [(1, 8192, 8192), (16, 8192, 8192), (64, 8192, 8192), (16, 28672, 8192), (16, 8192, 28672),
             (128, 8192, 8192), (256, 8192, 8192), (512, 8192, 8192), (1024, 8192, 8192), (2048, 8192, 8192),
             (128, 28672, 8192), (1024, 28672, 8192)]
    out = []
    weight, weight_shape = None, None
    for m, n, k in cases:
        if weight_shape != (n, k):
            weight = None
            torch.cuda.empty_cache()
            weight, weight_shape = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)), (n, k)
        configs = tiny if m <= 16 else small if m <= 64 else large
        splits = (1, 2, 4, 8) if m < 512 else (1, 2)
        out += _sweep_case(m, n, k, weight, configs, splits)
    weight = None
    out += _quant_configs(None)
    q, s = quantize(torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16))[:2]
    for blocks, warps in ((256, 8), (512, 8), (1024, 8), (1024, 16), (2048, 16)):
        ms = bench(functools.partial(triton_mm.dequantize_fp4_triton, q, s, config=(blocks, warps)))
        print(f"sweep dequant 8192x8192 blocks={blocks} warps={warps}: {ms * 1e3:.1f} us", flush=True)
        out.append({"dequant_blocks": blocks, "warps": warps, "ms": ms})
    raw["sweep"] = out


#: Quantization launches the sweeps time: (BLOCKS, num_warps) -- 1 or 2 blocks of 16 per thread
#: (quant.MAX_BLOCKS_PER_THREAD) -- each with one chunk per program or a persistent grid of this
#: many programs per multiprocessor.
QUANT_LAUNCHES = ((128, 4), (256, 4), (256, 8), (512, 8), (64, 2), (128, 2))
QUANT_SWEEP_PROGRAMS_PER_SM = (None, 8, 12, 16)


def _quant_configs(ceil: Ceilings | None) -> list[dict]:
    """``scaled_fp4_quant_triton`` on a 16384 x 8192 bf16 input at each launch of QUANT_LAUNCHES x
    QUANT_SWEEP_PROGRAMS_PER_SM (L2 cleared before each call), with its share of the copy bandwidth where
    ``ceil`` is given; every launch's output is checked against the shipped launch's."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
    gs = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    n_blocks = x.numel() // 16
    moved = x.numel() * 2 + x.numel() // 2 + x.numel() // 16
    q0, s0 = triton_quant.scaled_fp4_quant_triton(x, gs)
    rows = []
    for blocks, warps in QUANT_LAUNCHES:
        for per_sm in QUANT_SWEEP_PROGRAMS_PER_SM:
            programs = triton.cdiv(n_blocks, blocks) if per_sm is None else per_sm * sms
            fn = functools.partial(triton_quant.scaled_fp4_quant_triton, x, gs, config=(blocks, warps, programs))
            q, s = fn()
            same = torch.equal(q, q0) and torch.equal(s.view(torch.uint8), s0.view(torch.uint8))
            ms = bench(fn)
            share = f", {moved / ceil.copy_gbs / 1e6 / ms:.0%} of copy" if ceil else ""
            print(f"quant blocks={blocks} warps={warps} programs/SM={per_sm or 'all chunks'}: {ms * 1e3:.1f} us"
                  f"{share}, same bits {same}", flush=True)
            rows.append({"quant_blocks": blocks, "warps": warps, "programs_per_sm": per_sm, "ms": ms,
                         "same_bits_as_default": same})
    return rows


def quant_sweep(ceil: Ceilings, raw: dict) -> None:
    """``--quant-sweep``: the quantization launches of ``_quant_configs``."""
    raw["quant_sweep"] = _quant_configs(ceil)


DECODE_SHAPES = ((3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168), (8192, 8192), (28672, 8192),
                 (8192, 28672))
DECODE_MS = (1, 16, 64, 128)
_DC = mm_decode.DecodeConfig
#: Tile variants per activation block (block_m, block_n, block_k, split_k placeholder, warps,
#: stages, register cap); each is timed at several split counts. The first of each is the default
#: rule's tile, the others its neighbours; all compile for sm_90 with Triton 3.6 (only the
#: 128-register cap of the 128x128 tile spills, 24 bytes).
DECODE_TILES = {
    16: (_DC(16, 128, 128, 1, 4, 3, 128), _DC(16, 128, 128, 1, 4, 3), _DC(16, 64, 128, 1, 4, 3),
         _DC(16, 256, 128, 1, 4, 3), _DC(16, 256, 128, 1, 8, 3, 128), _DC(16, 128, 128, 1, 4, 4, 128)),
    64: (_DC(64, 128, 128, 1, 4, 3), _DC(64, 64, 128, 1, 4, 3), _DC(64, 256, 128, 1, 8, 3),
         _DC(64, 128, 128, 1, 4, 4)),
    128: (_DC(128, 128, 128, 1, 8, 3), _DC(128, 128, 128, 1, 8, 3, 128), _DC(64, 128, 128, 1, 4, 3),
          _DC(128, 256, 128, 1, 8, 3)),
}


def _decode_splits(cfg: mm_decode.DecodeConfig, m: int, n: int, k: int, sms: int) -> list[int]:
    """Split counts to time for one tile: powers of two up to 16, the default rule's pick, and
    none that gives more than 8 programs per multiprocessor or fewer than 2 K steps per split."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    steps = triton.cdiv(k // 2, cfg.block_k // 2)
    default = mm_decode.decode_config_for(m, n, k, sms).split_k
    cands = sorted({1, 2, 4, 8, 16, default})
    return [s for s in cands if s == 1 or (tiles * s <= 8 * sms and steps >= 2 * s)]


def weight_floor_us(ceil: Ceilings, n: int, k: int) -> float:
    """Microseconds to read an ``[n, k]`` NVFP4 weight (codes + e4m3 scales) at the copy bandwidth."""
    return (n * k // 2 + n * k // 16) / ceil.copy_gbs / 1e3


def decode_graph_ms(a: torch.Tensor, sa: torch.Tensor, alpha: torch.Tensor, weights: list,
                    cfg: mm_decode.DecodeConfig, module: Any = mm_decode) -> float:
    """Milliseconds per call of the decode GEMM under ``cfg`` on the activation ``(a, sa)``, replayed
    from one CUDA graph over the rotating ``weights`` (``quantize`` triples), with its own workspace.
    ``module``: ``mm_decode`` or a copy of it (``bench_split_k_tail.py``'s variants), whose own
    ``DecodeConfig`` gets ``cfg``'s fields."""
    m, n, k = a.shape[0], weights[0][0].shape[0], a.shape[1] * 2
    cfg = module.DecodeConfig(**dataclasses.asdict(cfg))
    ws = module.empty_decode_workspace(*module.decode_workspace_numel(m, n, k, cfg), a.device)
    return bench_graph([functools.partial(module.mm_fp4_decode, a, wq, sa, wsq, alpha, torch.bfloat16, cfg, ws)
                        for wq, wsq, _ in weights])


def _rotating_points(shapes: tuple, ms: tuple):
    """For each ``(n, k)`` of ``shapes`` and M of ``ms``: ``(m, n, k, x, a, sa, alpha, weights, w_t)``,
    with ROTATIONS quantized weight copies, as many bf16 ones (``w_t``, transposed for ``torch.mm``) and
    a fresh bf16 activation ``x`` and its quantization; the weights are freed after each shape."""
    for n, k in shapes:
        weights = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(ROTATIONS)]
        w_t = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() for _ in range(ROTATIONS)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, sa, ga = quantize(x)
            yield m, n, k, x, a, sa, 1.0 / (ga * weights[0][2]), weights, w_t
        weights = w_t = None
        torch.cuda.empty_cache()


def _decode_point(ceil: Ceilings, m: int, n: int, k: int, weights: list, w_bf16: list, sms: int) -> dict:
    """Time one (shape, M): every config of the grid (do_bench), then the best and the default
    config, the current kernel and cuBLAS bf16 also as CUDA-graph replays."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a, sa, ga = quantize(x)
    b, sb, gb = weights[0]
    alpha = 1.0 / (ga * gb)
    default = mm_decode.decode_config_for(m, n, k, sms)
    tiles = DECODE_TILES[16 if m <= 16 else 64 if m <= 64 else 128]
    configs = [default] + [dataclasses.replace(t, split_k=s) for t in tiles for s in _decode_splits(t, m, n, k, sms)]
    timed: list[tuple[mm_decode.DecodeConfig, float]] = []
    for cfg in dict.fromkeys(configs):
        ws = mm_decode.empty_decode_workspace(*mm_decode.decode_workspace_numel(m, n, k, cfg), a.device)
        fn = functools.partial(mm_decode.mm_fp4_decode, a, b, sa, sb, alpha, torch.bfloat16, cfg, ws)
        try:
            ms = bench(fn, warmup=5, rep=20)
        except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError) as exc:
            print(f"  skip {_cfg_str(cfg)}: {type(exc).__name__}", flush=True)
            continue
        timed.append((cfg, ms))
        print(f"  m={m} n={n} k={k} {_cfg_str(cfg)}: {ms * 1e3:.1f} us", flush=True)
    if not timed:
        raise RuntimeError(f"decode sweep m={m} n={n} k={k}: no configuration ran")
    best_cfg, best_ms = min(timed, key=lambda t: t[1])
    if default not in dict(timed):
        default = best_cfg
    default_ms = dict(timed)[default]

    def graph_decode(cfg):
        return decode_graph_ms(a, sa, alpha, weights, cfg)

    w_t = [w.t() for w in w_bf16]
    row = {"m": m, "n": n, "k": k, "best_cfg": dataclasses.asdict(best_cfg), "best_us": best_ms * 1e3,
           "default_cfg": dataclasses.asdict(default), "default_us": default_ms * 1e3,
           "current_us": bench(functools.partial(triton_mm.mm_fp4_triton, a, b, sa, sb, alpha, torch.bfloat16),
                               warmup=5, rep=20) * 1e3,
           "bf16_us": bench(functools.partial(torch.mm, x, w_t[0]), warmup=5, rep=20) * 1e3,
           "graph_best_us": graph_decode(best_cfg) * 1e3,
           "graph_default_us": graph_decode(default) * 1e3,
           "graph_current_us": bench_graph([functools.partial(triton_mm.mm_fp4_triton, a, wq, sa, wsq, alpha,
                                                              torch.bfloat16) for wq, wsq, _ in weights]) * 1e3,
           "graph_bf16_us": bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t]) * 1e3,
           "floor_us": weight_floor_us(ceil, n, k),
           "all": [{"cfg": dataclasses.asdict(c), "us": t * 1e3} for c, t in timed]}
    row["graph_vs_bf16"] = row["graph_bf16_us"] / row["graph_best_us"]
    print(f"DECODE m={m:<3d} n={n:<5d} k={k:<5d} best {row['best_us']:6.1f} us {_cfg_str(best_cfg)} | "
          f"default {row['default_us']:6.1f} | current {row['current_us']:6.1f} | bf16 {row['bf16_us']:6.1f} | "
          f"graph: best {row['graph_best_us']:6.1f} default {row['graph_default_us']:6.1f} "
          f"current {row['graph_current_us']:6.1f} bf16 {row['graph_bf16_us']:6.1f} "
          f"({row['graph_vs_bf16']:.2f}x) | floor {row['floor_us']:5.1f} us", flush=True)
    return row


def _cfg_str(cfg: mm_decode.DecodeConfig) -> str:
    cap = f",r{cfg.max_registers}" if cfg.max_registers else ""
    words = ",words" if cfg.scale_words else ""
    return f"[{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}{cap}{words}]"


def decode_sweep(ceil: Ceilings, raw: dict) -> None:
    """``--decode-sweep``: module docstring, item 5."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for n, k in DECODE_SHAPES:
        weights = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(ROTATIONS)]
        w_bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        for m in DECODE_MS:
            rows.append(_decode_point(ceil, m, n, k, weights, w_bf16, sms))
        weights = w_bf16 = None
        torch.cuda.empty_cache()
    raw["decode_sweep"] = rows
    print("\nsummary (us; graph = CUDA-graph replay over rotating weights; speedup = graph bf16 / graph best)")
    print(f"{'M':>4} {'N':>6} {'K':>6} {'best':>7} {'default':>8} {'current':>8} {'bf16':>7} {'g.best':>7} "
          f"{'g.cur':>7} {'g.bf16':>7} {'speedup':>8} {'floor':>6}  best config")
    for r in rows:
        print(f"{r['m']:>4} {r['n']:>6} {r['k']:>6} {r['best_us']:7.1f} {r['default_us']:8.1f} {r['current_us']:8.1f} "
              f"{r['bf16_us']:7.1f} {r['graph_best_us']:7.1f} {r['graph_current_us']:7.1f} {r['graph_bf16_us']:7.1f} "
              f"{r['graph_vs_bf16']:7.2f}x {r['floor_us']:6.1f}  {_cfg_str(_DC(**r['best_cfg']))}", flush=True)


#: (N, K) of the wide-step sweep: the decode shapes and Llama-3-8B's TP=1 qkv.
WIDE_SHAPES = DECODE_SHAPES + ((6144, 4096),)
WIDE_MS = (1, 16, 32, 64)
WIDE_SPLITS = (1, 2, 3, 4, 6, 8)


def wide_step_sweep(ceil: Ceilings, raw: dict) -> None:
    """``--wide-step-sweep`` (only this, after the ceilings): M in {1, 16, 32, 64} on WIDE_SHAPES as
    CUDA-graph replays over rotating weights: the shipped ``decode_config_for``, the 128-K-step rule
    (``narrow_step_config``), the 256-K-step tile of ``wide_step_config`` at every split in
    WIDE_SPLITS (at 64 rows with all 64 in one tile row), at 64 rows also ``wide_step_config``'s two
    32-row tiles at its filling split, and cuBLAS bf16; then one markdown row per point."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for m, n, k, x, a, sa, alpha, weights, w_t in _rotating_points(WIDE_SHAPES, WIDE_MS):
        def graph_us(cfg: mm_decode.DecodeConfig) -> float:
            return 1e3 * decode_graph_ms(a, sa, alpha, weights, cfg)

        # above WIDE_STEP_MAX_M rows: the 256-K-step tile with all the rows in one tile row, and
        # wide_step_config's own two 32-row tiles (what decode_config_for takes on small weights)
        wide = mm_decode.wide_step_config(m, n, k, sms) if m <= mm_decode.WIDE_STEP_MAX_M else \
            dataclasses.replace(mm_decode.wide_step_config(32, n, k, sms), block_m=64)
        shipped = mm_decode.decode_config_for(m, n, k, sms)
        narrow = mm_decode.narrow_step_config(m, n, k, sms)
        row = {"m": m, "n": n, "k": k, "bf16_us": 1e3 * bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t]),
               "floor_us": weight_floor_us(ceil, n, k),
               "shipped_cfg": _cfg_str(shipped), "shipped_us": graph_us(shipped),
               "narrow_cfg": _cfg_str(narrow), "narrow_us": graph_us(narrow),
               "wide_us": {s: graph_us(dataclasses.replace(wide, split_k=s)) for s in WIDE_SPLITS}}
        if m > mm_decode.WIDE_STEP_MAX_M:  # shipped on small weights: timed once
            two_tiles = mm_decode.wide_step_config(m, n, k, sms)
            row["two_tiles_cfg"] = _cfg_str(two_tiles)
            row["two_tiles_us"] = row["shipped_us"] if two_tiles == shipped else graph_us(two_tiles)
        rows.append(row)
        two = f" two 32-row tiles {row['two_tiles_us']:.1f} {row['two_tiles_cfg']}" if "two_tiles_us" in row else ""
        print(f"WIDE m={m} n={n} k={k}: bf16 {row['bf16_us']:.1f} shipped {row['shipped_us']:.1f} "
              f"{row['shipped_cfg']} narrow {row['narrow_us']:.1f} {row['narrow_cfg']}{two} wide "
              + " ".join(f"s{s} {t:.1f}" for s, t in row["wide_us"].items()), flush=True)
    raw["wide_step_sweep"] = rows
    print("\n| M | N | K | bf16 us | floor us | narrow-step rule us | shipped us | shipped config | shipped vs bf16 "
          "| shipped vs narrow | two 32-row tiles us | " + " | ".join(f"wide s{s}" for s in WIDE_SPLITS) + " |")
    print("| --- " * (11 + len(WIDE_SPLITS)) + "|")
    for r in rows:
        two = f"{r['two_tiles_us']:.1f}" if "two_tiles_us" in r else "-"
        print(f"| {r['m']} | {r['n']} | {r['k']} | {r['bf16_us']:.1f} | {r['floor_us']:.1f} | {r['narrow_us']:.1f} | "
              f"{r['shipped_us']:.1f} | `{r['shipped_cfg']}` | {r['bf16_us'] / r['shipped_us']:.2f}x | "
              f"{r['narrow_us'] / r['shipped_us']:.2f}x | {two} | "
              + " | ".join(f"{t:.1f}" for t in r["wide_us"].values()) + " |", flush=True)


#: (N, K) of the middle-range sweep: Llama-3-8B's linears at TP=1 (qkv, o, gate_up, down) and 8192^2.
MID_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192))
MID_MS = (64, 128, 256, 512, 1024, 2048)
#: Decode-kernel tiles tried in the middle range: (block_m, block_n, warps, predecode).
MID_TILES = ((64, 128, 4, False), (64, 128, 4, True), (128, 128, 8, False), (128, 128, 8, True),
             (128, 64, 4, True), (256, 64, 4, True), (128, 256, 8, True))


SCALE_WORDS_STAGES = (4, 5)


DEQUANT_SHAPES = ((8192, 8192), (14336, 4096), (4096, 7168))
DEQUANT_LAUNCHES = ((128, 4), (256, 4), (256, 8), (512, 8), (512, 16), (1024, 8), (1024, 16))


def dequant_sweep(ceil: Ceilings, raw: dict) -> None:
    """``--dequant-sweep`` (only this, after the ceilings): the weight dequantization of the
    dequantize + cuBLAS path (``dequantize_fp4_triton``) at each ``(BLOCKS, num_warps)`` of
    DEQUANT_LAUNCHES, against a device copy moving the same bytes (codes + scales read, bf16 written),
    ``do_bench`` with L2 cleared; one line per weight shape."""
    rows = []
    for n, k in DEQUANT_SHAPES:
        q, s = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))[:2]
        moved = q.numel() + s.numel() + n * k * 2
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        row = {"n": n, "k": k, "bytes": moved, "copy_us": 1e3 * bench(lambda: dst.copy_(src)),
               "launch_us": {f"{b}x{w}": 1e3 * bench(functools.partial(triton_mm.dequantize_fp4_triton, q, s,
                                                                        config=(b, w)))
                             for b, w in DEQUANT_LAUNCHES}}
        rows.append(row)
        print(f"dequant {n}x{k}: copy {row['copy_us']:.1f} us | "
              + " | ".join(f"{name} {us:.1f} us" for name, us in row["launch_us"].items()), flush=True)
    raw["dequant_sweep"] = rows


def scale_words_sweep(ceil: Ceilings, raw: dict) -> None:
    """``--scale-words-sweep`` (only this, after the ceilings): the decode GEMM's shipped configuration
    at M in WIDE_MS on WIDE_SHAPES as CUDA-graph replays over rotating weights, with the activation's
    block scales loaded as int32 words (``scale_words``) and byte by byte, and with words at
    SCALE_WORDS_STAGES pipeline stages, against cuBLAS bf16 and the floor; one markdown row per point."""
    rows = []
    for m, n, k, x, a, sa, alpha, weights, w_t in _rotating_points(WIDE_SHAPES, WIDE_MS):
        cfg = mm_decode.decode_config_for(m, n, k)

        def graph_us(words: bool, stages: int | None = None) -> float:
            run = dataclasses.replace(cfg, scale_words=words, num_stages=stages or cfg.num_stages)
            return 1e3 * decode_graph_ms(a, sa, alpha, weights, run)

        row = {"m": m, "n": n, "k": k, "cfg": _cfg_str(cfg),
               "bf16_us": 1e3 * bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t]),
               "floor_us": weight_floor_us(ceil, n, k),
               "bytes_us": graph_us(False), "words_us": graph_us(True),
               "words_stages": {st: graph_us(True, st) for st in SCALE_WORDS_STAGES}}
        rows.append(row)
        print(f"scale words {m}x{n}x{k}: bytes {row['bytes_us']:.1f} us, words {row['words_us']:.1f} us, "
              f"bf16 {row['bf16_us']:.1f} us", flush=True)
    raw["scale_words_sweep"] = rows
    print("\n| M | N | K | shipped config | bf16 us | floor us | byte-loaded scales us | word-loaded scales us "
          "| words vs bytes | words vs bf16 | words % of floor | "
          + " | ".join(f"words, {st} stages us" for st in SCALE_WORDS_STAGES) + " |")
    print("| --- " * (11 + len(SCALE_WORDS_STAGES)) + "|")
    for r in rows:
        print(f"| {r['m']} | {r['n']} | {r['k']} | `{r['cfg']}` | {r['bf16_us']:.1f} | {r['floor_us']:.1f} | "
              f"{r['bytes_us']:.1f} | {r['words_us']:.1f} | {r['bytes_us'] / r['words_us']:.2f}x | "
              f"{r['bf16_us'] / r['words_us']:.2f}x | {100 * r['floor_us'] / r['words_us']:.0f}% | "
              + " | ".join(f"{t:.1f}" for t in r["words_stages"].values()) + " |", flush=True)


def mid_sweep(ceil: Ceilings, raw: dict) -> None:
    """``--mid-sweep``: M = 64..2048 as CUDA-graph replays over rotating weights: the shipped
    dispatch, the tiled kernel, dequantize + cuBLAS, the decode kernel at several tiles (with and
    without the pre-decoded activation, split-K filling the machine) and cuBLAS bf16."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for n, k in MID_SHAPES:
        weights = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(ROTATIONS)]
        w_t = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() for _ in range(2)]
        for m in MID_MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, sa, ga = quantize(x)
            alpha = 1.0 / (ga * weights[0][2])
            cands = {
                "current": lambda wq, ws: triton_mm.mm_fp4_triton(a, wq, sa, ws, alpha, torch.bfloat16),
                "tiled": lambda wq, ws, c=triton_mm.mm_config_for(m, n, k, a.device):
                    triton_mm.mm_fp4_tiled(a, wq, sa, ws, alpha, torch.bfloat16, c),
                "dequant_mm": lambda wq, ws: triton_mm.mm_fp4_dequant_mm(a, wq, sa, ws, alpha),
            }
            for bm, bn, warps, pre in MID_TILES:
                if bm < m // 8 or bm > 2 * m:
                    continue
                tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                cfg = mm_decode.DecodeConfig(bm, bn, 128, mm_decode.filling_split(tiles, k, sms, mm_decode.PREDECODE_PROGRAMS_PER_SM), warps, 3,
                                             predecode=pre)
                ws_dec = mm_decode.empty_decode_workspace(*mm_decode.decode_workspace_numel(m, n, k, cfg), a.device)
                cands[_cfg_str(cfg) + ("p" if pre else "")] = (
                    lambda wq, ws, c=cfg, w=ws_dec: mm_decode.mm_fp4_decode(a, wq, sa, ws, alpha, torch.bfloat16, c, w))
            row = {"m": m, "n": n, "k": k, "us": {}}
            for name, fn in cands.items():
                try:
                    row["us"][name] = bench_graph([functools.partial(fn, wq, wsq) for wq, wsq, _ in weights]) * 1e3
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    print(f"  skip m={m} n={n} k={k} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            row["us"]["bf16"] = bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t]) * 1e3
            fp4 = {kk: v for kk, v in row["us"].items() if kk != "bf16"}
            best = min(fp4, key=fp4.get)
            row["best"] = best
            rows.append(row)
            us = row["us"]
            print(f"MID m={m:<5d} n={n:<6d} k={k:<6d} bf16 {us['bf16']:7.1f} | current {us.get('current', 0):7.1f} "
                  f"tiled {us.get('tiled', 0):7.1f} dequant {us.get('dequant_mm', 0):7.1f} | best {best} "
                  f"{us[best]:7.1f} ({us['bf16'] / us[best]:.2f}x bf16) | "
                  + " ".join(f"{kk}={v:.1f}" for kk, v in us.items() if kk.startswith("[")), flush=True)
        weights = w_t = None
        torch.cuda.empty_cache()
    raw["mid_sweep"] = rows


#: (N, K): the three issue-12 shapes, then Llama-3-8B's per-rank linears at TP=2 (q/k/v, o, gate/up, down).
HOPPER_SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672), (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168))
HOPPER_MS = (257, 512, 1024, 2048, 4096)


def hopper_sweep(ceil: Ceilings, raw: dict) -> None:
    """``--hopper-sweep``: M = 257..4096, bf16 output, as CUDA-graph replays over rotating weights: the
    shipped dispatch, the Hopper Gluon GEMM (256- and 128-token tiles), dequantize + cuBLAS and
    cuBLAS bf16; with the Gluon GEMM's rate in TFLOP/s."""
    hopper = triton_mm.hopper_kernels()
    rows = []
    for m, n, k, x, a, sa, alpha, weights, w_t in _rotating_points(HOPPER_SHAPES, HOPPER_MS):
        cands = {
            "shipped": lambda wq, ws: triton_mm.mm_fp4_triton(a, wq, sa, ws, alpha, torch.bfloat16),
            "hopper": lambda wq, ws: hopper.mm_fp4_hopper(a, wq, sa, ws, alpha, torch.bfloat16),
            "hopper_128": lambda wq, ws: hopper.mm_fp4_hopper(a, wq, sa, ws, alpha, torch.bfloat16, block_m=128),
            "dequant_mm": lambda wq, ws: triton_mm.mm_fp4_dequant_mm(a, wq, sa, ws, alpha),
        }
        us = {name: bench_graph([functools.partial(fn, wq, wsq) for wq, wsq, _ in weights]) * 1e3
              for name, fn in cands.items()}
        us["bf16"] = bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t]) * 1e3
        row = {"m": m, "n": n, "k": k, "us": us, "hopper_tflops": 2 * m * n * k / us["hopper"] / 1e6,
               "shipped_path": "hopper" if triton_mm.hopper_serves(m, n, k, torch.bfloat16, a.device) else "other"}
        rows.append(row)
        print(f"HOPPER m={m:<5d} n={n:<6d} k={k:<6d} " + " ".join(f"{kk}={v:.1f}" for kk, v in us.items())
              + f" | hopper {us['bf16'] / us['hopper']:.2f}x bf16, {us['dequant_mm'] / us['hopper']:.2f}x dequant, "
              f"{row['hopper_tflops']:.0f} TFLOP/s; shipped ({row['shipped_path']}) {us['bf16'] / us['shipped']:.2f}x bf16",
              flush=True)
    raw["hopper_sweep"] = rows


HOPPER_SPLIT_MS = (64, 128, 192, 256, 512, 1024)
#: Token tiles --hopper-split-sweep times (the smaller ones are --hopper-small-sweep's).
HOPPER_SPLIT_TILES = (64, 128, 256)


def _hopper_variants(hopper, m: int, n: int, k: int, sms: int) -> list[tuple[int, int]]:
    """``(block_m, split_k)`` pairs ``--hopper-split-sweep`` times at one point: each token tile of
    ``HOPPER_SPLIT_TILES`` up to twice M (the smallest always), without split-K, with
    ``hopper_split``'s count and with twice it."""
    variants = []
    for block_m in HOPPER_SPLIT_TILES:
        if block_m > 2 * m and block_m > HOPPER_SPLIT_TILES[0]:
            continue
        auto = hopper.hopper_split(m, n, k, sms, block_m)
        variants += [(block_m, s) for s in sorted({1, auto, min(2 * auto, hopper.MAX_SPLIT)})]
    return variants


def _hopper_point(a, sa, alpha, x, weights, w_t, variants: dict[str, dict]) -> tuple[dict[str, float], float]:
    """Microseconds of the shipped dispatch, cuBLAS bf16 and each ``mm_fp4_hopper`` variant (name ->
    its keyword arguments) at one point, as CUDA-graph replays over the rotating weights, and the
    variants' largest relative difference from the shipped path's output. A variant ptxas refuses
    (a register cap too low for its tile) is skipped with a line."""
    hopper = triton_mm.hopper_kernels()
    shipped = triton_mm.mm_fp4_triton(a, weights[0][0], sa, weights[0][1], alpha, torch.bfloat16).float()
    us = {"shipped": bench_graph([functools.partial(triton_mm.mm_fp4_triton, a, wq, sa, wsq, alpha, torch.bfloat16)
                                  for wq, wsq, _ in weights]) * 1e3,
          "bf16": bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t]) * 1e3}
    worst = 0.0
    for name, kwargs in variants.items():
        fn = functools.partial(hopper.mm_fp4_hopper, a, out_dtype=torch.bfloat16, alpha=alpha, a_scale=sa, **kwargs)
        try:
            got = fn(b=weights[0][0], b_scale=weights[0][1]).float()
        except triton.runtime.errors.TritonError as exc:
            print(f"  skip {name}: {type(exc).__name__}", flush=True)
            continue
        worst = max(worst, ((got - shipped).norm() / shipped.norm()).item())
        us[name] = bench_graph([functools.partial(fn, b=wq, b_scale=wsq) for wq, wsq, _ in weights]) * 1e3
    return us, worst


def hopper_sweep_main(argv: list[str] | None, doc: str, shapes: tuple, default_ms: tuple, variants, label: str,
                      raw_key: str, default_rounds: int = 1) -> int:
    """The ``main`` of a Hopper Gluon GEMM sweep script (``bench_hopper_stages.py``,
    ``bench_hopper_wide_step.py``, ``bench_hopper_scale_ahead.py``): ``--ms`` (default
    ``default_ms``), ``--shapes`` (default ``shapes``), ``--rounds`` (default ``default_rounds``) and
    ``--json``; at each ``shapes`` x M point ``variants(hopper, m, n, k, sms)`` (name ->
    ``mm_fp4_hopper`` keyword arguments) timed by :func:`_hopper_point` in each of the interleaved
    rounds (the median of the rounds per variant; with more than one, every round's times kept
    under ``"rounds"``), one ``label`` line a point, the rows written to the raw file under
    ``raw_key``. 2 where the machine has no CUDA GPU or no Gluon GEMM."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--ms", help="comma-separated row counts (default: %s)" % ",".join(map(str, default_ms)))
    parser.add_argument("--shapes", help="comma-separated NxK weight shapes (default: %s)"
                        % ",".join(f"{n}x{k}" for n, k in shapes))
    parser.add_argument("--rounds", type=int, default=default_rounds,
                        help="interleaved rounds a point (default: %d)" % default_rounds)
    parser.add_argument("--json", help="raw results as JSON")
    args = parser.parse_args(argv)
    if args.shapes:
        shapes = tuple(tuple(int(d) for d in s.split("x")) for s in args.shapes.split(","))
    if not torch.cuda.is_available():
        print("this sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    hopper = triton_mm.hopper_kernels()
    if hopper is None:
        print("no Hopper Gluon GEMM on this machine (sm_90 and Triton 3.6 needed)")
        return 2
    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else default_ms
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
    rows = []
    for m, n, k, x, a, sa, alpha, weights, w_t in _rotating_points(shapes, ms):
        timed = [_hopper_point(a, sa, alpha, x, weights, w_t, variants(hopper, m, n, k, sms))
                 for _ in range(args.rounds)]
        us = {key: statistics.median(t[key] for t, _ in timed) for key in timed[0][0]}
        worst = max(diff for _, diff in timed)
        every_round = {"rounds": [t for t, _ in timed]} if args.rounds > 1 else {}
        rows.append(_report_point(label, m, n, k, us, worst, every_round))
    write_raw(args.json, **{raw_key: rows})
    return 0


def _report_point(label: str, m: int, n: int, k: int, us: dict[str, float], worst: float, extra: dict) -> dict:
    """The row of one sweep point (its fastest Gluon variant against the shipped path and cuBLAS),
    printed as it comes."""
    best = min((kk for kk in us if kk not in ("shipped", "bf16")), key=us.get)
    print(f"{label} m={m:<5d} n={n:<6d} k={k:<6d} " + " ".join(f"{kk}={v:.1f}" for kk, v in us.items())
          + f" | best {best} {us['bf16'] / us[best]:.2f}x bf16, {us['shipped'] / us[best]:.2f}x shipped;"
          f" rel diff {worst:.1e}", flush=True)
    return {"m": m, "n": n, "k": k, **extra, "us": us, "best": best, "max_rel_diff_vs_shipped": worst}


def hopper_split_sweep(ceil: Ceilings, raw: dict) -> None:
    """``--hopper-split-sweep``: M = 64..1024, bf16 output, CUDA-graph replays over rotating weights:
    the Hopper Gluon GEMM's token tiles and split-K counts against the shipped dispatch and cuBLAS
    bf16, with each variant's largest relative difference from the shipped path's output."""
    hopper = triton_mm.hopper_kernels()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for m, n, k, x, a, sa, alpha, weights, w_t in _rotating_points(HOPPER_SHAPES, raw.get("ms") or HOPPER_SPLIT_MS):
        variants = {f"h{block_m}s{split}": {"block_m": block_m, "split_k": split}
                    for block_m, split in _hopper_variants(hopper, m, n, k, sms)}
        us, worst = _hopper_point(a, sa, alpha, x, weights, w_t, variants)
        rows.append(_report_point("SPLIT", m, n, k, us, worst, {}))
    raw["hopper_split_sweep"] = rows


HOPPER_SMALL_MS = (16, 32, 64)
#: Register caps --hopper-small-sweep tries: one, two and three programs per multiprocessor.
HOPPER_SMALL_REGISTERS = (168, 80, 56)


def hopper_small_sweep(ceil: Ceilings, raw: dict) -> None:
    """``--hopper-small-sweep``: M = 16..64, bf16 output, CUDA-graph replays over rotating weights:
    the Hopper Gluon GEMM with the smallest token tile holding M, register caps fitting 1-3
    programs per multiprocessor and split-K filling that many waves, against the shipped dispatch
    (the decode GEMM) and cuBLAS bf16; outputs compared with the shipped path's."""
    hopper = triton_mm.hopper_kernels()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for m, n, k, x, a, sa, alpha, weights, w_t in _rotating_points(HOPPER_SHAPES, raw.get("ms") or HOPPER_SMALL_MS):
        block_m = min(b for b in hopper.BLOCK_M_CHOICES if b >= m)
        variants = {}
        for per_sm, regs in enumerate(HOPPER_SMALL_REGISTERS, start=1):
            split = hopper.hopper_split(m, n, k, sms * per_sm, block_m)
            variants[f"r{regs}s{split}"] = {"block_m": block_m, "split_k": split, "max_registers": regs}
        us, worst = _hopper_point(a, sa, alpha, x, weights, w_t, variants)
        rows.append(_report_point("SMALL", m, n, k, us, worst, {"block_m": block_m}))
    raw["hopper_small_sweep"] = rows


def markdown(dev: str, ceil: Ceilings, op_rows: list[dict], mm_rows: list[dict]) -> str:
    lines = [
        f"# fp4fuse single-GPU ops, {datetime.date.today().isoformat()}",
        "",
        (f"Device: {dev}; torch {torch.__version__}; Triton {triton.__version__}; "
         f"medians of CUDA-event timings, L2 cleared before each call."),
        (f"Ceilings measured in this process: copy {ceil.copy_gbs / 1e3:.2f} TB/s (read + write), "
         f"cuBLAS bf16 8192^3 {ceil.mm_tflops:.0f} TFLOP/s."),
        "",
        "| op | shape | ms | floor ms | % of copy bandwidth |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in op_rows:
        lines.append(f"| {r['op']} | {r['shape']} | {r['ms']:.4f} | {r['floor_ms']:.4f} | {r['pct_copy']:.0f}% |")
    lines += [
        "",
        ("mm_fp4 (bf16 out) vs cuBLAS bf16 `torch.mm` and naive torch dequantize-then-matmul; "
         "graph columns: CUDA-graph replay over 4 rotating weight copies."),
        "",
        ("| M | N | K | fp4 ms | bf16 ms | fp4/bf16 speedup | naive ms | speedup vs naive | floor ms | "
         "tiled ms | dequant+mm ms | graph fp4 ms | graph bf16 ms | graph speedup |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in mm_rows:
        lines.append(
            f"| {r['m']} | {r['n']} | {r['k']} | {r['fp4_ms']:.4f} | {r['bf16_ms']:.4f} | {r['vs_bf16']:.2f}x | "
            f"{r['naive_ms']:.3f} | {r['vs_naive']:.1f}x | {r['floor_ms']:.4f} | {r['tiled_ms']:.4f} | "
            f"{r['dequant_mm_ms']:.4f} | {r['graph_fp4_ms']:.4f} | {r['graph_bf16_ms']:.4f} | "
            f"{r['graph_vs_bf16']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="markdown file to write (default: print)")
    parser.add_argument("--json", help="raw results as JSON")
    parser.add_argument("--sweep", action="store_true", help="also run the launch-configuration sweep")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="only the decode-GEMM configuration sweep (after the ceilings)")
    parser.add_argument("--mid-sweep", action="store_true",
                        help="only the M=64..2048 sweep of every GEMM path as CUDA-graph replays")
    parser.add_argument("--wide-step-sweep", action="store_true",
                        help="only the M<=64 sweep of the decode GEMM's 256-K-step tile as CUDA-graph replays")
    parser.add_argument("--dequant-sweep", action="store_true",
                        help="only the weight dequantization's launch sweep against a copy of the same bytes")
    parser.add_argument("--hopper-sweep", action="store_true",
                        help="only M=257..4096: the Hopper Gluon GEMM against the other paths and cuBLAS bf16")
    parser.add_argument("--hopper-split-sweep", action="store_true",
                        help="only M=64..1024: the Hopper Gluon GEMM's token tiles and split-K counts")
    parser.add_argument("--hopper-small-sweep", action="store_true",
                        help="only M=16..64: the Hopper Gluon GEMM's small token tiles with 1-3 programs per SM")
    parser.add_argument("--ms", type=lambda v: tuple(int(x) for x in v.split(",")),
                        help="row counts of --hopper-split-sweep / --hopper-small-sweep")
    parser.add_argument("--quant-sweep", action="store_true",
                        help="only the quantization's launch configurations on a 16384 x 8192 bf16 input")
    parser.add_argument("--scale-words-sweep", action="store_true",
                        help="only the decode GEMM at M<=64 with word- vs byte-loaded activation scales")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        print("bench_ops.py needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbs:.0f} GB/s, bf16 mm {ceil.mm_tflops:.0f} TFLOP/s", flush=True)
    sweeps = [fn for flag, fn in ((args.decode_sweep, decode_sweep), (args.mid_sweep, mid_sweep),
                                  (args.wide_step_sweep, wide_step_sweep),
                                  (args.scale_words_sweep, scale_words_sweep), (args.quant_sweep, quant_sweep),
                                  (args.dequant_sweep, dequant_sweep), (args.hopper_sweep, hopper_sweep),
                                  (args.hopper_split_sweep, hopper_split_sweep),
                                  (args.hopper_small_sweep, hopper_small_sweep)) if flag]
    if sweeps:
        raw = {"device": dev, "torch": torch.__version__, "triton": triton.__version__,
               "ceilings": dataclasses.asdict(ceil), "ms": args.ms}
        for fn in sweeps:
            fn(ceil, raw)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(raw, f, indent=1, default=str)
        print(f"total {time.time() - t0:.0f} s", flush=True)
        return 0
    op_rows: list[dict] = []
    bench_quant(ceil, op_rows)
    for r in op_rows:
        print(r, flush=True)
    raw: dict = {"device": dev, "torch": torch.__version__, "triton": triton.__version__,
                 "ceilings": dataclasses.asdict(ceil), "ops": op_rows}
    if args.sweep:
        sweep(raw)
    mm_rows: list[dict] = []
    bench_mm(ceil, mm_rows)
    raw["mm"] = mm_rows
    text = markdown(dev, ceil, op_rows, mm_rows)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1, default=str)
    print(f"total {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
