"""Ordered sum of per-rank partials in Triton, for the overlapped GEMM + reduce-scatter.

Contract: ``sum_partials_in_order(partials) -> out``: ``partials`` a contiguous ``[W, ...]``
bf16/fp16/fp32 tensor; ``out = dtype(((p[0] + p[1]) + p[2]) + ...)`` with every addition in fp32
and one rounding at the end -- the same bits as the explicit torch loop in
``symm_mem_gemm.sum_in_rank_order``, in one pass (``W`` reads, one write per element) where that
loop makes ``W + 1`` passes over an fp32 accumulator.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4fuse.kernels.triton.launch import traceable

__all__ = ["sum_partials_in_order"]

#: Elements per program (8 per thread at 8 warps).
_BLOCK = 2048


@triton.jit
def _sum_in_order_kernel(p_ptr, out_ptr, n_elements, n_partials, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    ptrs = p_ptr + offs
    acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for _ in range(1, n_partials):
        # advance the pointers one partial at a time: ``i * n_elements`` was an int32 product, which
        # wrapped once W * n_elements passed 2**31 (n_elements itself fits int32)
        ptrs += n_elements
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_partials_in_order(partials: torch.Tensor) -> torch.Tensor:
    """Sum ``partials`` over dim 0 in index order in fp32, rounded once (module doc)."""
    if not partials.is_contiguous() or partials.dim() < 1 or partials.shape[0] < 1:
        raise ValueError(f"sum_partials_in_order: partials must be a contiguous [W, ...] tensor with W >= 1; "
                         f"got shape {list(partials.shape)}, contiguous={partials.is_contiguous()}")
    out = torch.empty(partials.shape[1:], dtype=partials.dtype, device=partials.device)
    n = out.numel()
    if n:
        traceable(_sum_in_order_kernel)[(triton.cdiv(n, _BLOCK),)](partials, out, n, partials.shape[0], BLOCK=_BLOCK,
                                                        num_warps=8)
    return out
