"""RMSNorm and fused residual-add + RMSNorm in Triton, one program per row.

Contracts (fp4fuse/ops/norm_ops.py holds the references):

* ``rms_norm_triton(x, weight, eps) -> out``: x ``[T, H]`` bf16/fp16/fp32, weight ``[H]``;
  ``out = x * rsqrt(mean(x^2) + eps) * weight`` computed in fp32, rounded once to x's dtype.
* ``fused_add_rms_norm_triton(x, residual, weight, eps) -> (out, residual_out)``:
  ``residual_out = x + residual`` rounded to x's dtype, ``out`` = the norm of that rounded sum.

* ``rms_norm_amax_triton`` / ``fused_add_rms_norm_amax_triton``: the same, plus ``amax``, a
  one-element fp32 tensor ``max |out|`` over the whole output (NaN if any output is NaN), for a
  dynamic NVFP4 global scale ``448 * 6 / amax`` without another pass over the output. Each row
  reduces its own output and does one integer ``atomic_max`` on the fp32 bit pattern (for
  values >= 0 the bit patterns order like the values, and NaN's lie above inf).

The row statistic uses IEEE ``div_rn`` / ``sqrt_rn`` (one evaluation per row, so exactness is
free); the per-element order is the reference's ``(x * inv_rms) * weight``. Each program reads its
row twice: once for the sum of squares (``_row_inv_rms``, shared with the fused norm + quantize
kernels so that they sum in the same order), once for the output; rows up to ``MAX_SINGLE_PASS``
elements are one chunk, whose second read comes from the cache, longer rows are walked in chunks.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from fp4fuse.kernels.triton.launch import traceable

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_SINGLE_PASS", "fused_add_rms_norm_amax_triton", "fused_add_rms_norm_triton", "norm_launch_config",
    "rms_norm_amax_triton", "rms_norm_triton",
]

MAX_SINGLE_PASS = 16384
_TWO_PASS_BLOCK = 4096


@triton.jit
def _inv_rms(sum_sq, N, eps):
    """``1 / sqrt(sum_sq / N + eps)`` with IEEE division and square root (shared with the fused
    norm + quantize kernels of norm_quant.py, which must reproduce these bits). ``eps`` is taken as
    fp32 whatever the launch passes (eager launches pass fp32, a compiled graph fp64)."""
    eps32 = tl.full((), eps, tl.float32)
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(sum_sq, N * 1.0) + eps32))


@triton.jit
def _normalize_f32(xf, inv, w):
    """``(x * inv_rms) * weight`` in fp32 (two roundings, never contracted)."""
    return (xf * inv) * w


@triton.jit
def _max_abs_nan(v):
    """``max |v|`` of a 1-D tensor as fp32, NaN if any element is NaN."""
    return tl.reduce(tl.abs(v.to(tl.float32)), 0, _max_nan)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_chunk(x_ptr, res_ptr, res_out_ptr, row, start, cols, N, HAS_RESIDUAL: tl.constexpr):
    """fp32 values of row elements ``start + cols`` (0 past N): x, or ``x + residual`` rounded to x's
    dtype, which is also stored to residual_out."""
    mask = start + cols < N
    x = tl.load(x_ptr + row + start + cols, mask=mask, other=0.0, eviction_policy="evict_last")
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row + start + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row + start + cols, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _row_inv_rms(x_ptr, res_ptr, res_out_ptr, row, N, eps,
                 HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr):
    """First pass over a row: ``inv_rms`` of x (or of x + residual, storing residual_out).

    The order of the fp32 row sum is fixed by the register layout of the loaded row, which Triton
    derives from every use of the loaded values. Here the loads feed nothing but this sum (and the
    residual_out store): the caller reads the row again for its output. So every kernel that calls
    this helper -- the norm kernel, and the fused norm + quantize kernels of norm_quant.py, whose
    quantization wants another layout -- sums in the same order and gets the same bits."""
    cols = tl.arange(0, BLOCK)
    if SINGLE_PASS:
        xf = _row_chunk(x_ptr, res_ptr, res_out_ptr, row, 0, cols, N, HAS_RESIDUAL)
        sum_sq = tl.sum(xf * xf, axis=0)
    else:
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            xf = _row_chunk(x_ptr, res_ptr, res_out_ptr, row, start, cols, N, HAS_RESIDUAL)
            sq += xf * xf
        sum_sq = tl.sum(sq, axis=0)
    # the second pass re-reads this program's own residual_out writes
    tl.debug_barrier()
    return _inv_rms(sum_sq, N, eps)


@triton.jit
def _normalized_chunk(src_ptr, w_ptr, row, start, cols, N, inv):
    """Second pass: ``(x * inv_rms) * weight`` in fp32 for row elements ``start + cols`` of ``src``
    (x, or residual_out), and the mask of those below N. A load of its own (evict-first: its
    cache hint also keeps it distinct from the first pass's load of the same addresses)."""
    mask = start + cols < N
    xf = tl.load(src_ptr + row + start + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
    return _normalize_f32(xf, inv, w), mask


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, amax_ptr, N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr, AMAX: tl.constexpr,
):
    """One program per row: ``_row_inv_rms``, then the normalized row (in ``BLOCK`` chunks unless
    SINGLE_PASS). amax_ptr: int32 view of the fp32 amax (AMAX only; it must hold 0 before the launch)."""
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    inv = _row_inv_rms(x_ptr, res_ptr, res_out_ptr, row, N, eps, HAS_RESIDUAL, BLOCK, SINGLE_PASS)
    src_ptr = res_out_ptr if HAS_RESIDUAL else x_ptr
    if SINGLE_PASS:
        out, mask = _normalized_chunk(src_ptr, w_ptr, row, 0, cols, N, inv)
        out = out.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row + cols, out, mask=mask)
        if AMAX:
            tl.atomic_max(amax_ptr, _max_abs_nan(out).to(tl.int32, bitcast=True))
    else:
        amax = 0.0
        for start in range(0, N, BLOCK):
            out, mask = _normalized_chunk(src_ptr, w_ptr, row, start, cols, N, inv)
            out = out.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row + start + cols, out, mask=mask)
            if AMAX:
                amax = _max_nan(amax, _max_abs_nan(out))
        if AMAX:
            tl.atomic_max(amax_ptr, amax.to(tl.int32, bitcast=True))


def norm_launch_config(h: int) -> tuple[int, bool, int]:
    """``(BLOCK, SINGLE_PASS, num_warps)`` for rows of ``h`` elements: one program per row, the row in
    registers up to ``MAX_SINGLE_PASS`` elements, else two passes over ``_TWO_PASS_BLOCK`` chunks.
    The row sum's order follows from this (and the input's alignment), so the fused norm +
    quantize kernels use the same configuration."""
    block = triton.next_power_of_2(h)
    single = block <= MAX_SINGLE_PASS
    if not single:
        block = _TWO_PASS_BLOCK
    return block, single, max(1, min(16, block // 512))


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    t, h = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if t == 0 or h == 0:
        return out, res_out
    block, single, num_warps = norm_launch_config(h)
    traceable(_rms_norm_kernel)[(t,)](
        x, residual if residual is not None else x, weight, out,
        res_out if res_out is not None else out, amax.view(torch.int32) if amax is not None else out, h, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, SINGLE_PASS=single, AMAX=amax is not None,
        num_warps=num_warps,
    )
    return out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of contiguous ``x [T, H]`` (validated by the op layer)."""
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, the sum rounded to x's dtype first."""
    out, res_out = _launch(x, residual, weight, eps)
    return out, res_out


def rms_norm_amax_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, amax)``: :func:`rms_norm_triton` and ``max |out|`` as a one-element fp32 tensor."""
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    out, _ = _launch(x, None, weight, eps, amax)
    return out, amax


def fused_add_rms_norm_amax_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, residual_out, amax)``: :func:`fused_add_rms_norm_triton` and ``max |out|`` (fp32, one element)."""
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    out, res_out = _launch(x, residual, weight, eps, amax)
    return out, res_out, amax
