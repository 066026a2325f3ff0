"""Alternatives to the shipped decode GEMM at 16-64 rows, timed against it in one process.

    PYTHONPATH=. python benchmarks/bench_decode_alternatives.py [--mma-sync] [--predecode] [--caps] [--l2]
        [--json raw.json]

The shipped kernel (``fp4fuse.kernels.triton.mm_decode``, ``decode_config_for``) decodes the weight
into wgmma register fragments and the activation, in every program, into shared memory. Each flag
times one alternative against it (no flag: all four):

* ``--mma-sync``: a Gluon kernel on ``mma.sync`` (m16n8k16) without shared memory: every thread
  loads its own operand bytes from global memory as int32 words straight into its MMA fragments'
  registers (``DotOperandLayout`` with ``k_width`` 2 over words: 8 code bytes of a row per 64-byte
  half step, the same bytes as ``k_width`` 8 over the fp16 planes, so the decoded planes need no
  layout conversion), decodes each word with one PTX block that also applies its block scale, and
  prefetches the next K step's words in registers. No CTA barrier in the K loop; split-K and the
  epilogue are the Hopper Gluon GEMM's (``mm_hopper.finish_tile``, then ``reduce.sum_split_partials``
  since the twenty-eighth session). 16 activation rows; a sweep of
  weight rows per program, warps, step and split. Gluon: Triton 3.6 only.
* ``--predecode``: the shipped configuration with the activation pre-decoded by a launch of its own
  (``DecodeConfig.predecode``, the 65-256-row path), at 16-64 rows.
* ``--caps``: the shipped configuration under register caps that fit more programs per
  multiprocessor (104, 96, 80: spills), with 4 stages, and with 1.5x its split.
* ``--l2``: whether the kernel waits on HBM. The shipped configuration with its weight cold in L2
  (4 rotating copies), hot (one copy every call), and prefetched into L2 by a fire-and-forget
  kernel (``prefetch.global.L2`` on every 128-byte line) launched before a ~10 us spin, as a graph
  could issue it ahead of a GEMM while latency-bound kernels run (the spin's own time subtracted);
  cuBLAS bf16 cold and hot. At 16, 64 and 128 rows on the shapes that fit in L2.

CUDA-graph replays over 4 rotating weight copies (``bench_ops``), microseconds, with cuBLAS bf16 on
the same shape. Outputs: the mma.sync kernel against the float64 reference (it sums K in another
order), the others against the shipped output (bitwise where the split is the same). Results in
benchmarks/results/.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import sys

import torch
import triton
import triton.language as tl

import bench_ops  # benchmarks/, this script's folder
from fp4fuse.kernels.triton import mm_decode
from fp4fuse.kernels.triton.alpha import alpha_meta, alpha_operands
from fp4fuse.kernels.triton.decode import split_ranges
from fp4fuse.nvfp4 import format as nvfp4

SHAPES = ((8192, 8192), (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168), (28672, 8192))
MS = (16, 32, 64)
#: Relative error (max |out - ref| / max |ref|) a bf16 output of a correct kernel stays under.
MAX_REL_ERR = 4e-3


def _gluon_kernel():
    """The mma.sync kernel and its launcher, built on first use (Gluon's API is Triton 3.6's)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from fp4fuse.kernels.triton.mm_hopper import finish_tile
    from fp4fuse.kernels.triton.reduce import sum_split_partials

    # One code word (4 bytes, 8 codes of one 16-element block) and the word holding its block scale
    # with the prmt selector of that byte -> 8 fp16 halves, e2m1 * 2**-14 * scale (exact): $0..$3 the
    # low nibbles of bytes 0..3, $4..$7 the high nibbles. The decode is fp4fuse's DECODE_PTX.
    word_ptx = gl.constexpr(
        "{ .reg .b32 a, b, l, h, z, s, t, r0, r1, r2, r3; .reg .b16 sl, sh; mov.b32 z, 0; "
        "prmt.b32 t, $9, 0, $10; mov.b32 {sl, sh}, t; cvt.rn.f16x2.e4m3x2 s, sl; "
        "shl.b32 a, $8, 1; and.b32 a, a, 0x0E0E0E0E; shl.b32 b, $8, 4; and.b32 b, b, 0x80808080; or.b32 l, a, b; "
        "shr.b32 a, $8, 3; and.b32 a, a, 0x0E0E0E0E; and.b32 b, $8, 0x80808080; or.b32 h, a, b; "
        "prmt.b32 r0, z, l, 0x5040; prmt.b32 r1, z, l, 0x7060; prmt.b32 r2, z, h, 0x5040; prmt.b32 r3, z, h, 0x7060; "
        "mul.rn.f16x2 r0, r0, s; mul.rn.f16x2 r1, r1, s; mul.rn.f16x2 r2, r2, s; mul.rn.f16x2 r3, r3, s; "
        "mov.b32 {$0, $1}, r0; mov.b32 {$2, $3}, r1; mov.b32 {$4, $5}, r2; mov.b32 {$6, $7}, r3; }"
    )

    @gluon.jit
    def planes(words, scale_words, selectors):
        """int32 code words ``[R, W]`` -> scaled fp16 (lo, hi) planes ``[R, 4 W]`` (column c: code byte c)."""
        o = gl.inline_asm_elementwise(word_ptx, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, scale_words, selectors],
                                      dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        shape: gl.constexpr = [words.shape[0], 4 * words.shape[1]]
        lo = gl.reshape(gl.join(gl.join(o[0], o[2]), gl.join(o[1], o[3])), shape)
        hi = gl.reshape(gl.join(gl.join(o[4], o[6]), gl.join(o[5], o[7])), shape)
        return lo, hi

    @gluon.jit
    def kernel(a_ptr, as_ptr, b_ptr, bs_ptr, alpha_ptr, alpha_b_ptr, out_ptr, part_ptr,
               M, N, KW, KSW, iters_per_split,
               BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STEP_W: gl.constexpr, PARTIAL: gl.constexpr,
               ALPHA_FROM_SCALES: gl.constexpr, ALPHA_DIV_RN: gl.constexpr, num_warps: gl.constexpr):
        """Program ``(tile, split)``; KW code words and KSW scale words (4 scales) per row, STEP_W words a step."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        aw_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        bw_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        tile = gl.program_id(0)
        split = gl.program_id(1)
        off_n = tile * BLOCK_N
        rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, aw_l))
        rows = gl.where(rows < N, rows, rows % N).to(gl.int64)
        wi = gl.arange(0, STEP_W, layout=gl.SliceLayout(0, aw_l))
        w_ptrs = b_ptr.to(gl.pointer_type(gl.int32)) + rows[:, None] * KW + wi[None, :]
        ws_ptrs = bs_ptr.to(gl.pointer_type(gl.int32)) + rows[:, None] * KSW + (wi // 8)[None, :]
        # word w of a step is in block w // 2, whose scale is byte (w // 2) % 4 of scale word w // 8
        w_sel = gl.zeros([BLOCK_N, STEP_W], gl.int32, aw_l) + (((wi // 2) % 4) * 0x1111)[None, :]
        tok = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, bw_l))
        tok = gl.where(tok < M, tok, tok % M).to(gl.int64)
        xi = gl.arange(0, STEP_W, layout=gl.SliceLayout(1, bw_l))
        x_ptrs = a_ptr.to(gl.pointer_type(gl.int32)) + tok[None, :] * KW + xi[:, None]
        xs_ptrs = as_ptr.to(gl.pointer_type(gl.int32)) + tok[None, :] * KSW + (xi // 8)[:, None]
        x_sel = gl.permute(gl.zeros([STEP_W, BLOCK_M], gl.int32, bw_l) + (((xi // 2) % 4) * 0x1111)[:, None], (1, 0))

        kw = split * iters_per_split * STEP_W
        steps = gl.minimum(iters_per_split, (KW - kw) // STEP_W)
        last = KW - STEP_W
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        w = gl.load(w_ptrs + kw)
        ws = gl.load(ws_ptrs + kw // 8)
        x = gl.load(x_ptrs + kw)
        xs = gl.load(xs_ptrs + kw // 8)
        for _ in range(steps):
            nk = gl.minimum(kw + STEP_W, last)  # the last step prefetches a step it does not use
            w_next = gl.load(w_ptrs + nk)
            ws_next = gl.load(ws_ptrs + nk // 8)
            x_next = gl.load(x_ptrs + nk)
            xs_next = gl.load(xs_ptrs + nk // 8)
            wlo, whi = planes(w, ws, w_sel)
            xlo, xhi = planes(gl.permute(x, (1, 0)), gl.permute(xs, (1, 0)), x_sel)
            acc = mma_v2(gl.convert_layout(wlo, a_l, assert_trivial=True),
                         gl.convert_layout(gl.permute(xlo, (1, 0)), b_l, assert_trivial=True), acc)
            acc = mma_v2(gl.convert_layout(whi, a_l, assert_trivial=True),
                         gl.convert_layout(gl.permute(xhi, (1, 0)), b_l, assert_trivial=True), acc)
            w, ws, x, xs = w_next, ws_next, x_next, xs_next
            kw += STEP_W

        finish_tile(acc, alpha_ptr, alpha_b_ptr, out_ptr, part_ptr, split, 0, off_n, M, N,
                    PARTIAL, ALPHA_FROM_SCALES, ALPHA_DIV_RN, num_warps)

    def launch(a, b, sa, sb, alpha, block_n, step_w, split_k, num_warps, workspace):
        """``alpha * (q_a * s_a) @ (q_b * s_b)^T`` in bf16 for M <= 16, K/2 a multiple of 4 * step_w bytes."""
        m, n, kb = a.shape[0], b.shape[0], a.shape[1]
        out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
        tiles = triton.cdiv(n, block_n)
        splits, iters = split_ranges(kb // (4 * step_w), split_k)
        part = workspace if splits > 1 else out
        alpha_a, alpha_b = alpha_operands(alpha)
        kernel[(tiles, splits)](a, sa, b, sb, alpha_a, alpha_b, out, part, m, n, kb // 4, kb // 32, iters,
                                BLOCK_N=block_n, BLOCK_M=16, STEP_W=step_w, PARTIAL=splits > 1,
                                num_warps=num_warps, **alpha_meta(alpha))
        return sum_split_partials(part, out, alpha) if splits > 1 else out

    launch.kernel = kernel
    return launch


def _points(ms, shapes=SHAPES):
    """``(m, n, k, a, sa, alpha, weights, x, w_t)`` over ``shapes`` x ``ms`` (bench_ops._rotating_points)."""
    for m, n, k, x, a, sa, alpha, weights, w_t in bench_ops._rotating_points(shapes, ms):
        yield m, n, k, a, sa, alpha.reshape(1), weights, x, w_t


def _shipped(m, n, k, a, sa, alpha, weights, x, w_t, sms) -> tuple[mm_decode.DecodeConfig, dict]:
    """The shipped configuration of a point and its microseconds, with cuBLAS bf16's."""
    cfg = mm_decode.decode_config_for(m, n, k, sms)
    us = {"shipped": bench_ops.decode_graph_ms(a, sa, alpha, weights, cfg) * 1e3,
          "bf16": bench_ops.bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t]) * 1e3}
    return cfg, us


def mma_sync_sweep(sms: int) -> list[dict]:
    """``--mma-sync``: every variant of the Gluon kernel at 16 rows on SHAPES, against the shipped
    kernel and cuBLAS bf16; each variant's error against the float64 reference."""
    launch = _gluon_kernel()
    rows = []
    for m, n, k, a, sa, alpha, weights, x, w_t in _points((16,)):
        cfg, us = _shipped(m, n, k, a, sa, alpha, weights, x, w_t, sms)
        ref = nvfp4.mm_fp4_reference(a, weights[0][0], sa, weights[0][1], alpha, torch.float64)
        variants = []
        for block_n, warps, step_w in itertools.product((64, 128, 256), (2, 4, 8), (16, 32)):
            if not 16 <= block_n // warps <= 64:
                continue
            tiles = triton.cdiv(n, block_n)
            for per_sm in (4, 8, 16):
                split = max(1, min(16, per_sm * sms // tiles, (k // 2) // (4 * step_w) // 3))
                splits, _ = split_ranges((k // 2) // (4 * step_w), split)
                ws = torch.empty((splits, m, n), dtype=torch.float32, device=a.device)
                out = launch(a, weights[0][0], sa, weights[0][1], alpha, block_n, step_w, split, warps, ws)
                err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                t = bench_ops.bench_graph([functools.partial(launch, a, wq, sa, wsq, alpha, block_n, step_w, split,
                                                             warps, ws) for wq, wsq, _ in weights]) * 1e3
                variants.append({"block_n": block_n, "warps": warps, "step_bytes": 4 * step_w, "split": splits,
                                 "us": t, "rel_err": err})
        ok = [v for v in variants if v["rel_err"] < MAX_REL_ERR]
        best = min(ok, key=lambda v: v["us"])
        print(f"MMA_SYNC m={m} n={n:<5d} k={k:<5d} shipped {us['shipped']:5.1f} us | "
              f"mma.sync best {best['us']:5.1f} us ({best['block_n']} rows, {best['warps']} warps, "
              f"{best['step_bytes']} B, split {best['split']}; "
              f"{us['shipped'] / best['us']:.2f}x shipped) | bf16 {us['bf16']:5.1f} | "
              f"{len(variants) - len(ok)} variants over {MAX_REL_ERR:g} rel. error", flush=True)
        rows.append({"m": m, "n": n, "k": k, **us, "variants": variants})
    return rows


def _against_shipped(label: str, m, n, k, a, sa, alpha, weights, x, w_t, sms, overrides: dict) -> dict:
    """The shipped configuration and each of ``overrides`` (name -> DecodeConfig fields) timed; an
    override with the shipped split must give the shipped output bit for bit."""
    cfg, us = _shipped(m, n, k, a, sa, alpha, weights, x, w_t, sms)
    b, sb = weights[0][0], weights[0][1]
    ref = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.bfloat16, cfg)
    for name, fields in overrides.items():
        c = dataclasses.replace(cfg, **fields)
        out = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.bfloat16, c)
        if c.split_k == cfg.split_k and c.block_k == cfg.block_k and not torch.equal(out, ref):
            raise AssertionError(f"{label} {name}: output differs from the shipped configuration's")
        us[name] = bench_ops.decode_graph_ms(a, sa, alpha, weights, c) * 1e3
    best = min((kk for kk in us if kk != "bf16"), key=us.get)
    print(f"{label} m={m:<2d} n={n:<5d} k={k:<5d} [{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.split_k} "
          f"r{cfg.max_registers}] " + " ".join(f"{kk}={v:.1f}" for kk, v in us.items())
          + f" | best {best} ({us['shipped'] / us[best]:.2f}x shipped)", flush=True)
    return {"m": m, "n": n, "k": k, "config": dataclasses.asdict(cfg), "us": us}


def predecode_sweep(sms: int) -> list[dict]:
    """``--predecode``: the shipped configuration with the activation pre-decoded (its step and
    split, 128-element steps, twice the split) at MS x SHAPES."""
    rows = []
    for point in _points(MS):
        m, n, k = point[:3]
        cfg = mm_decode.decode_config_for(m, n, k, sms)
        pre = dict(predecode=True, scale_words=False)
        overrides = {"pre": pre, "pre_bk128": {**pre, "block_k": 128},
                     "pre_x2split": {**pre, "split_k": min(16, 2 * cfg.split_k)}}
        rows.append(_against_shipped("PREDECODE", *point, sms, overrides))
    return rows


def caps_sweep(sms: int) -> list[dict]:
    """``--caps``: the shipped configuration under register caps, 4 stages and 1.5x its split at MS x SHAPES."""
    rows = []
    for point in _points(MS):
        m, n, k = point[:3]
        cfg = mm_decode.decode_config_for(m, n, k, sms)
        overrides = {f"r{cap}": {"max_registers": cap} for cap in (104, 96, 80)}
        overrides["st4"] = {"num_stages": 4}
        overrides["x1.5split"] = {"split_k": min(16, max(1, round(1.5 * cfg.split_k)))}
        rows.append(_against_shipped("CAPS", *point, sms, overrides))
    return rows


@triton.jit
def _prefetch_lines(ptr, n_bytes, LINES: tl.constexpr):
    """Ask L2 for ``LINES`` 128-byte lines of ``ptr``'s ``n_bytes`` from this program's first; returns
    at once (nothing waits for the data)."""
    offs = tl.minimum((tl.program_id(0) * LINES + tl.arange(0, LINES)).to(tl.int64) * 128, n_bytes - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptr + offs],
                              dtype=tl.int32, is_pure=False, pack=1)


def _prefetch(t: torch.Tensor) -> None:
    n_bytes = t.numel() * t.element_size()
    _prefetch_lines[(triton.cdiv(n_bytes, 128 * 256),)](t, n_bytes, LINES=256, num_warps=8)


#: ``torch.cuda._sleep`` cycles standing for the kernels a graph runs between a prefetch and its GEMM.
SPIN_CYCLES = 20000


def l2_sweep(sms: int) -> list[dict]:
    """``--l2``: the shipped configuration with its weight cold, hot and prefetched into L2 (module
    docstring), and cuBLAS bf16 cold and hot, at 16, 64 and 128 rows."""
    spin = bench_ops.bench_graph([functools.partial(torch.cuda._sleep, SPIN_CYCLES)]) * 1e3
    rows = []
    for m, n, k, a, sa, alpha, weights, x, w_t in _points((16, 64, 128), SHAPES[:5]):
        cfg = mm_decode.decode_config_for(m, n, k, sms)
        ws = mm_decode.empty_decode_workspace(*mm_decode.decode_workspace_numel(m, n, k, cfg), a.device)

        def gemm(w, prefetch=False, spin_first=False):
            if prefetch:
                _prefetch(w[0])
                _prefetch(w[1])
            if spin_first:
                torch.cuda._sleep(SPIN_CYCLES)
            mm_decode.mm_fp4_decode(a, w[0], sa, w[1], alpha, torch.bfloat16, cfg, ws)

        def us(fns):
            return bench_ops.bench_graph(fns) * 1e3

        row = {"cold": us([functools.partial(gemm, w) for w in weights]),
               "hot": us([functools.partial(gemm, weights[0])] * len(weights)),
               "spin_cold": us([functools.partial(gemm, w, spin_first=True) for w in weights]) - spin,
               "spin_prefetched": us([functools.partial(gemm, w, True, True) for w in weights]) - spin,
               "bf16_cold": us([functools.partial(torch.mm, x, wt) for wt in w_t]),
               "bf16_hot": us([functools.partial(torch.mm, x, w_t[0])] * len(w_t))}
        print(f"L2 m={m:<3d} n={n:<5d} k={k:<5d} " + " ".join(f"{kk}={v:.1f}" for kk, v in row.items()), flush=True)
        rows.append({"m": m, "n": n, "k": k, "config": dataclasses.asdict(cfg), "spin_us": spin, "us": row})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = bench_ops.script_args(__doc__, argv, ("--mma-sync", "--predecode", "--caps", "--l2"))
    if args is None:
        return 2
    everything = not (args.mma_sync or args.predecode or args.caps or args.l2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {}
    if args.mma_sync or everything:
        results["mma_sync"] = mma_sync_sweep(sms)
    if args.predecode or everything:
        results["predecode"] = predecode_sweep(sms)
    if args.caps or everything:
        results["caps"] = caps_sweep(sms)
    if args.l2 or everything:
        results["l2"] = l2_sweep(sms)
    bench_ops.write_raw(args.json, **results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
