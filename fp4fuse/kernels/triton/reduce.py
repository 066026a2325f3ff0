"""Ordered sums of partials in Triton: per-rank partials of the overlapped GEMM + reduce-scatter,
and the split-K partials of the Hopper Gluon GEMM.

Contracts:

* ``sum_partials_in_order(partials) -> out``: ``partials`` a contiguous ``[W, ...]`` bf16/fp16/fp32
  tensor; ``out = dtype(((p[0] + p[1]) + p[2]) + ...)`` with every addition in fp32 and one
  rounding at the end -- the same bits as the explicit torch loop in
  ``symm_mem_gemm.sum_in_rank_order``, in one pass (``W`` reads, one write per element) where that
  loop makes ``W + 1`` passes over an fp32 accumulator.
* ``sum_split_partials(partials, out, alpha)``: ``partials`` a contiguous fp32 ``[S, M, N]`` of a
  split-K GEMM's unscaled sums (``fp4fuse.kernels.triton.mm_hopper``), ``out`` a contiguous
  ``[M, N]``; ``out = dtype(((p[0] + ... + p[S-1]) * 2**28) * alpha)``, the additions in split
  order in fp32, then the GEMMs' epilogue (``decode.DECODE_SCALE_UNDO``, ``alpha.load_alpha``) and
  one rounding: the bits of a GEMM program that summed the same partials itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4fuse.kernels.triton.alpha import Alpha, alpha_meta, alpha_operands, load_alpha
from fp4fuse.kernels.triton.decode import DECODE_SCALE_UNDO
from fp4fuse.kernels.triton.launch import traceable

__all__ = ["sum_partials_in_order", "sum_split_partials"]

#: Elements per program (8 per thread at 8 warps).
_BLOCK = 2048


@triton.jit
def _sum_in_order_kernel(p_ptr, out_ptr, alpha_ptr, alpha_b_ptr, n_elements, n_partials, BLOCK: tl.constexpr,
                         SCALED: tl.constexpr = False, ALPHA_FROM_SCALES: tl.constexpr = False,
                         ALPHA_DIV_RN: tl.constexpr = False):
    """``out = sum(p[i] for i in order)`` over ``BLOCK`` elements a program; SCALED: times
    ``2**28`` then alpha (``load_alpha``) before the rounding."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    ptrs = p_ptr + offs
    acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for _ in range(1, n_partials):
        # advance the pointers one partial at a time: ``i * n_elements`` was an int32 product, which
        # wrapped once W * n_elements passed 2**31 (n_elements itself fits int32)
        ptrs += n_elements
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        acc = (acc * DECODE_SCALE_UNDO) * load_alpha(alpha_ptr, alpha_b_ptr, ALPHA_FROM_SCALES, ALPHA_DIV_RN)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_partials_in_order(partials: torch.Tensor) -> torch.Tensor:
    """Sum ``partials`` over dim 0 in index order in fp32, rounded once (module doc)."""
    if not partials.is_contiguous() or partials.dim() < 1 or partials.shape[0] < 1:
        raise ValueError(f"sum_partials_in_order: partials must be a contiguous [W, ...] tensor with W >= 1; "
                         f"got shape {list(partials.shape)}, contiguous={partials.is_contiguous()}")
    out = torch.empty(partials.shape[1:], dtype=partials.dtype, device=partials.device)
    n = out.numel()
    if n:
        traceable(_sum_in_order_kernel)[(triton.cdiv(n, _BLOCK),)](partials, out, partials, partials, n,
                                                                    partials.shape[0], BLOCK=_BLOCK, num_warps=8)
    return out


def sum_split_partials(partials: torch.Tensor, out: torch.Tensor, alpha: Alpha) -> torch.Tensor:
    """``out = dtype(((sum of partials[s] in split order) * 2**28) * alpha)`` (module docstring);
    returns ``out``. ``partials``: contiguous fp32 ``[S, M, N]``, S >= 1; ``out``: contiguous
    ``[M, N]``; ``alpha``: a one-element fp32 tensor or ``GlobalScales``."""
    if (partials.dtype != torch.float32 or partials.dim() != 3 or partials.shape[0] < 1
            or not partials.is_contiguous()):
        raise ValueError(f"sum_split_partials: partials must be a contiguous fp32 [S, M, N] tensor with S >= 1; got "
                         f"{partials.dtype} {list(partials.shape)}, contiguous={partials.is_contiguous()}")
    if out.shape != partials.shape[1:] or not out.is_contiguous():
        raise ValueError(f"sum_split_partials: out must be a contiguous {list(partials.shape[1:])} tensor; got "
                         f"{list(out.shape)}, contiguous={out.is_contiguous()}")
    n = out.numel()
    if n:
        alpha_a, alpha_b = alpha_operands(alpha)
        traceable(_sum_in_order_kernel)[(triton.cdiv(n, _BLOCK),)](
            partials, out, alpha_a, alpha_b, n, partials.shape[0], BLOCK=_BLOCK, SCALED=True, **alpha_meta(alpha),
            num_warps=8)
    return out
