"""Shared pieces of fp4fuse's NVFP4 GEMMs: Triton device functions decoding e2m1 codes and e4m3
block scales exactly into the GEMMs' fp16 operand encoding, the grouped tile order, the decode of an
activation into fp16 halves (``decode_fp4_halves``, read by the tiled and the Hopper Gluon GEMM) and
the device's multiprocessor count.

Operand encoding: ``bits = (c & 7) << 9 | (c & 8) << 12`` is the fp16 pattern of ``e2m1(c) * 2**-14``
(the e2m1 subnormal 0.5 lands on an fp16 subnormal); times an e4m3 scale the product is an
integer multiple of 2**-24 with at most 6 significant bits, exact in fp16; products of two such
values are exact in fp32, and an epilogue multiplies by ``DECODE_SCALE_UNDO = 2**28`` (exact).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4fuse.kernels.triton.launch import traceable

__all__ = ["DECODE_PTX", "DECODE_SCALE_UNDO", "decode_codes", "decode_fp4_halves", "decode_scales", "grouped_tile",
           "num_sms", "readable_rows", "split_ranges"]

#: 2**14 per operand from the fp16 decode, undone in the GEMM epilogues.
DECODE_SCALE_UNDO = tl.constexpr(268435456.0)  # 2**28


@triton.jit
def _e4m3_to_fp16(bits):
    """e4m3fn bits (uint8 tensor) -> fp16 value, exact (incl. subnormals; 0x7F/0xFF -> NaN)."""
    b = bits.to(tl.int16)
    # e4m3 placed in fp16's exponent/mantissa fields is the value times 2**-8 (subnormals too)
    v = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


# One PTX block per 4 code bytes (8 codes). For every byte at once: l = fp16 high byte of its
# low nibble (magnitude bits 2..0 -> bits 3..1, sign bit 3 -> bit 7), h = the same for its high
# nibble; then prmt places byte i of l/h in the high byte of a 16-bit lane (low byte 0), which is
# the fp16 pattern of e2m1 * 2**-14. Outputs: $0,$1 = low nibbles of bytes 0..3 as fp16x2,
# $2,$3 = high nibbles; input $4 = the 4 bytes.
# One line (Inductor copies this global into the modules it compiles, and breaks a multi-line string).
DECODE_PTX = tl.constexpr(
    "{ .reg .b32 a, b, l, h, z; mov.b32 z, 0; "
    "shl.b32 a, $4, 1; and.b32 a, a, 0x0E0E0E0E; shl.b32 b, $4, 4; and.b32 b, b, 0x80808080; or.b32 l, a, b; "
    "shr.b32 a, $4, 3; and.b32 a, a, 0x0E0E0E0E; and.b32 b, $4, 0x80808080; or.b32 h, a, b; "
    "prmt.b32 $0, z, l, 0x5040; prmt.b32 $1, z, l, 0x7060; prmt.b32 $2, z, h, 0x5040; prmt.b32 $3, z, h, 0x7060; }"
)


@triton.jit
def decode_codes(codes, FAST_DECODE: tl.constexpr):
    """Packed code bytes (uint8, any shape) -> (low, high) nibbles as fp16 ``e2m1 * 2**-14``.

    FAST_DECODE (CUDA): inline PTX on 4 bytes at a time. Otherwise (Triton's interpreter) the
    same bits from per-element integer ops."""
    if FAST_DECODE:
        lo, hi = tl.inline_asm_elementwise(
            DECODE_PTX, "=r,=r,=r,=r,r", [codes], dtype=(tl.float16, tl.float16),
            is_pure=True, pack=4)
    else:
        c = codes.to(tl.int16)
        lo = (((c & 0x7) << 9) | ((c & 0x8) << 12)).to(tl.float16, bitcast=True)
        hi = (((c & 0x70) << 5) | ((c & 0x80) << 8)).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def decode_scales(scales, FAST_DECODE: tl.constexpr):
    """e4m3 scales -> fp16 (exact): the hardware convert on CUDA, integer ops otherwise."""
    if FAST_DECODE:
        return scales.to(tl.float16)
    return _e4m3_to_fp16(scales.to(tl.uint8, bitcast=True))


def split_ranges(steps: int, split_k: int) -> tuple[int, int]:
    """``(splits, steps per split)`` of a split-K launch over ``steps`` K steps asked for ``split_k``
    ranges: at most one range per step, every range at least one step (the last may be shorter)."""
    iters = -(-steps // max(1, min(split_k, steps)))
    return -(-steps // iters), iters


@triton.jit
def readable_rows(rows, M):
    """``rows`` of a tile with those past ``M`` replaced by ``row % M``: rows a kernel may read
    without a mask and never stores. Spread over distinct rows (which other programs read anyway)
    rather than all reading row 0: a hundred rows of one tile loading the same line each K step
    made the decode GEMM up to 2.6x slower at M = 130 (benchmarks/results/)."""
    return tl.where(rows < M, rows, rows % M)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid``'s ``(row tile, column tile)`` of an ``[M, N]`` output in grouped order:
    ``GROUP_M`` row tiles share each column (weight) tile while it sits in L2. Also called from
    Gluon kernels (scalar arithmetic only)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _decode_halves_kernel(q_ptr, s_ptr, lo_ptr, hi_ptr, n_blocks, BLOCKS: tl.constexpr,
                          FAST_DECODE: tl.constexpr, GROUP: tl.constexpr):
    """NVFP4 ``[R, K/2]`` -> fp16 halves ``[R, K/2]`` (element 2j -> lo[j], 2j+1 -> hi[j]) in the
    GEMM's operand encoding ``e2m1 * 2**-14 * s`` (exact), flat over 16-element blocks; GROUP > 0:
    columns in wgmma fragment order within each group of GROUP (``decode_fp4_halves``)."""
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    in_range = blk < n_blocks
    x = tl.arange(0, 8)
    offs = blk[:, None] * 8 + x[None, :]
    codes = tl.load(q_ptr + offs, mask=in_range[:, None], other=0)
    scales = decode_scales(tl.load(s_ptr + blk, mask=in_range, other=0.0), FAST_DECODE)
    lo, hi = decode_codes(codes, FAST_DECODE)
    if GROUP > 0:
        # column c = 8Q t + 4i + 2j + b of a group of 32Q goes to 16i + 8j + 2t + b
        per_group: tl.constexpr = GROUP // 8
        c = (blk % per_group)[:, None] * 8 + x[None, :]
        t = c // (GROUP // 4)
        rest = c % (GROUP // 4)
        offs = (blk // per_group)[:, None] * GROUP + (rest // 4) * 16 + ((rest // 2) % 2) * 8 + t * 2 + rest % 2
    tl.store(lo_ptr + offs, lo * scales[:, None], mask=in_range[:, None])
    tl.store(hi_ptr + offs, hi * scales[:, None], mask=in_range[:, None])


def decode_fp4_halves(q: torch.Tensor, s: torch.Tensor, fragment_group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 ``[R, K/2]`` -> fp16 ``(lo, hi)`` ``[R, K/2]``: elements 2j / 2j+1 as
    ``e2m1 * 2**-14 * s`` (exact), the operand encoding of ``mm._mm_fp4_kernel`` and the Hopper Gluon GEMM.

    ``fragment_group`` G = 32 Q (Q = 1 or 2; 0: columns in order): within each group of G columns
    (``K/2 % G == 0``), column ``16 i + 8 j + 2 t + b`` holds column ``8 Q t + 4 i + 2 j + b``
    (t < 4, i < 2 Q, j, b < 2): the order in which the Hopper Gluon GEMM's wgmma fragments hold a
    K step of G code bytes when each thread loads 8 Q contiguous bytes of a weight row
    (``mm_hopper``, FRAGMENT_ORDER). A K permutation of both operands: the products are the same."""
    if fragment_group not in (0, 32, 64) or (fragment_group and q.shape[-1] % fragment_group):
        raise ValueError(f"decode_fp4_halves: fragment_group must be 0, 32 or 64 and divide K/2; got "
                         f"{fragment_group} for K/2 = {q.shape[-1]}")
    lo = torch.empty(q.shape, dtype=torch.float16, device=q.device)
    hi = torch.empty_like(lo)
    n_blocks = q.numel() // 8
    if n_blocks == 0:
        return lo, hi
    blocks = 128
    traceable(_decode_halves_kernel)[(triton.cdiv(n_blocks, blocks),)](
        q, s, lo, hi, n_blocks, BLOCKS=blocks, FAST_DECODE=q.device.type == "cuda", GROUP=fragment_group,
        num_warps=4)
    return lo, hi


_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device``; off CUDA (Triton's interpreter) an H100/H200's 132."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]

