"""RMSNorm (optionally after a residual add) fused with NVFP4 quantization, one Triton kernel.

Contracts (x ``[T, H]`` bf16/fp16/fp32 contiguous, H a multiple of 16, weight ``[H]``, global_scale a
one-element fp32 device tensor, encode convention ``448 * 6 / amax``):

* ``rms_norm_fp4_quant_triton(x, weight, eps, global_scale) -> (q, s)`` =
  ``scaled_fp4_quant(rms_norm(x, weight, eps), global_scale)``;
* ``fused_add_rms_norm_fp4_quant_triton(x, residual, weight, eps, global_scale) -> (q, s, residual_out)``
  with ``residual_out = x + residual`` rounded to x's dtype and ``(q, s)`` the quantized norm of it.

q uint8 ``[T, H/2]``, s float8_e4m3fn ``[T, H/16]`` as in fp4fuse.nvfp4.format. x (and residual) are read
from memory once (the row's second read, as in the norm kernel, comes from the cache); the norm
output is never written: each element is normalized in fp32 and rounded to x's dtype in
registers, exactly as the norm kernel rounds it before storing, then quantized.

Bit-exactness. The result equals quantizing the output of the unfused Triton norm kernel
(norm.py) with any exact quantizer (fp4fuse.nvfp4.format.quantize_reference, the Triton
quantization kernel): this kernel uses the norm kernel's launch configuration
(``norm_launch_config``: one program per row, same BLOCK and warps) and its two passes:
``_row_inv_rms``, whose loads feed only the row's sum of squares, so that the sum's reduction tree
(per-thread partial sums in register order, then the warp and cross-warp combines of ``tl.sum``)
is the same in both kernels whatever layout the quantization wants for its own read, and
``_normalized_chunk``, the per-element ``(x * inv_rms) * weight``. The quantization is
``QuantDivision.FMA_SAT`` of quant.py on the rounded values (the same helpers; every division
mode gives the same bits). Against the pure-torch composition
:func:`fp4fuse.nvfp4.norms.rms_norm_fp4_quant_reference`, the norm output itself may differ by one
unit in the last place (fp32 sums in another order, see norm.py), and Triton's interpreter
truncates fp32 -> bf16 where the GPU rounds to nearest.

fp32 x runs the norm kernel, then the quantization kernel (two launches, the same bits). A
one-kernel fp32 variant (fp32 spans cut into rows of 4, and also into the 16-bit path's rows of 8)
gave wrong codes -- half of them or more, scales right -- at every launch with 4 warps or more on
an H100 with Triton 3.6 (tests/test_triton_kernels.py::test_cuda_norm_quant_bit_equal_to_unfused),
while each of its pieces (reshape + split, byte permutes, join) computed right alone; the 16-bit
variants give the two kernels' bits at every launch configuration the test covers (all BLOCK
sizes, aligned and not). The quantization kernel has a fault of the same kind
(quant.MAX_BLOCKS_PER_THREAD).

Global scale. It is an input: the fused op is for static (calibrated) scales. A dynamic scale
``448 * 6 / amax(norm_out)`` needs the amax of the whole norm output (all-reduced over the
tensor-parallel group) before the first element can be quantized, so it stays two passes:
``fp4fuse.kernels.triton.norm.rms_norm_amax_triton`` / ``fused_add_rms_norm_amax_triton`` (the norm kernel that
also returns ``max |out|``, saving the separate amax read of the output), the all-reduce MAX and
``global_scale_from_amax``, then ``scaled_fp4_quant`` of the norm output.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from fp4fuse.kernels.triton.launch import traceable
from fp4fuse.kernels.triton.norm import (
    _normalized_chunk,
    _row_inv_rms,
    fused_add_rms_norm_triton,
    norm_launch_config,
    rms_norm_triton,
)
from fp4fuse.kernels.triton.quant import (
    _INPUT_KIND,
    _KIND_BF16,
    _block_scale,
    _fma_sat_constants,
    _magic_codes,
    _max_nan,
    _pack_magic_codes,
    _sign_bytes_pairs,
    _signed_word,
    _unpack_words,
    _words_amax,
    scaled_fp4_quant_triton,
)
from fp4fuse.nvfp4.format import BLOCK_SIZE

logger = logging.getLogger(__name__)

__all__ = [
    "fused_add_rms_norm_fp4_quant_triton",
    "rms_norm_fp4_quant_triton",
]


@triton.jit
def _round_pairs(even, odd, IN_KIND: tl.constexpr, ON_CUDA: tl.constexpr):
    """fp32 ``(even, odd)`` rounded to x's 16-bit dtype and packed: ``bits(even) | bits(odd) << 16``, int32.
    CUDA: ``cvt.rn.{bf16,f16}x2.f32``, the conversion Triton uses for the norm kernel's store;
    elsewhere the same ``.to(dtype)`` as the norm kernel."""
    if ON_CUDA:
        if IN_KIND == _KIND_BF16:
            return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [odd, even],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [odd, even],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:
        dtype = tl.bfloat16 if IN_KIND == _KIND_BF16 else tl.float16
        lo = even.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = odd.to(dtype).to(tl.int16, bitcast=True).to(tl.int32)
        return lo | (hi << 16)


@triton.jit
def _per_row(t, NB: tl.constexpr, ROWS: tl.constexpr):
    """``[NB]`` per-block values -> ``[NB * ROWS]`` (each block's value on each of its rows)."""
    return tl.reshape(tl.broadcast_to(t[:, None], (NB, ROWS)), (NB * ROWS,))


@triton.jit
def _quant_span(v, row, start, N, gs, q_ptr, s_ptr, SPAN: tl.constexpr, IN_KIND: tl.constexpr,
                ON_CUDA: tl.constexpr):
    """Round the normalized fp32 values ``v`` (``[SPAN]``: elements ``start .. start + SPAN`` of row
    ``row``) to x's dtype and quantize them; blocks at or past N are not stored.

    The span is cut into rows of 8 elements (two per block, one thread's 16-byte load), split into
    their even and odd elements (``[SPAN / 8, 4]`` each), so each row is rounded, packed and signed
    as the quantization kernel does (``_magic_codes``, ``_pack_magic_codes``, ``_signed_word``) and
    stored as one code word; the block amax combines the two rows of a block, and the rows of a
    block both compute its scale. 16-bit x only (module docstring: fp32)."""
    NB: tl.constexpr = SPAN // 16
    blk = tl.arange(0, NB)
    valid = start + blk * 16 < N
    even, odd = tl.split(tl.reshape(v, (NB * 2, 4, 2)))
    words = _round_pairs(even, odd, IN_KIND, ON_CUDA)
    lo, hi = _unpack_words(words, IN_KIND, ON_CUDA)
    even_signs, odd_signs = _sign_bytes_pairs(words, ON_CUDA)
    if ON_CUDA:
        amax_rows = _words_amax(words, IN_KIND)
    else:
        amax_rows = tl.reduce(_max_nan(tl.abs(lo), tl.abs(hi)), 1, _max_nan)
    amax = tl.reduce(tl.reshape(amax_rows, (NB, 2)), 1, _max_nan)
    s_bits, sd = _block_scale(amax, gs, ON_CUDA)
    tl.store(s_ptr + row * (N // 16) + start // 16 + blk, s_bits, mask=valid)

    gsa, r8, s8n, magic, keep = _fma_sat_constants(_per_row(sd, NB, 2), gs, ON_CUDA)
    r8 = r8[:, None]
    s8n = s8n[:, None]
    magic = magic[:, None]
    word = _pack_magic_codes(_magic_codes(lo, gsa, r8, s8n, magic, ON_CUDA),
                             _magic_codes(hi, gsa, r8, s8n, magic, ON_CUDA), True, ON_CUDA)
    word = _signed_word(word, even_signs, odd_signs, keep)
    tl.store(q_ptr + row * (N // 8) + start // 8 + tl.arange(0, NB * 2), word, mask=_per_row(valid, NB, 2))


@triton.jit
def _norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, res_out_ptr, gs_ptr, q_ptr, s_ptr, N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr, IN_KIND: tl.constexpr,
    ON_CUDA: tl.constexpr,
):
    """One program per row: norm._rms_norm_kernel with the output store replaced by the
    quantization (the same first pass ``_row_inv_rms``, the same ``_normalized_chunk``). q and s
    arrive in their own dtypes (no view op in a compiled graph's wrapper) and are written as int32
    code words and uint8 scales; IN_KIND: x's dtype (quant._InputKind)."""
    q_ptr = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    s_ptr = s_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    pid = tl.program_id(0).to(tl.int64)
    row = pid * N
    cols = tl.arange(0, BLOCK)
    gs = tl.load(gs_ptr)
    inv = _row_inv_rms(x_ptr, res_ptr, res_out_ptr, row, N, eps, HAS_RESIDUAL, BLOCK, SINGLE_PASS)
    src_ptr = res_out_ptr if HAS_RESIDUAL else x_ptr
    if SINGLE_PASS:
        v, _ = _normalized_chunk(src_ptr, w_ptr, row, 0, cols, N, inv)
        _quant_span(v, pid, 0, N, gs, q_ptr, s_ptr, BLOCK, IN_KIND, ON_CUDA)
    else:
        for start in range(0, N, BLOCK):
            v, _ = _normalized_chunk(src_ptr, w_ptr, row, start, cols, N, inv)
            _quant_span(v, pid, start, N, gs, q_ptr, s_ptr, BLOCK, IN_KIND, ON_CUDA)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    t, h = x.shape
    if h % BLOCK_SIZE:
        raise ValueError(f"fp4fuse: rms_norm + fp4 quant needs a hidden size divisible by {BLOCK_SIZE}, got {h}")
    q = torch.empty((t, h // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty((t, h // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if t == 0 or h == 0:
        return q, s, res_out
    block, single, num_warps = norm_launch_config(h)
    traceable(_norm_quant_kernel)[(t,)](
        x, residual if residual is not None else x, weight, res_out if res_out is not None else x,
        global_scale.reshape(1).to(torch.float32), q, s, h, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, SINGLE_PASS=single, IN_KIND=int(_INPUT_KIND[x.dtype]),
        ON_CUDA=x.device.type == "cuda", num_warps=num_warps,
    )
    return q, s, res_out


def rms_norm_fp4_quant_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, global_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 quantization of RMSNorm of each row of contiguous ``x [T, H]`` (validated by the caller);
    fp32 x: the norm kernel, then the quantization kernel."""
    if x.dtype == torch.float32:
        return scaled_fp4_quant_triton(rms_norm_triton(x, weight, eps), global_scale)
    q, s, _ = _launch(x, None, weight, eps, global_scale)
    return q, s


def fused_add_rms_norm_fp4_quant_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, global_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, s, x + residual)``: NVFP4 quantization of the norm of ``x + residual`` (rounded to x's dtype);
    fp32 x: the residual-add norm kernel, then the quantization kernel."""
    if x.dtype == torch.float32:
        out, res_out = fused_add_rms_norm_triton(x, residual, weight, eps)
        return (*scaled_fp4_quant_triton(out, global_scale), res_out)
    q, s, res_out = _launch(x, residual, weight, eps, global_scale)
    return q, s, res_out
