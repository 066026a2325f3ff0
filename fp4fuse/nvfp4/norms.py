"""RMSNorm references in pure torch: what fp4fuse's norm ops and kernels compute.

* ``rms_norm_reference(x, weight, eps)``: ``x * rsqrt(mean(x^2, -1) + eps) * weight`` in fp32,
  rounded once to x's dtype.
* ``fused_add_rms_norm_reference(x, residual, weight, eps) -> (out, residual_out)``:
  ``residual_out = x + residual`` rounded to x's dtype, ``out = rms_norm_reference(residual_out)``.
* ``*_fp4_quant_reference``: those outputs quantized to NVFP4 (what the fused norm + quantize
  kernels of fp4fuse.kernels.triton.norm_quant compute).
"""
from __future__ import annotations

import torch

from fp4fuse.nvfp4 import format as nvfp4

__all__ = [
    "fused_add_rms_norm_fp4_quant_reference", "fused_add_rms_norm_reference", "rms_norm_fp4_quant_reference",
    "rms_norm_reference",
]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    residual_out = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(residual_out, weight, eps), residual_out


def rms_norm_fp4_quant_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, global_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_reference(rms_norm_reference(x, weight, eps), global_scale)`` (pure torch)."""
    return nvfp4.quantize_reference(rms_norm_reference(x, weight, eps), global_scale)


def fused_add_rms_norm_fp4_quant_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, global_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, s, residual_out)``: the reference quantization of ``fused_add_rms_norm_reference``'s output."""
    out, residual_out = fused_add_rms_norm_reference(x, residual, weight, eps)
    q, s = nvfp4.quantize_reference(out, global_scale)
    return q, s, residual_out
