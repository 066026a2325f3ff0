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
``e2m1_rne(z)`` with ``z = y / s``, ``y = RN(|x| * |gs|)``, sign ``signbit(x) ^ signbit(gs) ^
signbit(s)`` (the sign IEEE gives the quotient). Three exact implementations
(:class:`QuantDivision`):

* ``IEEE_DIV``: ``tl.math.div_rn(y, s)``, then the round-to-nearest-even thresholds of format.py
  on the quotient (a compare tree on the ALU pipe).
* ``FMA_SAT`` (default): nearly all per-element work on the FP32 (FMA) pipe, see below.

Why comparing the *exact* quotient with the decision points is right (``FMA_SAT``
relies on it): every e4m3 value is ``s = 2**e * d`` with ``d = (8 + m) / 8 < 2``, so for a
decision point t, ``t * s`` is exact in fp32, and an fp32 ``y != t * s`` is at least
``ulp(y) >= ulp(t) * 2**e`` away from it, i.e. ``|z - t| >= ulp(t) / d > ulp(t) / 2``: the reference's
rounded quotient ``RN(z)`` lands on t only when ``z == t``. Hence ``e2m1_rne(RN(z))`` equals the
e2m1 rounding of the exact z, ties (``z == t``) to even, and any evaluation that decides every
``z`` vs ``t`` question correctly, ties included, is bit-equal to the reference.

``FMA_SAT``, per element (``r8 ~ 1 / (8 s)`` within 1 ulp, one ``rcp.approx`` per block):

1. Exact ``h = RN(z / 8)`` by one Markstein correction: ``q0 = sat(y * r8)``,
   ``rho = fma(q0, -8 s, y)`` (exact: ``q0`` is within a few ulps of ``z / 8``, so ``rho`` needs at
   most ~8 bits), ``h = fma(rho, r8, q0)``. ``h`` is the single rounding of
   ``z / 8 + (q0 - z / 8) * (1 - 8 s r8)``; the error term is below ``2**-21 ulp(h)``, while ``z / 8``
   is never closer than ``ulp(h) / 30`` to an fp32 midpoint (``z = y / s`` has denominator ``8 + m``),
   so ``h`` is the correctly rounded ``z / 8``, and ``h == t / 8`` exactly when ``z == t``. The
   saturation keeps ``q0`` finite: ``y = inf`` gives ``rho = inf``, ``h = inf``; NaN gives 0.
2. e2m1 rounding of ``z = 8 h`` as a sum of three uniform roundings: the e2m1 grid is uniform on
   [0, 2] (step 0.5), [2, 4] (step 1) and [4, 6] (step 2), so with ``a = sat(4h)``, ``b = sat(4h - 1)``,
   ``c = sat(4h - 2)`` (``.sat`` clamps to [0, 1], NaN to 0) the magnitude code is
   ``RNE(4a) + RNE(2b) + RNE(c)``. Only one piece is fractional at a time and the others add even
   integers (4, 6), so ties-to-even in a piece is ties-to-even of the code, which is the e2m1
   rule at every decision point (0.25, 1.25, 2.5, 5 round down; 0.75, 1.75, 3.5 round up). The
   roundings are magic-number additions: ``P = fma(a, 4, M)``, ``P = fma(b, 2, P)``, ``P = P + c``
   with ``M = 2**23 + 8 * sign_blk`` (ulp 1), so ``bits(P) = bits(2**23) + code + 8 * sign_blk``.
3. Packing: ``bits(P_even) + (bits(P_odd) << 4)`` has the code byte of an element pair in its
   low byte; ``prmt`` gathers four such bytes into a word. The element sign bits come from the
   input's sign bytes, gathered with ``prmt`` (sign-replicating byte permute) and XOR-ed into the
   code words; with ``gs = inf`` they are kept only where the code is nonzero (``0 * inf`` is NaN,
   code +0).

Why ``FMA_SAT`` is fast: nearly all of its per-element work runs on the full-rate FMA pipe, where a
compare-and-select tree (``IEEE_DIV``, and an earlier threshold-compare mode that failed its GPU
test and was removed) runs on the half-rate ALU pipe; :func:`quant_sass_counts` counts the SASS
instructions per element of each mode (numbers: benchmarks/results/).

Verification of ``FMA_SAT`` beyond the tests: with exact fp32 FMA semantics on the CPU, every fp32
y with ``z`` in [1/16, 8) for all 8 scale mantissas, each with ``r8`` correctly rounded and 1 ulp
below and above (1.25e9 cases), plus 2.4e8 random and near-boundary cases at scale exponents
-9 .. 8 (infinities, zeros and subnormals included): 0 mismatches with
``e2m1_encode(RN(y / s))``; the fp64-emulated FMA of the interpreter path, 3.4e8 cases: 0.

Layout of the work: x is a flat array of 16-element blocks (K is a multiple of 16, rows are
contiguous); each thread owns one block per chunk, read as 16-byte vectors (2 for 16-bit inputs,
4 for fp32), and writes two 32-bit code words and one scale byte; by default each program does
one chunk (the kernel also loops over chunks for a persistent grid).
"""
from __future__ import annotations

import enum
import logging
import re

import torch
import triton
import triton.language as tl

from fp4fuse.kernels.triton.decode import num_sms
from fp4fuse.kernels.triton.launch import traceable
from fp4fuse.nvfp4.format import BLOCK_SIZE

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_MAXIMA", "MAX_QUANT_GROUP", "QuantDivision", "quant_launch_config", "quant_sass_counts",
    "scaled_fp4_quant_calls_triton", "scaled_fp4_quant_group_triton", "scaled_fp4_quant_of_maxima_triton",
    "scaled_fp4_quant_triton",
]


class QuantDivision(enum.IntEnum):
    """How the kernel evaluates ``e2m1_rne((x * gs) / s)``; all are bit-equal to the reference."""

    IEEE_DIV = 0
    FMA_SAT = 1


class _InputKind(enum.IntEnum):
    BF16 = 0
    FP16 = 1
    FP32 = 2


_KIND_BF16 = tl.constexpr(int(_InputKind.BF16))
_KIND_FP32 = tl.constexpr(int(_InputKind.FP32))
_DIV_FMA_SAT = tl.constexpr(int(QuantDivision.FMA_SAT))

_INPUT_KIND = {torch.bfloat16: _InputKind.BF16, torch.float16: _InputKind.FP16, torch.float32: _InputKind.FP32}
# x is read as int32 words (two 16-bit elements each, element 2j in the low half) or as fp32.

DEFAULT_DIVISION = QuantDivision.FMA_SAT

_SIGN_NIBBLES = tl.constexpr(-2004318072)  # 0x88888888: bit 3 of every nibble
_F32_2P23 = tl.constexpr(0x4B000000)       # bits of 2**23 (ulp 1)


# ------------------------------------------------------------------ hardware ops and emulations

@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _sat(v):
    """PTX ``.sat``: clamp to [0, 1], NaN to +0."""
    return tl.where(v > 0.0, tl.minimum(v, 1.0), 0.0)


@triton.jit
def _fma(a, b, c, ON_CUDA: tl.constexpr):
    """fp32 fused multiply-add. Off CUDA it is evaluated in float64 and rounded to fp32 (Triton 3.6's
    interpreter rounds the product first); every use below has an fp64-exact product and sum,
    except ``h`` in step 1, where a rare 1-ulp double rounding cannot cross a decision point."""
    if ON_CUDA:
        return tl.fma(a, b, c)
    else:
        return (tl.cast(a, tl.float64) * tl.cast(b, tl.float64) + tl.cast(c, tl.float64)).to(tl.float32)


@triton.jit
def _mul_sat(a, b, ON_CUDA: tl.constexpr):
    if ON_CUDA:
        return tl.inline_asm_elementwise("mul.rn.sat.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return _sat(a * b)


@triton.jit
def _fma_sat(a, b, c, ON_CUDA: tl.constexpr):
    if ON_CUDA:
        return tl.inline_asm_elementwise("fma.rn.sat.f32 $0, $1, $2, $3;", "=f,f,f,f", [a, b, c],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return _sat(_fma(a, b, c, ON_CUDA))


@triton.jit
def _rcp_approx(v, ON_CUDA: tl.constexpr):
    """``1 / v`` within 1 ulp (``FMA_SAT`` needs no more), for normal positive v."""
    if ON_CUDA:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [v],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / v


@triton.jit
def _prmt(a, b, SEL: tl.constexpr, ON_CUDA: tl.constexpr):
    """PTX ``prmt.b32`` (default mode): output byte k is byte ``SEL[k] & 7`` of ``{b, a}``, all bits
    set to that byte's sign bit when ``SEL[k] & 8``."""
    if ON_CUDA:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, SEL],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = a * 0
        for k in tl.static_range(4):
            nib = (SEL >> (4 * k)) & 15
            # selector bit 2 picks the word (bytes 0-3: a, 4-7: b); written without a chained
            # comparison, which Triton 3.6's frontend rejects
            byte = ((a if (nib & 4) == 0 else b) >> ((nib & 3) * 8)) & 255
            if nib >= 8:
                byte = (byte >> 7) * 255
            out = out | (byte << (8 * k))
        return out


@triton.jit
def _lo_half_as_f32(w, ON_CUDA: tl.constexpr):
    """``w << 16`` reinterpreted as fp32 (the bf16 in the low half of w). The inline shift keeps
    LLVM from folding a later ``fabs`` into an integer mask (FMUL takes ``|x|`` for free)."""
    if ON_CUDA:
        return tl.inline_asm_elementwise("shl.b32 $0, $1, 16;", "=f,r", [w], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return (w << 16).to(tl.float32, bitcast=True)


@triton.jit
def _max_abs_x2(a, b, IN_KIND: tl.constexpr):
    """Per-half ``max(|a|, |b|)`` of two packed bf16x2/f16x2 words, NaN-propagating (sign bits are
    garbage). CUDA only."""
    if IN_KIND == _KIND_BF16:
        return tl.inline_asm_elementwise("max.NaN.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("max.NaN.xorsign.abs.f16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _columns(t):
    """The four columns of a ``[B, 4]`` tensor held by one thread, as ``[B]`` tensors."""
    even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


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


# ------------------------------------------------------------------------------ per block

@triton.jit
def _block_scale(amax, gs, ON_CUDA: tl.constexpr):
    """(e4m3 bits as uint8, decoded scale in fp32) of ``e4m3(min(div_rn(amax, 6) * gs, 448))``."""
    s = tl.math.div_rn(amax, 6.0) * gs
    s = tl.where((gs > 0.0) & (gs < float("inf")), s, float("nan"))  # bad gs poisons: +NaN scales
    s = tl.where(s > 448.0, 448.0, s)                             # saturate; NaN stays NaN
    if ON_CUDA:
        s8 = s.to(tl.float8e4nv)                                  # cvt.rn.satfinite: RNE, NaN kept
        return s8.to(tl.uint8, bitcast=True), s8.to(tl.float32)
    else:
        bits, sd = _e4m3_rne(s)
        return bits.to(tl.uint8), sd


# ------------------------------------------------------------------------------ per element

@triton.jit
def _e2m1_magnitude(y, s):
    """e2m1 magnitude code (0..7, int32) of ``RN(y / s)`` for y >= 0 (inf allowed), s > 0 finite.

    Decision points as in format.py: inclusive at 0.75, 1.75, 3.5 (ties go to the even code
    above), strict at 0.25, 1.25, 2.5, 5 (ties go to the even code below). The seven points are
    searched as a binary tree (one compare per code bit): the inclusive ones are exactly the
    upper two levels and the strict ones the leaves, so each level keeps its tie rule."""
    v = tl.math.div_rn(y, s)
    bit2 = v >= 1.75
    bit1 = v >= tl.where(bit2, 3.5, 0.75)
    bit0 = v > tl.where(bit2, tl.where(bit1, 5.0, 2.5), tl.where(bit1, 1.25, 0.25))
    return (bit2.to(tl.int32) << 2) | (bit1.to(tl.int32) << 1) | bit0.to(tl.int32)


@triton.jit
def _nibbles_tree(x, gsa, s_abs, sign_blk):
    """IEEE_DIV: full 4-bit codes (sign included) of the elements x, int32."""
    y = tl.abs(x) * gsa
    mag = _e2m1_magnitude(y, s_abs)
    sign = (_signbit(x) ^ sign_blk) & (y == y).to(tl.int32)  # noqa: PLR0124  (NaN quotient: +0)
    return mag | (sign << 3)


@triton.jit
def _magic_codes(x, gsa, r8, s8n, magic, ON_CUDA: tl.constexpr):
    """FMA_SAT steps 1-2: ``bits(P)``, whose low byte is ``code | 8 * sign_blk`` (module docstring)."""
    y = tl.abs(x) * gsa
    q0 = _mul_sat(y, r8, ON_CUDA)
    rho = _fma(q0, s8n, y, ON_CUDA)
    h = _fma(rho, r8, q0, ON_CUDA)
    a = _mul_sat(h, 4.0, ON_CUDA)
    b = _fma_sat(h, 4.0, -1.0, ON_CUDA)
    c = _fma_sat(h, 4.0, -2.0, ON_CUDA)
    p = _fma(a, 4.0, magic, ON_CUDA)
    p = _fma(b, 2.0, p, ON_CUDA)
    p = p + c
    return p.to(tl.int32, bitcast=True)


@triton.jit
def _pack_word(first, second, PAIRED: tl.constexpr):
    """Sum of ``[B, 4]`` nibble carriers into one code word per row: PAIRED (16-bit inputs) puts
    column i of ``first`` / ``second`` at nibbles 2i / 2i+1, otherwise at nibbles i / 4+i."""
    col = tl.arange(0, 4)
    if PAIRED:
        w_first = 1 << (8 * col)
        w_second = 16 << (8 * col)
    else:
        w_first = 1 << (4 * col)
        w_second = 65536 << (4 * col)
    return tl.sum(first * w_first[None, :] + second * w_second[None, :], axis=1)


@triton.jit
def _gather_low_bytes(c0, c1, c2, c3, ON_CUDA: tl.constexpr):
    """Word whose byte i is the low byte of ``ci``."""
    return _prmt(_prmt(c0, c1, 0x0040, ON_CUDA), _prmt(c2, c3, 0x0040, ON_CUDA), 0x5410, ON_CUDA)


@triton.jit
def _gather_sign_bytes(b0, b1, b2, b3, ON_CUDA: tl.constexpr):
    """Word whose byte i is 0xFF if the int32 ``bi`` (an fp32 bit pattern) is negative, else 0."""
    return _prmt(_prmt(b0, b1, 0xFBFB, ON_CUDA), _prmt(b2, b3, 0xFBFB, ON_CUDA), 0x5410, ON_CUDA)


@triton.jit
def _fma_sat_constants(sd, gs, ON_CUDA: tl.constexpr):
    """Per-block constants of ``FMA_SAT`` from the decoded block scale ``sd`` and gs:
    ``(|gs|, r8 ~ 1/(8|s|), -8|s|, magic, keep)``. A dead block (scale 0 or NaN) gets ``r8 = 0``, which
    makes every code 0, and no signs. ``keep``: the sign-bit mask of live blocks, 0 when
    ``|gs| = inf`` (then only nonzero codes keep their sign, see :func:`_signed_word`)."""
    gsa = tl.abs(gs)
    dead = (sd == 0.0) | (sd != sd)  # noqa: PLR0124  (zero or NaN scale: all codes 0)
    sign_blk = tl.where(dead, 0, _signbit(gs) ^ _signbit(sd))
    s_abs = tl.where(dead, 1.0, tl.abs(sd))
    r8 = tl.where(dead, 0.0, _rcp_approx(8.0 * s_abs, ON_CUDA))
    magic = (sign_blk * 8 + _F32_2P23).to(tl.float32, bitcast=True)
    keep = tl.where(dead, 0, tl.where(gsa == float("inf"), 0, _SIGN_NIBBLES))
    return gsa, r8, -8.0 * s_abs, magic, keep


@triton.jit
def _signed_word(w, even_signs, odd_signs, keep):
    """XOR the element signs into code word ``w`` (nibble 2i / 2i+1 from byte i of ``even_signs`` /
    ``odd_signs``, sign-filled bytes) where ``keep`` has the sign bit or the code is nonzero-odd
    (code 7, the only nonzero code with ``|gs| = inf``; ``0 * inf`` is NaN: code +0)."""
    z = (even_signs & 0x0F0F0F0F) | (odd_signs & -252645136)
    return w ^ (z & (((w << 3) | keep) & _SIGN_NIBBLES))


@triton.jit
def _pack_magic_codes(first, second, PAIRED: tl.constexpr, ON_CUDA: tl.constexpr):
    """Code word of each row from ``bits(P)`` of ``[B, 4]`` elements (low byte: code | 8 sign_blk),
    element order as in :func:`_pack_word`: byte i = code(2i) | code(2i+1) << 4, gathered with
    ``prmt`` (the ``bits(2**23)`` high bytes never enter)."""
    if PAIRED:
        c0, c1, c2, c3 = _columns(first + (second << 4))
    else:
        f0, f1, f2, f3 = _columns(first)
        g0, g1, g2, g3 = _columns(second)
        c0 = f0 + (f1 << 4)
        c1 = f2 + (f3 << 4)
        c2 = g0 + (g1 << 4)
        c3 = g2 + (g3 << 4)
    return _gather_low_bytes(c0, c1, c2, c3, ON_CUDA)


@triton.jit
def _sign_bytes_pairs(w, ON_CUDA: tl.constexpr):
    """(even, odd) sign-filled bytes of the packed 16-bit words ``w`` ``[B, 4]``: byte i of ``even`` /
    ``odd`` is the sign of the low / high element of column i."""
    c0, c1, c2, c3 = _columns(w)
    a = _prmt(c0, c1, 0xFBD9, ON_CUDA)   # lo(c0), lo(c1), hi(c0), hi(c1)
    b = _prmt(c2, c3, 0xFBD9, ON_CUDA)
    return _prmt(a, b, 0x5410, ON_CUDA), _prmt(a, b, 0x7632, ON_CUDA)


@triton.jit
def _sign_bytes_singles(first, second, ON_CUDA: tl.constexpr):
    """As :func:`_sign_bytes_pairs` for fp32 elements: ``first`` -> nibbles 0..3, ``second`` ->
    nibbles 4..7."""
    f0, f1, f2, f3 = _columns(first.to(tl.int32, bitcast=True))
    g0, g1, g2, g3 = _columns(second.to(tl.int32, bitcast=True))
    return _gather_sign_bytes(f0, f2, g0, g2, ON_CUDA), _gather_sign_bytes(f1, f3, g1, g3, ON_CUDA)


@triton.jit
def _code_words(first_a, second_a, first_b, second_b, words_a, words_b, sd, gs,
                DIVISION: tl.constexpr, PAIRED: tl.constexpr, ON_CUDA: tl.constexpr):
    """The two 32-bit code words of each block (elements 0..7 from ``*_a``, 8..15 from ``*_b``).
    ``words_*``: the packed 16-bit input words (PAIRED) for the sign bits, else unused."""
    if DIVISION == _DIV_FMA_SAT:
        gsa, r8, s8n, magic, keep = _fma_sat_constants(sd, gs, ON_CUDA)
        r8 = r8[:, None]
        s8n = s8n[:, None]
        magic = magic[:, None]
        w0 = _pack_magic_codes(_magic_codes(first_a, gsa, r8, s8n, magic, ON_CUDA),
                               _magic_codes(second_a, gsa, r8, s8n, magic, ON_CUDA), PAIRED, ON_CUDA)
        w1 = _pack_magic_codes(_magic_codes(first_b, gsa, r8, s8n, magic, ON_CUDA),
                               _magic_codes(second_b, gsa, r8, s8n, magic, ON_CUDA), PAIRED, ON_CUDA)
        if PAIRED:
            even0, odd0 = _sign_bytes_pairs(words_a, ON_CUDA)
            even1, odd1 = _sign_bytes_pairs(words_b, ON_CUDA)
        else:
            even0, odd0 = _sign_bytes_singles(first_a, second_a, ON_CUDA)
            even1, odd1 = _sign_bytes_singles(first_b, second_b, ON_CUDA)
        w0 = _signed_word(w0, even0, odd0, keep)
        w1 = _signed_word(w1, even1, odd1, keep)
    else:
        gsa = tl.abs(gs)
        dead = (sd == 0.0) | (sd != sd)  # noqa: PLR0124  (zero or NaN scale: all codes 0)
        sign_blk = tl.where(dead, 0, _signbit(gs) ^ _signbit(sd))[:, None]
        s_abs = tl.where(dead, 1.0, tl.abs(sd))[:, None]
        w0 = _pack_word(_nibbles_tree(first_a, gsa, s_abs, sign_blk),
                        _nibbles_tree(second_a, gsa, s_abs, sign_blk), PAIRED)
        w1 = _pack_word(_nibbles_tree(first_b, gsa, s_abs, sign_blk),
                        _nibbles_tree(second_b, gsa, s_abs, sign_blk), PAIRED)
        w0 = tl.where(dead, 0, w0)
        w1 = tl.where(dead, 0, w1)
    return w0, w1


# ------------------------------------------------------------------------------ chunks

@triton.jit
def _unpack_words(w, IN_KIND: tl.constexpr, ON_CUDA: tl.constexpr):
    """Packed 16-bit element pairs -> (low, high) elements as fp32 (exact)."""
    if IN_KIND == _KIND_BF16:
        lo = _lo_half_as_f32(w, ON_CUDA)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    elif ON_CUDA:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=f,=f,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _words_amax(w, IN_KIND: tl.constexpr):
    """Row amax (fp32, NaN if any element is NaN) of packed bf16x2/f16x2 words ``w`` ``[B, 4]`` (CUDA)."""
    c0, c1, c2, c3 = _columns(w)
    m = _max_abs_x2(_max_abs_x2(c0, c1, IN_KIND), _max_abs_x2(c2, c3, IN_KIND), IN_KIND)
    if IN_KIND == _KIND_BF16:
        lo = (m << 16).to(tl.float32, bitcast=True)
        hi = (m & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (m & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (m >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return _max_nan(tl.abs(lo), tl.abs(hi))


@triton.jit
def _row_amax(a, b, c, d):
    m = _max_nan(_max_nan(tl.abs(a), tl.abs(b)), _max_nan(tl.abs(c), tl.abs(d)))
    return tl.reduce(m, 1, _max_nan)


@triton.jit
def _load_vector(x_ptr, blk_c, K: tl.constexpr, WORDS: tl.constexpr):
    """Words ``4K .. 4K+3`` of blocks ``blk_c`` (in range), ``[BLOCKS, 4]``: one 16-byte vector a row."""
    off = blk_c.to(tl.int64)[:, None] * WORDS + (4 * K + tl.arange(0, 4))[None, :]
    return tl.load(x_ptr + off)


@triton.jit
def _store_chunk(w0, w1, s_bits, blk, in_range, q_ptr, s_ptr):
    tl.store(s_ptr + blk, s_bits, mask=in_range)
    off = blk.to(tl.int64)[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(q_ptr + off, tl.join(w0, w1), mask=in_range[:, None])


@triton.jit
def _quant_kernel(
    x_ptr, gs_ptr, q_ptr, s_ptr, n_blocks, n_chunks,
    IN_KIND: tl.constexpr, DIVISION: tl.constexpr, BLOCKS: tl.constexpr, ON_CUDA: tl.constexpr,
):
    """Program p quantizes chunks p, p + P, ... of BLOCKS blocks (P programs; with P = n_chunks,
    one chunk each): ``_quant_chunks``."""
    _quant_chunks(x_ptr, tl.load(gs_ptr), q_ptr, s_ptr, n_blocks, n_chunks, IN_KIND, DIVISION, BLOCKS, ON_CUDA)


@triton.jit
def _global_scale_of_maxima(m_ptr, n_maxima, DIV_RN: tl.constexpr, BLOCK: tl.constexpr):
    """The dynamic global scale of a tensor whose ``n_maxima`` partial maxima of ``|x|`` are at
    ``m_ptr`` (any values: their maximum is exact whatever they are). The operations, in order, of
    the graph that ``fp4fuse.nvfp4.quantizer.group_amax`` (without a group) and
    ``nvfp4.format.global_scale_from_amax`` give and Inductor generates for it: ``a = fp32(max)`` (NaN if one is), ``v = inf if a is NaN else
    a``, ``gs = where(isfinite(v), where(v == 0, 1, (1 / v) * 2688), NaN)`` -- ``2688 / v`` is
    ``reciprocal(v) * 2688`` in the graph, the division IEEE (``DIV_RN``) or Triton's ``/``, as
    Inductor's (``fp4fuse.kernels.triton.alpha``)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, n_maxima, BLOCK):
        v = tl.load(m_ptr + start + offs, mask=start + offs < n_maxima, other=float("-inf")).to(tl.float32)
        acc = _max_nan(acc, v)
    a = tl.reduce(acc, 0, _max_nan)
    v = tl.where(a != a, float("inf"), a)
    finite = (v == v) & (tl.abs(v) != float("inf"))
    if DIV_RN:
        recip = tl.div_rn(1.0, v)
    else:
        recip = 1.0 / v
    return tl.where(finite, tl.where(v == 0.0, 1.0, recip * 2688.0), float("nan"))


@triton.jit
def _quant_of_maxima_kernel(
    x_ptr, m_ptr, n_maxima, gs_ptr, q_ptr, s_ptr, n_blocks, n_chunks,
    IN_KIND: tl.constexpr, DIVISION: tl.constexpr, BLOCKS: tl.constexpr, ON_CUDA: tl.constexpr,
    DIV_RN: tl.constexpr, MAXIMA_BLOCK: tl.constexpr,
):
    """``_quant_kernel`` with the global scale computed by every program from the partial maxima of
    ``|x|`` (``_global_scale_of_maxima``) instead of read; program 0 also writes it to ``gs_ptr``."""
    gs = _global_scale_of_maxima(m_ptr, n_maxima, DIV_RN, MAXIMA_BLOCK)
    if tl.program_id(0) == 0:
        tl.store(gs_ptr, gs)
    _quant_chunks(x_ptr, gs, q_ptr, s_ptr, n_blocks, n_chunks, IN_KIND, DIVISION, BLOCKS, ON_CUDA)


@triton.jit
def _quant_group_kernel(
    x_ptr, n_blocks, n_chunks, gs0_ptr, q0_ptr, s0_ptr, gs1_ptr, q1_ptr, s1_ptr, gs2_ptr, q2_ptr, s2_ptr,
    SEGMENTS: tl.constexpr, IN_KIND: tl.constexpr, DIVISION: tl.constexpr, BLOCKS: tl.constexpr,
    ON_CUDA: tl.constexpr,
):
    """``SEGMENTS`` (2 or 3) quantizations of one ``x`` with their own global scales and outputs in
    one launch: programs ``(p, j)`` run ``_quant_kernel``'s program p for segment j (the same code,
    so the same bits as a launch of its own)."""
    segment = tl.program_id(1)
    gs_ptr, q_ptr, s_ptr = gs0_ptr, q0_ptr, s0_ptr
    if segment == 1:
        gs_ptr, q_ptr, s_ptr = gs1_ptr, q1_ptr, s1_ptr
    if SEGMENTS == 3:
        if segment == 2:
            gs_ptr, q_ptr, s_ptr = gs2_ptr, q2_ptr, s2_ptr
    _quant_chunks(x_ptr, tl.load(gs_ptr), q_ptr, s_ptr, n_blocks, n_chunks, IN_KIND, DIVISION, BLOCKS, ON_CUDA)


@triton.jit
def _quant_chunks(
    x_ptr, gs, q_ptr, s_ptr, n_blocks, n_chunks,
    IN_KIND: tl.constexpr, DIVISION: tl.constexpr, BLOCKS: tl.constexpr, ON_CUDA: tl.constexpr,
):
    """Program ``program_id(0)`` of ``num_programs(0)`` quantizes its chunks of BLOCKS blocks with the
    global scale ``gs`` (fp32).
    Out-of-range rows of the last chunk re-read the last block (no masked loads) and store
    nothing. The pointers come in the tensors' own dtypes (a compiled graph's wrapper then runs no
    view op per call) and are read as: x int32 words (16-bit inputs, 4-byte aligned) or fp32, q
    int32 code words, s uint8 scales. ON_CUDA: hardware instructions (inline PTX, cvt); False under
    Triton's interpreter, which runs exact emulations of them."""
    if IN_KIND != _KIND_FP32:
        x_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    q_ptr = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    s_ptr = s_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, BLOCKS)
    for chunk in range(pid, n_chunks, nprog):
        blk = chunk * BLOCKS + rows
        in_range = blk < n_blocks
        blk_c = tl.minimum(blk, n_blocks - 1)
        if IN_KIND == _KIND_FP32:
            v0 = _load_vector(x_ptr, blk_c, 0, 16)
            v1 = _load_vector(x_ptr, blk_c, 1, 16)
            v2 = _load_vector(x_ptr, blk_c, 2, 16)
            v3 = _load_vector(x_ptr, blk_c, 3, 16)
            s_bits, sd = _block_scale(_row_amax(v0, v1, v2, v3), gs, ON_CUDA)
            w0, w1 = _code_words(v0, v1, v2, v3, v0, v2, sd, gs, DIVISION, False, ON_CUDA)
        else:
            wa = _load_vector(x_ptr, blk_c, 0, 8)
            wb = _load_vector(x_ptr, blk_c, 1, 8)
            lo_a, hi_a = _unpack_words(wa, IN_KIND, ON_CUDA)
            lo_b, hi_b = _unpack_words(wb, IN_KIND, ON_CUDA)
            if ON_CUDA:
                amax = _words_amax(_max_abs_x2(wa, wb, IN_KIND), IN_KIND)
            else:
                amax = _row_amax(lo_a, hi_a, lo_b, hi_b)
            s_bits, sd = _block_scale(amax, gs, ON_CUDA)
            w0, w1 = _code_words(lo_a, hi_a, lo_b, hi_b, wa, wb, sd, gs, DIVISION, True, ON_CUDA)
        _store_chunk(w0, w1, s_bits, blk, in_range, q_ptr, s_ptr)


# ------------------------------------------------------------------------------ host side

#: Most 16-element blocks one thread may own on CUDA. On an H100 with Triton 3.6 the FMA_SAT kernel
#: wrote wrong codes (about half of them; scales right) with 4 per thread at 4 and 8 warps and with
#: 8 per thread at 8 warps, for bf16, fp16 and fp32 alike (8 per thread at 4 warps and IEEE_DIV were
#: right). Its pieces -- the [B, 4] column split, the byte permutes, the join -- each compute right
#: alone at those shapes, so the fault is in how Triton compiles them together; it was not isolated
#: further. Configurations are held to the tested 1 and 2 per thread.
MAX_BLOCKS_PER_THREAD = 2


#: CUDA launch of the quantization: blocks of 16 per program (one per thread at 8 warps) and the
#: most programs per multiprocessor; a larger input loops over its chunks (``_quant_chunks``).
QUANT_BLOCKS = 256
QUANT_WARPS = 8
QUANT_PROGRAMS_PER_SM = 16


def quant_launch_config(n_blocks: int | torch.SymInt, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCKS, num_warps, programs)`` for ``n_blocks`` 16-element blocks.

    CUDA: ``QUANT_BLOCKS`` blocks a program (one per thread), one chunk per program up to
    ``QUANT_PROGRAMS_PER_SM`` programs per multiprocessor; a larger input gives each program several
    chunks, whose loads Triton pipelines across the loop. Chosen by ``benchmarks/bench_ops.py
    --quant-sweep`` and the per-size check of benchmarks/results/2026-11-26-quant-launch-all-reduce-host-h200.md: from
    an 8192 x 8192 input on, 8-11% faster than one 4-warp program per 128-block chunk on an H200
    and 2-3% slower on an H100; the same within 0.1 us at decode sizes. Which program
    quantizes a block does not change its bits. A symbolic block count (a traced launch with a
    dynamic batch) gives a symbolic grid, ``sym_min`` adds no guard. Triton's interpreter: large
    chunks (its cost is per operation, not per element)."""
    if device.type != "cuda":
        return 1024, 4, triton.cdiv(n_blocks, 1024)
    chunks = triton.cdiv(n_blocks, QUANT_BLOCKS)
    return QUANT_BLOCKS, QUANT_WARPS, torch.sym_min(chunks, QUANT_PROGRAMS_PER_SM * num_sms(device))


def _scale_operand(global_scale: torch.Tensor) -> torch.Tensor:
    """The global scale as the kernels read it: one fp32 element."""
    return global_scale.reshape(1).to(torch.float32)


def _launch_args(x: torch.Tensor, global_scale: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                 division: QuantDivision, config: tuple[int, int, int] | None):
    m, k = x.shape
    n_blocks = m * (k // BLOCK_SIZE)
    if n_blocks > 2**31 - 2**20:
        raise ValueError(f"fp4fuse.scaled_fp4_quant: {m}x{k} has {n_blocks} blocks of 16; the Triton kernel indexes blocks with int32")
    x = x.contiguous()
    if (x.storage_offset() * x.element_size()) % 4:  # read as 4-byte words
        x = x.clone()
    blocks, num_warps, programs = config or quant_launch_config(n_blocks, x.device)
    if x.device.type == "cuda" and blocks > MAX_BLOCKS_PER_THREAD * 32 * num_warps:
        raise ValueError(f"fp4fuse.scaled_fp4_quant: config {(blocks, num_warps, programs)} gives each thread "
                         f"{blocks // (32 * num_warps)} blocks; at most {MAX_BLOCKS_PER_THREAD} are allowed on CUDA "
                         f"(BLOCKS <= {MAX_BLOCKS_PER_THREAD} * 32 * num_warps)")
    args = (x, _scale_operand(global_scale), q, s, n_blocks, triton.cdiv(n_blocks, blocks))
    meta = dict(IN_KIND=int(_INPUT_KIND[x.dtype]), DIVISION=int(division), BLOCKS=blocks,
                ON_CUDA=x.device.type == "cuda", num_warps=num_warps)
    return (programs,), args, meta


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
    if m * k == 0:
        return q, s
    grid, args, meta = _launch_args(x, global_scale, q, s, division, config)
    traceable(_quant_kernel)[grid](*args, **meta)
    return q, s


#: Most partial maxima ``scaled_fp4_quant_of_maxima_triton`` takes: every program reduces all of
#: them (a graph's row maxima of a decode-sized activation).
MAX_MAXIMA = 256


def scaled_fp4_quant_of_maxima_triton(
    x: torch.Tensor, maxima: torch.Tensor, div_rn: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, s, gs)``: ``scaled_fp4_quant_triton(x, gs)`` with ``gs`` the dynamic global scale of ``x``
    computed in the same launch from ``maxima``, partial maxima of ``|x|`` (any shape, at most
    ``MAX_MAXIMA`` elements; a graph's row maxima), with the operations and the
    division (``div_rn``) of the graph it replaces (``_global_scale_of_maxima``); gs fp32 ``[1]``.
    One launch instead of Inductor's kernel for the scale and the quantization's (fp4fuse's kernel
    lowering, ``fp4fuse.passes.lowering``)."""
    if maxima.numel() > MAX_MAXIMA or maxima.numel() == 0:
        raise ValueError(f"scaled_fp4_quant_of_maxima_triton: maxima has {maxima.numel()} elements; "
                         f"1 to {MAX_MAXIMA} are supported")
    m, k = x.shape
    if m * k == 0:
        raise ValueError(f"scaled_fp4_quant_of_maxima_triton: x is {m}x{k}; it must not be empty")
    q = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty((m, k // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=x.device)
    gs = torch.empty(1, dtype=torch.float32, device=x.device)
    grid, (x_c, _, _, _, n_blocks, n_chunks), meta = _launch_args(x, gs, q, s, DEFAULT_DIVISION, None)
    traceable(_quant_of_maxima_kernel)[grid](
        x_c, maxima.reshape(-1), maxima.numel(), gs, q, s, n_blocks, n_chunks,
        DIV_RN=div_rn, MAXIMA_BLOCK=MAX_MAXIMA, **meta)
    return q, s, gs


#: Quantizations one ``_quant_group_kernel`` launch computes at most.
MAX_QUANT_GROUP = 3


def scaled_fp4_quant_group_triton(
    x: torch.Tensor, global_scales: list[torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[scaled_fp4_quant_triton(x, gs) for gs in global_scales]``, bit for bit, in fewer
    launches: up to ``MAX_QUANT_GROUP`` global scales share one launch of ``_quant_group_kernel``
    (x is read from memory once per scale, mostly from L2). A checkpoint with static activation
    scales gives each of a layer's q/k/v (gate/up) projections its own scale of one activation."""
    m, k = x.shape
    outs = [(torch.empty((m, k // 2), dtype=torch.uint8, device=x.device),
             torch.empty((m, k // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=x.device)) for _ in global_scales]
    if m * k == 0 or not global_scales:
        return outs
    for start in range(0, len(global_scales), MAX_QUANT_GROUP):
        chunk = slice(start, start + MAX_QUANT_GROUP)
        scales, group = global_scales[chunk], outs[chunk]
        if len(scales) == 1:
            grid, args, meta = _launch_args(x, scales[0], *group[0], DEFAULT_DIVISION, None)
            traceable(_quant_kernel)[grid](*args, **meta)
            continue
        (programs,), (x_c, _, _, _, n_blocks, n_chunks), meta = _launch_args(
            x, scales[0], *group[0], DEFAULT_DIVISION, None)
        segments = [(_scale_operand(gs), q, s) for gs, (q, s) in zip(scales, group)]
        segments += [segments[-1]] * (MAX_QUANT_GROUP - len(segments))  # unused slots (SEGMENTS prunes them)
        traceable(_quant_group_kernel)[(programs, len(scales))](
            x_c, n_blocks, n_chunks, *(arg for segment in segments for arg in segment),
            SEGMENTS=len(scales), **meta)
    return outs


def scaled_fp4_quant_calls_triton(calls: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[scaled_fp4_quant_triton(x, gs) for x, gs in calls]``, bit for bit: calls on one ``x`` (the
    same tensor) share launches (``scaled_fp4_quant_group_triton``); otherwise one each."""
    x = calls[0][0]
    if all(call[0] is x for call in calls):
        return scaled_fp4_quant_group_triton(x, [gs for _, gs in calls])
    return [scaled_fp4_quant_triton(*call) for call in calls]


_SASS_LABEL = re.compile(r"^(\.?L\w*|LBB\d+):")
_SASS_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?`?\(?(\.?L\w*|LBB\d+)")


def sass_counts(sass: str) -> dict[str, int]:
    """Instruction counts of a SASS listing (``CompiledKernel.asm["sass"]``): ``total`` (every
    instruction, out-of-line slow paths included) and ``loop`` (the body of the largest loop: from
    the target of the last backward branch to that branch)."""
    labels: dict[str, int] = {}
    ins: list[str] = []
    for line in sass.splitlines():
        text = line.split("\t", 1)[-1].strip()
        m = _SASS_LABEL.match(text)
        if m:
            labels[m.group(1)] = len(ins)
        elif text.endswith(";") and not text.startswith("."):
            ins.append(text)
    loop = 0
    for i, text in enumerate(ins):
        m = _SASS_BRANCH.search(text)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            loop = max(loop, i + 1 - labels[m.group(1)])
    return {"total": len(ins), "loop": loop}


def quant_sass_counts(
    division: QuantDivision, dtype: torch.dtype = torch.bfloat16,
    config: tuple[int, int, int] | None = None, device: str | torch.device = "cuda",
) -> dict[str, float]:
    """Compile (without running) the quantization kernel for ``division`` / ``dtype`` as a real
    launch would on ``device`` and count its SASS instructions: ``total`` and ``loop`` (see
    :func:`sass_counts`) and ``loop_per_element`` = loop / elements a thread handles per iteration."""
    device = torch.device(device)
    x = torch.zeros((8, 4096), dtype=dtype, device=device)
    q = torch.empty((8, 2048), dtype=torch.uint8, device=device)
    s = torch.empty((8, 256), dtype=torch.float8_e4m3fn, device=device)
    gs = torch.ones(1, dtype=torch.float32, device=device)
    grid, args, meta = _launch_args(x, gs, q, s, division, config)
    kernel = _quant_kernel.warmup(*args, grid=grid, **meta)
    counts = sass_counts(kernel.asm["sass"])
    elements = meta["BLOCKS"] * BLOCK_SIZE / (32 * meta["num_warps"])
    return {**counts, "loop_per_element": counts["loop"] / elements}
