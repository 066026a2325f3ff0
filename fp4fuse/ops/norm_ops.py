"""``fp4fuse::rms_norm`` and ``fp4fuse::fused_add_rms_norm``.

* ``rms_norm(x, weight, eps)``: ``x * rsqrt(mean(x^2, -1) + eps) * weight``, fp32 math, output in
  x's dtype (the same numbers as ``torch.nn.functional.rms_norm`` computed in fp32). x and weight
  bf16/fp16/fp32 (weight may differ from x), ``eps`` a finite float >= 0.
* ``fused_add_rms_norm(x, residual, weight, eps) -> (out, residual_out)``:
  ``residual_out = x + residual`` rounded to x's dtype, ``out = rms_norm(residual_out)``.
* ``rms_norm_fp4_quant(x, weight, eps, global_scale) -> (q, s)``
  ``= scaled_fp4_quant(rms_norm(x, weight, eps), global_scale)``, bit for bit on every backend
  (the norm output is rounded to x's dtype before it is quantized, and never written).
* ``fused_add_rms_norm_fp4_quant(x, residual, weight, eps, global_scale) -> (q, s, residual_out)``:
  ``out, residual_out = fused_add_rms_norm(x, residual, weight, eps)``, ``q, s = scaled_fp4_quant(out,
  global_scale)``.

The fused ops take the global scale as an input: they serve static (calibrated) activation scales.
Arguments follow both halves' rules: x ``[T, H]`` contiguous with H a multiple of 16, weight ``[H]``,
``eps`` finite >= 0, global_scale one fp32 element on x's device (fp4fuse.ops.validation). The
NormQuantFusionPass (fp4fuse.passes.norm_quant) writes them into compiled graphs.
"""
from __future__ import annotations

import torch

from fp4fuse.nvfp4.norms import fused_add_rms_norm_reference, rms_norm_reference
from fp4fuse.ops import validation
from fp4fuse.nvfp4.norms import fused_add_rms_norm_fp4_quant_reference, rms_norm_fp4_quant_reference
from fp4fuse.ops.backend import backend_for, call_on_device
from fp4fuse.ops.fp4_ops import empty_fp4_like
from fp4fuse.ops.kernel_table import kernel_for
from fp4fuse.ops.registration import cuda_kernel


@torch.library.custom_op("fp4fuse::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    validation.check_norm_inputs("rms_norm", x, weight, eps)
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    validation.check_norm_inputs("rms_norm", x, weight, eps)
    return torch.empty_like(x)


@cuda_kernel(rms_norm)
def _(x, weight, eps):
    validation.check_norm_inputs("rms_norm", x, weight, eps)
    return call_on_device(x.device, kernel_for("rms_norm", backend_for(x)), x, weight, eps)


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


@cuda_kernel(fused_add_rms_norm)
def _(x, residual, weight, eps):
    validation.check_norm_inputs("fused_add_rms_norm", x, weight, eps, residual)
    return call_on_device(x.device, kernel_for("fused_add_rms_norm", backend_for(x)), x, residual, weight, eps)


@torch.library.custom_op("fp4fuse::rms_norm_fp4_quant", mutates_args=())
def rms_norm_fp4_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, global_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    validation.check_norm_quant_inputs("rms_norm_fp4_quant", x, weight, eps, global_scale)
    return rms_norm_fp4_quant_reference(x, weight, eps, global_scale)


@rms_norm_fp4_quant.register_fake
def _(x, weight, eps, global_scale):
    validation.check_norm_quant_inputs("rms_norm_fp4_quant", x, weight, eps, global_scale)
    return empty_fp4_like(x)


@cuda_kernel(rms_norm_fp4_quant)
def _(x, weight, eps, global_scale):
    validation.check_norm_quant_inputs("rms_norm_fp4_quant", x, weight, eps, global_scale)
    return call_on_device(x.device, kernel_for("rms_norm_fp4_quant", backend_for(x)), x, weight, eps, global_scale)


@torch.library.custom_op("fp4fuse::fused_add_rms_norm_fp4_quant", mutates_args=())
def fused_add_rms_norm_fp4_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, global_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    validation.check_norm_quant_inputs("fused_add_rms_norm_fp4_quant", x, weight, eps, global_scale, residual)
    return fused_add_rms_norm_fp4_quant_reference(x, residual, weight, eps, global_scale)


@fused_add_rms_norm_fp4_quant.register_fake
def _(x, residual, weight, eps, global_scale):
    validation.check_norm_quant_inputs("fused_add_rms_norm_fp4_quant", x, weight, eps, global_scale, residual)
    q, s = empty_fp4_like(x)
    return q, s, torch.empty_like(x)


@cuda_kernel(fused_add_rms_norm_fp4_quant)
def _(x, residual, weight, eps, global_scale):
    validation.check_norm_quant_inputs("fused_add_rms_norm_fp4_quant", x, weight, eps, global_scale, residual)
    impl = kernel_for("fused_add_rms_norm_fp4_quant", backend_for(x))
    return call_on_device(x.device, impl, x, residual, weight, eps, global_scale)
