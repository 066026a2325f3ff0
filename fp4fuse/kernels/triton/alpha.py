"""The GEMM epilogue's ``alpha``: a one-element fp32 tensor, or the two global scales whose
product's reciprocal it is, combined inside the kernel.

An NVFP4 linear computes ``alpha = 1 / (gs_a * gs_b)`` from the activation's and the weight's
encode-convention global scales just before its GEMM (``fp4fuse.tp.linear``). Compiled, that is a
kernel of its own per linear. ``fp4fuse.passes.lowering`` passes the GEMM the two scales instead
(:class:`GlobalScales`), so the epilogue computes the same fp32 product and reciprocal where it
loads alpha::

    mm_fp4_triton(a, b, sa, sb, alpha, out_dtype)                             # alpha: fp32 [1]
    mm_fp4_triton(a, b, sa, sb, GlobalScales(gs_a, gs_b, div_rn), out_dtype)  # 1 / (gs_a * gs_b)

``div_rn`` picks the division's rounding: IEEE round-to-nearest (``tl.div_rn``, what eager CUDA
computes) or Triton's ``/`` (PTX ``div.full.f32``, what Inductor generates for ``reciprocal``
unless ``torch._inductor.config.eager_numerics.division_rounding`` is set), so the folded alpha
is bitwise the one of the graph it replaces.

Kernels take ``alpha_ptr, alpha_b_ptr`` and the constexprs of :func:`alpha_meta` and read the
value with :func:`load_alpha`; launchers get both from :func:`alpha_operands`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["Alpha", "GlobalScales", "alpha_meta", "alpha_operands", "alpha_tensor", "empty_sum_", "load_alpha"]


class GlobalScales(NamedTuple):
    """``alpha = 1 / (a * b)`` in fp32, from two one-element fp32 tensors on the GEMM's device.
    ``div_rn``: IEEE round-to-nearest division (else Triton's ``/``, module docstring)."""

    a: torch.Tensor
    b: torch.Tensor
    div_rn: bool = True


Alpha = torch.Tensor | GlobalScales


def alpha_operands(alpha: Alpha) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel arguments ``(alpha_ptr, alpha_b_ptr)``: the two scales, or alpha twice."""
    if isinstance(alpha, GlobalScales):
        return alpha.a, alpha.b
    return alpha, alpha


def alpha_meta(alpha: Alpha) -> dict[str, bool]:
    """The constexprs :func:`load_alpha` takes, as launch keywords."""
    folded = isinstance(alpha, GlobalScales)
    return {"ALPHA_FROM_SCALES": folded, "ALPHA_DIV_RN": folded and alpha.div_rn}


def empty_sum_(out: torch.Tensor, alpha: Alpha) -> torch.Tensor:
    """``out`` (``[M, N]``) filled with a K = 0 product: ``alpha * 0`` (an empty sum times alpha,
    as ``mm_fp4``'s contract and the float64 reference give: ``-0.0`` for a negative alpha, NaN for
    a non-finite one), rounded to out's dtype."""
    return out.copy_((alpha_tensor(alpha) * 0).expand(out.shape))


def alpha_tensor(alpha: Alpha) -> torch.Tensor:
    """alpha as a one-element fp32 tensor, computed with torch ops (for paths without a kernel
    epilogue; IEEE division, so only bitwise the kernels' value where ``div_rn``)."""
    if isinstance(alpha, GlobalScales):
        return torch.reciprocal(alpha.a.reshape(1) * alpha.b.reshape(1))
    return alpha.reshape(1).to(torch.float32)


@triton.jit
def load_alpha(alpha_ptr, alpha_b_ptr, ALPHA_FROM_SCALES: tl.constexpr, ALPHA_DIV_RN: tl.constexpr):
    """``*alpha_ptr``, or ``1 / (*alpha_ptr * *alpha_b_ptr)`` in fp32 (module docstring)."""
    if ALPHA_FROM_SCALES:
        product = tl.load(alpha_ptr) * tl.load(alpha_b_ptr)
        if ALPHA_DIV_RN:
            alpha = tl.div_rn(1.0, product)
        else:
            alpha = 1.0 / product
    else:
        alpha = tl.load(alpha_ptr)
    return alpha
