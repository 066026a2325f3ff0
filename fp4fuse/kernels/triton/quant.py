"""NVFP4 quantization in one Triton pass: read ``x`` once, write codes ``q`` and block scales ``s``.

Contract: ``scaled_fp4_quant_triton(x, global_scale) -> (q, s)`` with x ``[M, K]`` bf16/fp16/fp32
(contiguous, K a multiple of 16), global_scale a one-element fp32 device tensor (encode convention
``448 * 6 / amax``); q uint8 ``[M, K/2]`` (element 2j in the low nibble), s float8_e4m3fn ``[M, K/16]``
(linear). Bit-equal to :func:`fp4fuse.nvfp4.format.quantize_reference`, including its non-finite rules:
a NaN in a block makes the block scale NaN and all of the block's codes 0, ``+-inf`` saturates to
scale 448 and code ``+-6``, an all-zero block gives scale 0 and codes 0, and a global scale outside
``(0, inf)`` (0, negative, ``+-inf``, NaN) makes every block scale NaN (``0x7F``) and every code 0.

Arithmetic, in the reference's order, fp32: ``s = e4m3(min(div_rn(amax, 6) * gs, 448))`` (NaN
propagates; the e4m3 cast rounds to nearest even: the hardware ``cvt.rn.satfinite`` on CUDA, a
bit-exact integer emulation of torch's cast elsewhere), then each element's code is
``e2m1_rne((x * gs) / s)``. The per-element division has two exact implementations
(:class:`QuantDivision`):

* ``IEEE_DIV``: ``tl.math.div_rn(|x * gs|, s)``, then the round-to-nearest-even thresholds of
  format.py on the quotient.
* ``THRESHOLD`` (default): compare ``y = |x * gs|`` with ``t * s`` for the seven e2m1 decision
  points t. Because every e4m3 value is ``2**e * (8 + m) / 8``, ``t * s`` is exact in fp32 and the
  fp32 spacing of y near ``t * s`` is finer than the quotient's rounding interval, so
  ``RN(y / s) > t  <=>  y > t * s`` (ties at 0.25, 1.25, 2.5, 5) and
  ``RN(y / s) >= t  <=>  y >= t * s`` (at 0.75, 1.75, 3.5; ``t * s`` is never a power of two there).
  Checked on every fp32 mantissa of y for all 8 scale mantissas (470M cases, 0 mismatches);
  tests/test_triton_kernels.py repeats that on the GPU and, under Triton's interpreter, checks
  the values next to each boundary. It replaces an IEEE division per element; on an H200 the
  kernel drops from 38.7 to 23.4 SASS instructions an element (207 -> 169 us on 16384x8192).

Sign: ``signbit(x) ^ signbit(gs) ^ signbit(s)``, which is the sign bit IEEE gives the quotient.

Layout of the work: x is a flat array of 16-element blocks (K is a multiple of 16, rows are
contiguous), read as pairs of elements packed in one integer (int32 for 16-bit inputs, int64 for
fp32); each thread owns one block per chunk and writes one code byte per pair and one scale
byte. The grid is persistent and prefetches its next chunk. The kernel is compute-bound on an
H200 (49% of the copy bandwidth; see benchmarks/results/2026-11-21-ops-h200.md).
"""
from __future__ import annotations

import enum
import logging

import torch
import triton
import triton.language as tl

from fp4fuse.kernels.triton.launch import traceable
from fp4fuse.nvfp4.format import BLOCK_SIZE

logger = logging.getLogger(__name__)

__all__ = ["QuantDivision", "quant_launch_config", "scaled_fp4_quant_triton"]


class QuantDivision(enum.IntEnum):
    """How the kernel evaluates ``e2m1_rne((x * gs) / s)``; both are bit-equal to the reference."""

    IEEE_DIV = 0
    THRESHOLD = 1


class _InputKind(enum.IntEnum):
    BF16 = 0
    FP16 = 1
    FP32 = 2


_KIND_BF16 = tl.constexpr(int(_InputKind.BF16))
_KIND_FP16 = tl.constexpr(int(_InputKind.FP16))
_DIV_IEEE = tl.constexpr(int(QuantDivision.IEEE_DIV))

_INPUT_KIND = {torch.bfloat16: _InputKind.BF16, torch.float16: _InputKind.FP16, torch.float32: _InputKind.FP32}
# x is read as pairs of elements packed in one integer: element 2j in the low half.
_PAIR_DTYPE = {torch.bfloat16: torch.int32, torch.float16: torch.int32, torch.float32: torch.int64}

DEFAULT_DIVISION = QuantDivision.THRESHOLD


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _unpack_pairs(u, IN_KIND: tl.constexpr):
    """Packed element pairs -> (even, odd) elements as fp32 (exact)."""
    if IN_KIND == _KIND_BF16:
        lo = (u << 16).to(tl.float32, bitcast=True)
        hi = (u & -65536).to(tl.float32, bitcast=True)
    elif IN_KIND == _KIND_FP16:
        lo = (u & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (u >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = u.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (u >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _e2m1_magnitude(y, s, DIVISION: tl.constexpr):
    """e2m1 magnitude code (0..7, int32) of ``RN(y / s)`` for y >= 0 (inf allowed), s > 0 finite.

    Decision points as in format.py: inclusive at 0.75, 1.75, 3.5 (ties go to the even code
    above), strict at 0.25, 1.25, 2.5, 5 (ties go to the even code below). The seven points are
    searched as a binary tree (one compare per code bit): the inclusive ones are exactly the
    upper two levels and the strict ones the leaves, so each level keeps its tie rule."""
    if DIVISION == _DIV_IEEE:
        v = tl.math.div_rn(y, s)
        scale = 1.0
    else:
        v = y
        scale = s
    bit2 = v >= 1.75 * scale
    bit1 = v >= tl.where(bit2, 3.5 * scale, 0.75 * scale)
    leaf_hi = tl.where(bit1, 5.0 * scale, 2.5 * scale)
    leaf_lo = tl.where(bit1, 1.25 * scale, 0.25 * scale)
    bit0 = v > tl.where(bit2, leaf_hi, leaf_lo)
    return (bit2.to(tl.int32) << 2) | (bit1.to(tl.int32) << 1) | bit0.to(tl.int32)


@triton.jit
def _signbit(v):
    return (v.to(tl.int32, bitcast=True) >> 31) & 1


@triton.jit
def _e4m3_rne(s):
    """fp32 -> e4m3fn, round to nearest even, as torch's cast does (bit-exact on any backend,
    Triton's interpreter included): returns (bits as int32 in [0, 255], the rounded value in fp32).

    |s| > 464 (rounds past 448) and NaN give the NaN code 0x7F; callers saturate to 448 first."""
    sign = (s.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(s)
    ab = a.to(tl.int32, bitcast=True)
    # normal range (a >= 2**-6): keep 3 mantissa bits, ties to even, on the fp32 bit pattern
    r = (ab + 0x7FFFF + ((ab >> 20) & 1)) & -1048576
    normal_bits = (r >> 20) - (120 << 3)
    # subnormal range: adding 2**14 rounds to a multiple of 2**-9 (the e4m3 subnormal step)
    t = a + 16384.0
    sub_bits = t.to(tl.int32, bitcast=True) - 0x46800000
    is_sub = a < 0.015625
    bits = tl.where(is_sub, sub_bits, normal_bits)
    val = tl.where(is_sub, t - 16384.0, r.to(tl.float32, bitcast=True))
    is_nan = (a != a) | (a > 464.0)  # noqa: PLR0124  (a NaN test)
    bits = tl.where(is_nan, 0x7F, bits) | sign
    val = tl.where(is_nan, float("nan"), val)
    val = tl.where(sign != 0, -val, val)
    return bits, val


@triton.jit
def _quant_chunk(u, blk, in_range, gs, q_ptr, s_ptr,
                 IN_KIND: tl.constexpr, DIVISION: tl.constexpr, FAST_CVT: tl.constexpr):
    """Quantize one chunk: ``u`` = packed element pairs ``[BLOCKS, 8]`` of blocks ``blk``."""
    lo, hi = _unpack_pairs(u, IN_KIND)
    amax = tl.reduce(_max_nan(tl.abs(lo), tl.abs(hi)), 1, _max_nan)   # NaN if the block has one
    s = tl.math.div_rn(amax, 6.0) * gs
    s = tl.where((gs > 0.0) & (gs < float("inf")), s, float("nan"))  # bad gs poisons: +NaN scales
    s = tl.where(s > 448.0, 448.0, s)                             # saturate; NaN stays NaN
    if FAST_CVT:
        s8 = s.to(tl.float8e4nv)                                  # cvt.rn.satfinite: RNE, NaN kept
        s_bits = s8.to(tl.uint8, bitcast=True)
        sd = s8.to(tl.float32)
    else:
        s_bits, sd = _e4m3_rne(s)
    tl.store(s_ptr + blk, s_bits.to(tl.uint8), mask=in_range)

    dead = (sd == 0.0) | (sd != sd)  # noqa: PLR0124  (zero or NaN scale: all codes 0)
    s_abs = tl.where(dead, 1.0, tl.abs(sd))[:, None]
    gs_abs = tl.abs(gs)
    mag_lo = _e2m1_magnitude(tl.abs(lo) * gs_abs, s_abs, DIVISION)
    mag_hi = _e2m1_magnitude(tl.abs(hi) * gs_abs, s_abs, DIVISION)
    sign_blk = (_signbit(gs) ^ _signbit(sd))[:, None]
    code_lo = mag_lo | ((_signbit(lo) ^ sign_blk) << 3)
    code_hi = mag_hi | ((_signbit(hi) ^ sign_blk) << 3)
    byte = tl.where(dead[:, None], 0, code_lo | (code_hi << 4)).to(tl.uint8)
    pair = blk[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(q_ptr + pair, byte, mask=in_range[:, None])


@triton.jit
def _quant_kernel(
    x_ptr, gs_ptr, q_ptr, s_ptr, n_blocks, n_chunks,
    IN_KIND: tl.constexpr, DIVISION: tl.constexpr, BLOCKS: tl.constexpr, FAST_CVT: tl.constexpr,
):
    """Persistent: program p quantizes chunks p, p + P, p + 2P, ... (P programs, BLOCKS blocks a
    chunk), loading chunk i + P while chunk i is computed so that memory and arithmetic overlap."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCKS).to(tl.int64)
    j = tl.arange(0, 8)
    gs = tl.load(gs_ptr)
    blk = offs + pid * BLOCKS
    u = tl.load(x_ptr + blk[:, None] * 8 + j[None, :], mask=(blk < n_blocks)[:, None], other=0)
    for chunk in range(pid, n_chunks, nprog):
        blk = offs + chunk * BLOCKS
        nxt = blk + nprog * BLOCKS
        u_next = tl.load(x_ptr + nxt[:, None] * 8 + j[None, :], mask=(nxt < n_blocks)[:, None], other=0)
        _quant_chunk(u, blk, blk < n_blocks, gs, q_ptr, s_ptr, IN_KIND, DIVISION, FAST_CVT)
        u = u_next


def quant_launch_config(n_blocks: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCKS, num_warps, programs)`` for ``n_blocks`` 16-element blocks.

    Chosen on an H200 (benchmarks/results/2026-11-21-ops-h200.md): one block per thread
    (BLOCKS = 32 * num_warps) compiles to ~23 instructions an element where 2 or 4 blocks a
    thread spill predicates (~30); on 16384x8192 bf16 the sweep of (BLOCKS, warps, programs per
    multiprocessor) in {(256, 8, 2/4/8), (128, 4, 8/16), (512, 16, 2)} spanned 166-175 us, best
    (128, 4, 16)."""
    blocks, num_warps = 128, 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return blocks, num_warps, torch.sym_max(1, torch.sym_min(triton.cdiv(n_blocks, blocks), 16 * sms))


def scaled_fp4_quant_triton(
    x: torch.Tensor, global_scale: torch.Tensor,
    division: QuantDivision = DEFAULT_DIVISION,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` to NVFP4 (see module docstring). Inputs are validated by the op layer.

    ``division`` and ``config`` (``(BLOCKS, num_warps, programs)``) exist for tests and
    benchmarks."""
    m, k = x.shape
    q = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty((m, k // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=x.device)
    n_blocks = m * (k // BLOCK_SIZE)
    if n_blocks == 0:
        return q, s
    x = x.contiguous()
    pair_dtype = _PAIR_DTYPE[x.dtype]
    if (x.storage_offset() * x.element_size()) % pair_dtype.itemsize:
        x = x.clone()
    pairs = x.view(pair_dtype)
    if n_blocks >= 2**31:
        raise ValueError(f"fp4fuse.scaled_fp4_quant: {m}x{k} has {n_blocks} blocks of 16; the Triton kernel indexes blocks with int32")
    gs = global_scale.reshape(1).to(torch.float32)
    blocks, num_warps, programs = config or quant_launch_config(n_blocks, x.device)
    traceable(_quant_kernel)[(programs,)](
        pairs, gs, q, s.view(torch.uint8), n_blocks, triton.cdiv(n_blocks, blocks),
        IN_KIND=int(_INPUT_KIND[x.dtype]), DIVISION=int(division), BLOCKS=blocks,
        FAST_CVT=x.device.type == "cuda", num_warps=num_warps,
    )
    return q, s
