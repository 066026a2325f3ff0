"""``fp4fuse::rms_norm`` and ``fp4fuse::fused_add_rms_norm``.

* ``rms_norm(x, weight, eps)``: ``x * rsqrt(mean(x^2, -1) + eps) * weight``, fp32 math, output in
  x's dtype (the same numbers as ``torch.nn.functional.rms_norm`` computed in fp32). x and weight
  bf16/fp16/fp32 (weight may differ from x), ``eps`` a finite float >= 0.
* ``fused_add_rms_norm(x, residual, weight, eps) -> (out, residual_out)``:
  ``residual_out = x + residual`` rounded to x's dtype, ``out = rms_norm(residual_out)``.
"""
from __future__ import annotations

import torch

from fp4fuse.nvfp4.norms import fused_add_rms_norm_reference, rms_norm_reference
from fp4fuse.ops import validation
from fp4fuse.ops.backend import backend_for
from fp4fuse.ops.kernel_table import kernel_for


@torch.library.custom_op("fp4fuse::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    validation.check_norm_inputs("rms_norm", x, weight, eps)
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    validation.check_norm_inputs("rms_norm", x, weight, eps)
    return torch.empty_like(x)


@rms_norm.register_kernel("cuda")
def _(x, weight, eps):
    validation.check_norm_inputs("rms_norm", x, weight, eps)
    return kernel_for("rms_norm", backend_for(x))(x, weight, eps)


@torch.library.custom_op("fp4fuse::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    validation.check_norm_inputs("fused_add_rms_norm", x, weight, eps, residual)
    return fused_add_rms_norm_reference(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    validation.check_norm_inputs("fused_add_rms_norm", x, weight, eps, residual)
    return torch.empty_like(x), torch.empty_like(x)


@fused_add_rms_norm.register_kernel("cuda")
def _(x, residual, weight, eps):
    validation.check_norm_inputs("fused_add_rms_norm", x, weight, eps, residual)
    return kernel_for("fused_add_rms_norm", backend_for(x))(x, residual, weight, eps)
