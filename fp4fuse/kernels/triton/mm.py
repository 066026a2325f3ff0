"""W4A4 NVFP4 GEMM on GPUs without FP4 tensor cores (Hopper, Ampere), in Triton.

Contract: ``mm_fp4_triton(a, b, a_scale, b_scale, alpha, out_dtype) -> out [M, N]`` with
a uint8 ``[M, K/2]``, b uint8 ``[N, K/2]`` (weight, row-major), linear e4m3 scales ``[M, K/16]`` /
``[N, K/16]``, alpha a one-element fp32 device tensor (read in-kernel, never synchronised) or the
two global scales it is computed from (``fp4fuse.kernels.triton.alpha``),
``out = alpha * (q_a * s_a) @ (q_b * s_b)^T`` in bf16/fp16/fp32. Inputs are validated by the op layer.

Numerics. Codes and scales are decoded exactly into the fp16 operand encoding of
``fp4fuse.kernels.triton.decode`` (``e2m1 * 2**-14 * s``); products are exact in fp32, the tensor
cores accumulate in fp32, and the epilogue multiplies by ``2**28`` (exact) and then alpha. The result
is the float64 reference up to fp32 accumulation and one rounding to ``out_dtype``.

Kernels and dispatch (``mm_fp4_triton``; measurements in benchmarks/results/):

* up to ``DECODE_MAX_M`` rows: ``fp4fuse.kernels.triton.mm_decode`` (deterministic split-K inside
  the launch; the activation decoded in it up to 64 rows, pre-decoded once above), except the
  Hopper products below;
* ``decode.decode_fp4_halves`` decodes the activation once into fp16 even/odd halves ``[M, K/2]``
  (a few microseconds at decode sizes), so that the GEMM decodes only the weight.
* ``_mm_fp4_kernel``: tiled ``tl.dot`` kernel; each K step decodes a ``[BLOCK_N, 16*BLOCK_G]``
  weight tile in registers (inline PTX, 4 code bytes at a time) K-major, so that it goes to
  shared memory as the MMA's B operand with 16-byte stores, and runs two MMAs (even and odd
  elements). Small M uses split-K: fp32 partials that ``_splitk_reduce_kernel`` sums in a fixed
  order (deterministic) and scales by alpha. Tried and dropped: decoding both operands in the
  GEMM, and the "swapped" orientation with the weight as the register (A) operand: Triton then
  decodes in the MMA's register layout from 2-byte shared-memory reads (about 2x slower).
* on Hopper (sm_90) with Triton 3.6, where K is a multiple of 64 and the weight is aligned: from
  ``mm_hopper.SPLIT_MIN_M + 1`` to ``DECODE_MAX_M`` rows on weights of at least
  ``mm_hopper.SPLIT_MIN_WEIGHT`` elements (with split-K), and above ``DECODE_MAX_M`` rows (bf16
  output: up to ``mm_hopper.HOPPER_BF16_MAX_M`` rows and where the output fills the GPU's waves of
  tiles):
  ``fp4fuse.kernels.triton.mm_hopper``, a warp-specialized Gluon kernel that decodes the weight
  straight into wgmma register fragments (:func:`hopper_serves`);
* ``_dequant_group_kernel`` + cuBLAS: otherwise from ``DEQUANT_MIN_M`` on with bf16 output (where the
  GEMM becomes compute-bound and each weight tile would be decoded once per M tile), so both operands
  are decoded once to bf16 (exact, one launch) and multiplied by ``torch.mm``, then scaled by alpha
  in place by ``_scale_group_kernel`` (a second rounding to bf16: ``bf16(fp32(bf16(acc)) * alpha)``).
  Sibling calls on one activation (``mm_fp4_calls_triton``) dequantize it once, with all their
  weights in the same launch, and scale all their outputs in one launch. PyTorch's
  ``out.mul_(alpha)`` with a CUDA 0-dim fp32 alpha would round alpha to bf16 first and runs a
  non-vectorized mixed-dtype loop at about a quarter of the copy bandwidth. fp16/fp32 outputs
  always use the tiled kernel (a bf16 cuBLAS output would lose precision).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from fp4fuse.kernels.triton.alpha import (
    Alpha, GlobalScales, alpha_meta, alpha_operands, alpha_tensor, empty_sum_, load_alpha,
)
from fp4fuse.kernels.triton.decode import (
    DECODE_SCALE_UNDO, decode_codes, decode_fp4_halves, decode_scales, grouped_tile, num_sms,
)
from fp4fuse.kernels.triton.launch import traceable, tracing
from fp4fuse.kernels.triton.mm_decode import (
    DECODE_MAX_M, DecodeProduct, decode_config_for, mm_fp4_decode, mm_fp4_decode_products,
)
from fp4fuse.nvfp4.format import BLOCK_SIZE

logger = logging.getLogger(__name__)

__all__ = [
    # re-exported: the dispatch below uses them and RowBlockGemm reproduces its choices
    "DECODE_MAX_M",
    "decode_config_for",
    "mm_fp4_decode",
    "num_sms",
    "DEQUANT_MIN_M",
    "MMConfig",
    "decode_fp4_halves",
    "dequantize_fp4_pair_triton",
    "dequantize_fp4_triton",
    "hopper_gemm",
    "hopper_kernels",
    "hopper_serves",
    "mm_config_for",
    "mm_fp4_calls_triton",
    "mm_fp4_dequant_mm",
    "mm_fp4_group_triton",
    "mm_fp4_hopper_decoded",
    "mm_fp4_tiled",
    "mm_fp4_triton",
    "scale_by_alpha_",
]

# bf16 output above the decode GEMM's range goes to dequantize + cuBLAS: from M = 512 on it was the
# fastest path on the five shapes of bench_ops.py --mid-sweep, and at M = 256 the tiled kernel lost
# to it too (benchmarks/results/). fp16 / fp32 outputs there use the tiled kernel.
DEQUANT_MIN_M = DECODE_MAX_M + 1

# (16-element blocks per program, warps) of _dequant_kernel: the sweep over (256..2048, 8..16)
# on 8192x8192 put (256, 8) first (55 us, 74% of the copy bandwidth).
DEQUANT_LAUNCH = (256, 8)


@triton.jit
def _decode_weight_tile(codes, scales, FAST_DECODE: tl.constexpr):
    """Weight tile, K-major: codes ``uint8 [G, 8, N]`` + scales ``[G, N]`` -> (low, high) nibble
    values ``fp16 [G*8, N]``, each ``e2m1 * 2**-14 * s`` (exact); row ``8g + j`` of low holds
    element ``2(8g + j)`` of the group range, row ``8g + j`` of high element ``2(8g + j) + 1``.

    K-major (K along dim 0) lets the decoded tile go to shared memory as the MMA's B operand with
    16-byte stores; decoding it N-major cost one 2-byte store per element (SASS, Triton 3.6)."""
    lo, hi = decode_codes(codes, FAST_DECODE)
    s = decode_scales(scales, FAST_DECODE)[:, None, :]
    g: tl.constexpr = codes.shape[0]
    n: tl.constexpr = codes.shape[2]
    return tl.reshape(lo * s, (g * 8, n)), tl.reshape(hi * s, (g * 8, n))


@triton.jit
def _mm_fp4_kernel(
    xlo_ptr, xhi_ptr, w_ptr, ws_ptr, alpha_ptr, alpha_b_ptr, out_ptr, M, N, KG, groups_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr,
    PARTIAL: tl.constexpr, EVEN_K: tl.constexpr, FAST_DECODE: tl.constexpr,
    ALPHA_FROM_SCALES: tl.constexpr = False, ALPHA_DIV_RN: tl.constexpr = False,
):
    """acc[m, n] = sum over this program's K range of A[m, k] * W[n, k].

    A arrives decoded by ``decode_fp4_halves`` (fp16 halves ``[M, K/2]``: even / odd
    elements); W (packed NVFP4 ``[N, K/2]`` + e4m3 scales ``[N, K/16]``) is decoded here, each
    step's ``[BLOCK_G*8, BLOCK_N]`` halves feeding two MMAs (even with even, odd with odd).
    Program (tile, split) covers groups ``[split * groups_per_split, +groups_per_split)``;
    EVEN_K says that range never passes KG (no masks along K).
    not PARTIAL: ``out[m, n] = acc * 2**28 * alpha`` in out's dtype.
    PARTIAL (split-K): fp32 ``out[split, m, n]`` (``[splits, M, N]``), unscaled."""
    split = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_in = tl.where(cols < N, cols, 0)   # out-of-range weight rows read row 0; never stored
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, 8)
    kk = tl.arange(0, BLOCK_G * 8)
    row_ok = (rows < M)[:, None]

    # row starts in int64: M * K/2 (or N * K/2) may pass 2**31, and an int32 product wrapped
    # (rows past 2**31 / (K/2) read before the operand's start)
    xlo_rows = xlo_ptr + rows.to(tl.int64)[:, None] * (KG * 8)
    xhi_rows = xhi_ptr + rows.to(tl.int64)[:, None] * (KG * 8)
    w_rows = w_ptr + cols_in.to(tl.int64)[None, None, :] * (KG * 8)
    ws_rows = ws_ptr + cols_in.to(tl.int64)[None, :] * KG

    k_begin = split * groups_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, groups_per_split, BLOCK_G):
        kg0 = k_begin + step
        grp = kg0 + g
        x_offs = (kg0 * 8 + kk)[None, :]
        w_offs = grp[:, None, None] * 8 + j[None, :, None]
        s_offs = grp[:, None]
        if EVEN_K:
            x_lo = tl.load(xlo_rows + x_offs, mask=row_ok, other=0.0)
            x_hi = tl.load(xhi_rows + x_offs, mask=row_ok, other=0.0)
            codes = tl.load(w_rows + w_offs)
            scales = tl.load(ws_rows + s_offs)
        else:
            x_mask = row_ok & ((kg0 * 8 + kk) < KG * 8)[None, :]
            x_lo = tl.load(xlo_rows + x_offs, mask=x_mask, other=0.0)
            x_hi = tl.load(xhi_rows + x_offs, mask=x_mask, other=0.0)
            in_k = grp < KG
            codes = tl.load(w_rows + w_offs, mask=in_k[:, None, None], other=0)
            scales = tl.load(ws_rows + s_offs, mask=in_k[:, None], other=0.0)
        w_lo, w_hi = _decode_weight_tile(codes, scales, FAST_DECODE)
        acc = tl.dot(x_lo, w_lo, acc)
        acc = tl.dot(x_hi, w_hi, acc)

    mask = row_ok & (cols < N)[None, :]
    if not PARTIAL:
        alpha = load_alpha(alpha_ptr, alpha_b_ptr, ALPHA_FROM_SCALES, ALPHA_DIV_RN)
        res = (acc * DECODE_SCALE_UNDO) * alpha
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        offs = (split.to(tl.int64) * M + rows[:, None]) * N + cols[None, :]
        tl.store(out_ptr + offs, acc, mask=mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, alpha_ptr, alpha_b_ptr, out_ptr, n_elements, n_split, BLOCK: tl.constexpr,
                          ALPHA_FROM_SCALES: tl.constexpr = False, ALPHA_DIV_RN: tl.constexpr = False):
    """out = (sum over splits, in split order) * 2**28 * alpha; partials ``[n_split, M*N]``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for sp in range(1, n_split):
        acc += tl.load(part_ptr + sp * n_elements + offs, mask=mask, other=0.0)
    alpha = load_alpha(alpha_ptr, alpha_b_ptr, ALPHA_FROM_SCALES, ALPHA_DIV_RN)
    res = (acc * DECODE_SCALE_UNDO) * alpha
    tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    """NVFP4 -> bf16 ``q * s`` (exact), flat over 16-element blocks; out written as int32 pairs."""
    _dequant_blocks(q_ptr, s_ptr, out_ptr, n_blocks, tl.program_id(0), BLOCKS)


# The grouped kernels pick their segment's operands at their top level, under ``SEGMENTS`` guards,
# and pass only the picked pointers to the per-block body. Their launcher (``_launch_grouped``)
# fills unused slots with the last segment's tensors, and torch's analysis of which arguments a
# traced launch writes (Triton IR, helpers not inlined) counts every pointer passed into a helper
# as written. A selection helper taking all four output pointers made the slots that alias one
# output "written" three times; functionalization gave each its own copy, and the compiled graph
# read a copy the kernel never wrote. Under the guards the unused slots are pruned before the
# analysis, and ``patterns.base.insert_traced`` refuses a launch that writes one tensor through
# two arguments.


@triton.jit
def _dequant_group_kernel(q0_ptr, s0_ptr, out0_ptr, n0_blocks, q1_ptr, s1_ptr, out1_ptr, n1_blocks,
                          q2_ptr, s2_ptr, out2_ptr, n2_blocks, q3_ptr, s3_ptr, out3_ptr, n3_blocks,
                          end0, end1, end2, SEGMENTS: tl.constexpr, BLOCKS: tl.constexpr):
    """``SEGMENTS`` (1 to 4) ``_dequant_kernel`` launches in one: programs ``[0, end0)`` dequantize
    tensor 0, ``[end0, end1)`` tensor 1, ``[end1, end2)`` tensor 2, the rest tensor 3."""
    pid = tl.program_id(0)
    q_ptr, s_ptr, out_ptr, n_blocks, first = q0_ptr, s0_ptr, out0_ptr, n0_blocks, pid * 0
    if SEGMENTS > 1:
        if pid >= end0:
            q_ptr, s_ptr, out_ptr, n_blocks, first = q1_ptr, s1_ptr, out1_ptr, n1_blocks, end0
    if SEGMENTS > 2:
        if pid >= end1:
            q_ptr, s_ptr, out_ptr, n_blocks, first = q2_ptr, s2_ptr, out2_ptr, n2_blocks, end1
    if SEGMENTS > 3:
        if pid >= end2:
            q_ptr, s_ptr, out_ptr, n_blocks, first = q3_ptr, s3_ptr, out3_ptr, n3_blocks, end2
    _dequant_blocks(q_ptr, s_ptr, out_ptr, n_blocks, pid - first, BLOCKS)


@triton.jit
def _dequant_blocks(q_ptr, s_ptr, out_ptr, n_blocks, pid, BLOCKS: tl.constexpr):
    """Program ``pid``'s ``BLOCKS`` 16-element blocks of ``_dequant_kernel``: the scales read as
    bytes, the bf16 output written as int32 pairs (the tensors' own dtypes arrive, so a compiled
    graph's wrapper runs no view op per call)."""
    s_ptr = s_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    out_ptr = out_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    blk = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    in_range = blk < n_blocks
    pair = blk[:, None] * 8 + tl.arange(0, 8)[None, :]
    c = tl.load(q_ptr + pair, mask=in_range[:, None], other=0).to(tl.int32)
    sb = tl.load(s_ptr + blk, mask=in_range, other=0).to(tl.int32)
    # e4m3 -> fp32: normal ((e + 120) << 23 | m << 20), subnormal m * 2**-9, 0x7F -> NaN
    e = (sb >> 3) & 0xF
    m = sb & 0x7
    s = tl.where(e == 0, m.to(tl.float32) * 0.001953125,
                 (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
    s = tl.where((sb & 0x7F) == 0x7F, float("nan"), s)
    s = tl.where((sb & 0x80) != 0, -s, s)[:, None]
    lo = _e2m1_to_fp32(c & 0xF) * s
    hi = _e2m1_to_fp32(c >> 4) * s
    # bf16 bits are the top halves of the (exactly representable) fp32 products
    lo_bits = (lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    hi_bits = hi.to(tl.int32, bitcast=True) & -65536
    tl.store(out_ptr + pair, lo_bits | hi_bits, mask=in_range[:, None])


@triton.jit
def _scale_group_kernel(x0_ptr, a0_ptr, ab0_ptr, n0, x1_ptr, a1_ptr, ab1_ptr, n1, x2_ptr, a2_ptr, ab2_ptr, n2,
                        end0, end1, SEGMENTS: tl.constexpr, BLOCK: tl.constexpr,
                        ALPHA_FROM_SCALES: tl.constexpr = False, ALPHA_DIV_RN: tl.constexpr = False):
    """In place ``x = x_dtype(fp32(x) * alpha)`` (round to nearest even), flat, for ``SEGMENTS``
    (1 to 3) tensors, each with its own alpha: programs ``[0, end0)`` scale tensor 0, ``[end0,
    end1)`` tensor 1, the rest tensor 2."""
    pid = tl.program_id(0)
    x_ptr, alpha_ptr, alpha_b_ptr, n_elements, first = x0_ptr, a0_ptr, ab0_ptr, n0, pid * 0
    if SEGMENTS > 1:
        if pid >= end0:
            x_ptr, alpha_ptr, alpha_b_ptr, n_elements, first = x1_ptr, a1_ptr, ab1_ptr, n1, end0
    if SEGMENTS > 2:
        if pid >= end1:
            x_ptr, alpha_ptr, alpha_b_ptr, n_elements, first = x2_ptr, a2_ptr, ab2_ptr, n2, end1
    _scale_block(x_ptr, alpha_ptr, alpha_b_ptr, n_elements, pid - first, BLOCK, ALPHA_FROM_SCALES, ALPHA_DIV_RN)


@triton.jit
def _scale_block(x_ptr, alpha_ptr, alpha_b_ptr, n_elements, pid, BLOCK: tl.constexpr,
                 ALPHA_FROM_SCALES: tl.constexpr, ALPHA_DIV_RN: tl.constexpr):
    """Program ``pid`` of one tensor of ``_scale_group_kernel``: ``BLOCK`` elements from ``pid * BLOCK``."""
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask)
    alpha = load_alpha(alpha_ptr, alpha_b_ptr, ALPHA_FROM_SCALES, ALPHA_DIV_RN)
    tl.store(x_ptr + offs, (x.to(tl.float32) * alpha).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _e2m1_to_fp32(code):
    """e2m1 code (int32, 0..15) -> fp32 value with integer ops."""
    mag = code & 7
    bits = tl.where(mag > 1, (mag << 22) + 0x3F000000, mag * 0x3F000000)
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@dataclasses.dataclass(frozen=True)
class MMConfig:
    """One launch of ``_mm_fp4_kernel``: ``[block_m, block_n]`` output tiles, ``block_g`` groups
    of 16 K-elements per step, ``split_k`` K ranges per tile (partials summed by
    ``_splitk_reduce_kernel``)."""

    block_m: int
    block_n: int
    block_g: int
    split_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def mm_config_for(m: int, n: int, k: int, device: torch.device) -> MMConfig:
    """Launch configuration for an ``[m, k] x [n, k]^T`` product.

    Chosen on an H200 from the sweep in benchmarks/bench_ops.py (``--sweep``: 5-6 tile shapes x
    split-K in {1, 2, 4, 8} at M in {1, 16, 64, 128, 256, 512, 1024, 2048} with N=K=8192, and
    M in {16, 128, 1024} on the two 28672 shapes; benchmarks/results/2026-11-21-ops-h200.md):
    the winners were 16x128 tiles, 128 K-elements a step for M <= 16 (mma.sync; a 64-row wgmma
    tile wastes its shared memory on zero rows), 64x64 for M <= 64, 128x256 up to M = 256 and
    128x128 with 64 K-elements a step above. Split-K: the largest power of two keeping
    ``programs * num_warps <= 8 * multiprocessors`` and at least 4 K steps per program (with
    these tiles it picks the measured best split in 10 of the 12 swept cases and is within 5%
    in the other two).
    No autotuning at run time: a serving engine sees many M."""
    if m <= 16:
        cfg = MMConfig(block_m=16, block_n=128, block_g=8, split_k=1, num_warps=4, num_stages=3)
    elif m <= 64:
        cfg = MMConfig(block_m=64, block_n=64, block_g=8, split_k=1, num_warps=4, num_stages=3)
    elif m <= 256:
        cfg = MMConfig(block_m=128, block_n=256, block_g=8, split_k=1, num_warps=8, num_stages=3)
    else:
        cfg = MMConfig(block_m=128, block_n=128, block_g=4, split_k=1, num_warps=8, num_stages=4)
    kg = k // BLOCK_SIZE
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    budget = 8 * num_sms(device)
    split = 1
    # K first: it is static, and a symbolic M (a traced launch) is compared only when it decides
    while kg // (split * 2) >= 4 * cfg.block_g and tiles * split * 2 * cfg.num_warps <= budget:
        split *= 2
    return dataclasses.replace(cfg, split_k=split)


def mm_fp4_tiled(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: Alpha, out_dtype: torch.dtype, config: MMConfig,
) -> torch.Tensor:
    """Decode the activation once (``decode_fp4_halves``), then ``_mm_fp4_kernel`` with an
    explicit configuration (split-K adds ``_splitk_reduce_kernel``)."""
    m, n = a.shape[0], b.shape[0]
    kg = a.shape[1] * 2 // BLOCK_SIZE
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if kg == 0:
        return empty_sum_(out, alpha)
    if isinstance(alpha, torch.Tensor):
        alpha = alpha_tensor(alpha)
    x_lo, x_hi = decode_fp4_halves(a, a_scale)
    split = max(1, min(config.split_k, triton.cdiv(kg, config.block_g)))
    groups_per_split = triton.cdiv(triton.cdiv(kg, split), config.block_g) * config.block_g
    split = triton.cdiv(kg, groups_per_split)
    # every split covers groups_per_split groups (a multiple of block_g); masks only where the
    # last split runs past K
    even_k = kg % groups_per_split == 0
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=a.device)
    traceable(_mm_fp4_kernel)[grid](
        x_lo, x_hi, b, b_scale, *alpha_operands(alpha), target, m, n, kg, groups_per_split,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_G=config.block_g,
        GROUP_M=config.group_m, PARTIAL=split > 1, EVEN_K=even_k, FAST_DECODE=a.device.type == "cuda",
        **alpha_meta(alpha), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        block = 1024
        traceable(_splitk_reduce_kernel)[(triton.cdiv(m * n, block),)](
            target, *alpha_operands(alpha), out, m * n, split, BLOCK=block, **alpha_meta(alpha), num_warps=4)
    return out


def dequantize_fp4_triton(q: torch.Tensor, s: torch.Tensor, config: tuple[int, int] | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """``q * s`` as bf16 ``[R, K]`` (exact: every e2m1 x e4m3 product fits bf16), one pass.

    ``q``/``s`` contiguous; they may live in a peer GPU's mapped memory (the loads then go over
    NVLink). ``out``: a contiguous bf16 ``[R, K]`` to write into (default: a new tensor).
    ``config`` = ``(BLOCKS, num_warps)``, for benchmarks; default ``DEQUANT_LAUNCH``."""
    r, k = q.shape[0], q.shape[1] * 2
    if out is None:
        out = torch.empty((r, k), dtype=torch.bfloat16, device=q.device)
    elif out.shape != (r, k) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"dequantize_fp4_triton: out must be a contiguous bf16 [{r}, {k}] tensor; "
                         f"got {out.dtype} {list(out.shape)} (contiguous={out.is_contiguous()})")
    n_blocks = r * (k // BLOCK_SIZE)
    if n_blocks == 0:
        return out
    blocks, num_warps = config or DEQUANT_LAUNCH
    traceable(_dequant_kernel)[(triton.cdiv(n_blocks, blocks),)](
        q, s, out, n_blocks, BLOCKS=blocks, num_warps=num_warps)
    return out


def dequantize_fp4_pair_triton(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dequantize_fp4_triton`` of two tensors in one launch (``dequantize_fp4_group_triton``)."""
    a16, b16 = dequantize_fp4_group_triton([(a, a_scale), (b, b_scale)])
    return a16, b16


#: Tensors one ``_dequant_group_kernel`` launch dequantizes.
DEQUANT_GROUP = 4


def dequantize_fp4_group_triton(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """``[dequantize_fp4_triton(q, s) for q, s in tensors]``, the same values, up to
    ``DEQUANT_GROUP`` tensors per launch (each program runs ``_dequant_kernel``'s code on one
    tensor's blocks); contiguous operands."""
    outs = [torch.empty((q.shape[0], q.shape[1] * 2), dtype=torch.bfloat16, device=q.device) for q, _ in tensors]
    blocks, num_warps = DEQUANT_LAUNCH
    for start in range(0, len(tensors), DEQUANT_GROUP):
        segments = [(q, s, out, out.numel() // BLOCK_SIZE)
                    for (q, s), out in zip(tensors[start:start + DEQUANT_GROUP], outs[start:start + DEQUANT_GROUP])]
        _launch_grouped(_dequant_group_kernel, segments, [triton.cdiv(n, blocks) for *_, n in segments],
                        DEQUANT_GROUP, BLOCKS=blocks, num_warps=num_warps)
    return outs


def _launch_grouped(kernel: Any, segments: list[tuple], programs: list[int], slots: int, **meta: Any) -> None:
    """One launch of a grouped kernel (``_dequant_group_kernel``, ``_scale_group_kernel``) of
    ``slots`` segment slots: segment i's operands ``segments[i]`` and ``programs[i]`` programs, the
    unused slots filled with the last segment's tensors themselves (the kernel's ``SEGMENTS`` guards
    prune them: the note above the kernels), then the slots' end programs but the last. Nothing is
    launched where no segment has a program."""
    count = len(segments)
    ends = list(itertools.accumulate(programs))
    ends += [ends[-1]] * (slots - count)
    segments = segments + [segments[-1]] * (slots - count)
    if ends[-1]:
        traceable(kernel)[(ends[-1],)](*(arg for segment in segments for arg in segment), *ends[:-1],
                                       SEGMENTS=count, **meta)


def mm_fp4_dequant_mm(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: Alpha,
) -> torch.Tensor:
    """bf16 output through exact bf16 dequantization of both operands (one launch), cuBLAS and an
    in-place alpha multiply (fp32 accumulate, rounded to bf16, times alpha, rounded again)."""
    return mm_fp4_dequant_mm_products(a, a_scale, [(b, b_scale, alpha)])[0]


def mm_fp4_dequant_mm_products(
    a: torch.Tensor, a_scale: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor, Alpha]],
) -> list[torch.Tensor]:
    """``[mm_fp4_dequant_mm(a, b, a_scale, b_scale, alpha) for b, b_scale, alpha in weights]``, bit
    for bit: the activation dequantized once with the weights (``dequantize_fp4_group_triton``), one
    ``torch.mm`` a weight, the alphas applied in one launch (``scale_by_alphas_``)."""
    a16, *weights16 = dequantize_fp4_group_triton([(a, a_scale), *((b, b_scale) for b, b_scale, _ in weights)])
    return scale_by_alphas_([torch.mm(a16, b16.t()) for b16 in weights16], [alpha for *_, alpha in weights])


#: Elements per program of ``_scale_group_kernel`` (16 per thread at 4 warps: 32-byte bf16 accesses).
SCALE_BLOCK = 2048


def scale_by_alpha_(x: torch.Tensor, alpha: Alpha) -> torch.Tensor:
    """In place ``x = x.dtype(fp32(x) * alpha)`` (one rounding, to nearest even) and return ``x``;
    ``alpha`` a one-element fp32 device tensor (not synchronised) or ``GlobalScales`` of two,
    ``x`` contiguous bf16/fp16."""
    return scale_by_alphas_([x], [alpha])[0]


#: Tensors one ``_scale_group_kernel`` launch scales.
SCALE_GROUP = 3


def scale_by_alphas_(xs: list[torch.Tensor], alphas: list[Alpha]) -> list[torch.Tensor]:
    """``[scale_by_alpha_(x, alpha) for x, alpha in zip(xs, alphas)]``, the same bits, up to
    ``SCALE_GROUP`` tensors per launch where they have one dtype and their alphas one form
    (``alpha_meta``)."""
    for x, alpha in zip(xs, alphas):
        if not x.is_contiguous():
            raise ValueError(f"scale_by_alpha_: x must be contiguous; got strides {x.stride()}")
        for t in alpha_operands(alpha):
            if t.numel() != 1 or t.dtype != torch.float32:
                raise ValueError(f"scale_by_alpha_: alpha (or each of its GlobalScales) must be a one-element "
                                 f"float32 tensor; got {t.dtype} {list(t.shape)}")
    todo = [(x, alpha) for x, alpha in zip(xs, alphas) if x.numel()]
    while todo:
        meta = alpha_meta(todo[0][1])
        batch = [item for item in todo if alpha_meta(item[1]) == meta and item[0].dtype == todo[0][0].dtype]
        batch = batch[:SCALE_GROUP]
        todo = [item for item in todo if not any(item is b for b in batch)]
        _launch_grouped(_scale_group_kernel, [(x, *alpha_operands(alpha), x.numel()) for x, alpha in batch],
                        [triton.cdiv(x.numel(), SCALE_BLOCK) for x, _ in batch], SCALE_GROUP,
                        BLOCK=SCALE_BLOCK, **meta, num_warps=4)
    return xs


@functools.cache
def hopper_kernels() -> Any:
    """``fp4fuse.kernels.triton.mm_hopper`` (the Gluon GEMM), or None where this Triton has no Gluon."""
    try:
        from fp4fuse.kernels.triton import mm_hopper
    except ImportError as exc:
        logger.debug("fp4fuse: no Hopper Gluon GEMM: %s", exc)
        return None
    return mm_hopper


def hopper_serves(m: int | torch.SymInt, n: int, k: int, out_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``mm_fp4_triton`` sends this product to the Hopper Gluon GEMM (``mm_hopper.hopper_serves``:
    sm_90, Triton 3.6, ``K % 64 == 0``, and the shape rule ``mm_hopper.serves_shape``),
    provided the weight is aligned (checked per call)."""
    hopper = hopper_kernels() if device.type == "cuda" else None
    return hopper is not None and hopper.hopper_serves(m, n, k, out_dtype, device)


def hopper_gemm(m: int, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype) -> Callable[..., Any] | None:
    """``mm_hopper.mm_fp4_hopper`` with the split-K count of an ``[m, K] x b^T`` product where the
    kernel computes it (:func:`hopper_serves` and the weight aligned for it), else None. Row blocks
    of that product launched through it sum as the whole product does. Under a tracer the
    weight's alignment is unknown (fake tensors): ``mm_fp4_hopper`` itself, whose traced form
    checks it per call and takes the other path as this function does (:func:`mm_fp4_hopper_decoded`)."""
    n, k = b.shape[0], b.shape[1] * 2
    if not hopper_serves(m, n, k, out_dtype, b.device):
        return None
    hopper = hopper_kernels()
    if tracing():
        return hopper.mm_fp4_hopper
    if not hopper.hopper_operands_ok(b, b_scale):
        return None
    return functools.partial(hopper.mm_fp4_hopper, split_k=hopper.split_for(m, n, k, num_sms(b.device)))


def mm_fp4_hopper_decoded(
    a: torch.Tensor, a_scale: torch.Tensor, xlo: torch.Tensor, xhi: torch.Tensor, b: torch.Tensor,
    b_scale: torch.Tensor, alpha: torch.Tensor, alpha_b: torch.Tensor, alpha_from_scales: bool, div_rn: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The CUDA kernel of ``fp4fuse::_mm_fp4_hopper``, the Gluon GEMM's call in a lowered graph
    (``mm_hopper.mm_fp4_hopper`` under a tracer): its default launch on the activation already
    decoded (``xlo, xhi = mm_hopper.decode_activation(a, a_scale)``); alpha in ``alpha_operands`` /
    ``alpha_meta``'s form. A weight that kernel cannot read (misaligned, known only per call:
    ``mm_hopper.hopper_operands_ok``) takes :func:`mm_fp4_triton`'s other path, as the eager op
    does with it."""
    scales = GlobalScales(alpha, alpha_b, div_rn) if alpha_from_scales else alpha
    hopper = hopper_kernels()
    if not hopper.hopper_operands_ok(b, b_scale):
        return mm_fp4_triton(a, b, a_scale, b_scale, scales, out_dtype)
    return hopper.mm_fp4_hopper_halves(xlo, xhi, b, b_scale, scales, out_dtype)


def mm_fp4_triton(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: Alpha, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``alpha * (q_a * s_a) @ (q_b * s_b)^T`` as ``[M, N]`` ``out_dtype`` (see module docstring)."""
    return _mm_on_path(_gemm_path(a.shape[0], b, b_scale, out_dtype), a, b, a_scale, b_scale, alpha, out_dtype)


def _mm_on_path(route: tuple[str, Callable[..., Any] | None], a: torch.Tensor, b: torch.Tensor,
                a_scale: torch.Tensor, b_scale: torch.Tensor, alpha: Alpha, out_dtype: torch.dtype) -> torch.Tensor:
    """``mm_fp4_triton`` on the kernel ``route`` (``_gemm_path``'s answer for these operands) names."""
    m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
    path, hopper = route
    if path == "hopper":
        return hopper(a, b, a_scale, b_scale, alpha, out_dtype)
    if path == "decode":
        return mm_fp4_decode(a, b, a_scale, b_scale, alpha, out_dtype)
    if path == "dequant":
        return mm_fp4_dequant_mm(a, b, a_scale, b_scale, alpha)
    return mm_fp4_tiled(a, b, a_scale, b_scale, alpha, out_dtype, mm_config_for(m, n, k, a.device))


def _gemm_path(m: int | torch.SymInt, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
               ) -> tuple[str, Callable[..., Any] | None]:
    """Which kernel computes an ``[m, K] x b^T`` product (module docstring): ``"hopper"`` (with the
    launch ``hopper_gemm`` returns), ``"decode"``, ``"dequant"`` or ``"tiled"``."""
    hopper = hopper_gemm(m, b, b_scale, out_dtype)
    if hopper is not None:
        return "hopper", hopper
    if m <= DECODE_MAX_M:
        return "decode", None
    if out_dtype == torch.bfloat16 and m >= DEQUANT_MIN_M:
        return "dequant", None
    return "tiled", None


def mm_fp4_group_triton(
    a: torch.Tensor, a_scale: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor, Alpha]],
    out_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """``[mm_fp4_triton(a, b, a_scale, b_scale, alpha, out_dtype) for b, b_scale, alpha in weights]``,
    bit for bit, in fewer launches (``mm_fp4_calls_triton``)."""
    return mm_fp4_calls_triton([(a, b, a_scale, b_scale, alpha, out_dtype) for b, b_scale, alpha in weights])


def mm_fp4_calls_triton(calls: list[tuple]) -> list[torch.Tensor]:
    """``[mm_fp4_triton(*call) for call in calls]`` (each call ``mm_fp4``'s arguments in order), bit
    for bit, in fewer launches: the decode GEMM's products of one output dtype share launches where
    their activations have one shape (``mm_decode.mm_fp4_decode_products``); the Hopper GEMM's and
    dequantize + cuBLAS's products of one activation (the same ``a`` and ``a_scale`` tensors) and
    output dtype decode or dequantize it once (``mm_hopper.mm_fp4_hopper_products``,
    ``mm_fp4_dequant_mm_products``); the others are one call each."""
    outs: list[torch.Tensor | None] = [None] * len(calls)
    routes = [_gemm_path(a.shape[0], b, b_scale, out_dtype) for a, b, _, b_scale, _, out_dtype in calls]
    paths = [path for path, _ in routes]
    decoded = [i for i, path in enumerate(paths) if path == "decode"]
    if len({calls[i][5] for i in decoded}) == 1:
        products = [DecodeProduct(a, a_scale, b, b_scale, alpha) for a, b, a_scale, b_scale, alpha, _ in
                    (calls[i] for i in decoded)]
        for i, out in zip(decoded, mm_fp4_decode_products(products, calls[decoded[0]][5])):
            outs[i] = out
    shared = {"hopper": lambda a, a_scale, weights, out_dtype: hopper_kernels().mm_fp4_hopper_products(
                  a, a_scale, weights, out_dtype),
              "dequant": lambda a, a_scale, weights, out_dtype: mm_fp4_dequant_mm_products(a, a_scale, weights)}
    for path, products_of in shared.items():
        for members in _one_activation([i for i, p in enumerate(paths) if p == path], calls):
            a, _, a_scale, _, _, out_dtype = calls[members[0]]
            weights = [(calls[i][1], calls[i][3], calls[i][4]) for i in members]
            for i, out in zip(members, products_of(a, a_scale, weights, out_dtype)):
                outs[i] = out
    return [out if out is not None else _mm_on_path(route, *call) for out, route, call in zip(outs, routes, calls)]


def _one_activation(indices: list[int], calls: list[tuple]) -> list[list[int]]:
    """``indices`` of ``calls`` grouped by activation (the same ``a`` and ``a_scale`` objects) and
    output dtype, in order; groups of two or more only."""
    groups: dict[tuple[int, int, torch.dtype], list[int]] = {}
    for i in indices:
        a, _, a_scale, _, _, out_dtype = calls[i]
        groups.setdefault((id(a), id(a_scale), out_dtype), []).append(i)
    return [members for members in groups.values() if len(members) > 1]
