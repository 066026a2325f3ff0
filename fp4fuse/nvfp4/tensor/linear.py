"""``F.linear`` with a frozen NVFP4 weight: gradients flow to the input and bias, never the weight.

    y  = x @ W^T + b          W = weight.dequantize()  (its orig_dtype), rebuilt, not kept
    dx = dy @ W               W decoded again in backward from the saved NVFP4 payload
    db = sum(dy) over all leading dims
    dW: none (NVFP4 weights are frozen: requires_grad=True is refused on the tensor)

Only the NVFP4 weight is saved for backward (4.5 bits per element, not the decoded copy), so a
QLoRA-style model (frozen NVFP4 base + trainable adapters) keeps its memory. Under FSDP2 the saved
weight is the unsharded parameter: FSDP2 frees its storage after forward and all-gathers it again
before this module's backward, as for any parameter a backward saves.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["frozen_weight_linear"]

logger = logging.getLogger(__name__)


class _FrozenWeightLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight.dequantize(), bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        (weight,) = ctx.saved_tensors
        grad_x = grad_out @ weight.dequantize() if ctx.needs_input_grad[0] else None
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, grad_bias


def frozen_weight_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for an NVFP4 ``weight`` (see the module docstring).

    ``x`` (and ``bias``) must have the weight's logical dtype (its ``orig_dtype``)."""
    for name, t in (("input", x), ("bias", bias)):
        if t is not None and t.dtype != weight.dtype:
            raise TypeError(f"F.linear with an NVFP4 weight: {name} dtype {t.dtype} differs from the "
                            f"weight's dtype {weight.dtype} (the dtype it dequantizes to)")
    return _FrozenWeightLinear.apply(x, weight, bias)
