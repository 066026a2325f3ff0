"""SP patterns around native torch RMSNorm, in the forms post-grad graphs hold.

Three ways of writing the norm (each traced, so the pattern is whatever decomposition the
running torch version produces):

* ``functional``: ``torch.nn.functional.rms_norm(x, (hidden,), weight, eps)``
* ``manual``: ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight`` (in x's dtype)
* ``fp32``: the Hugging Face Llama form, statistics in float32:
  ``weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)``, ``xf = x.float()``

The residual add is a plain ``+``, written either ``x + residual`` or ``residual + x`` (an FX
pattern is not commutative, so both orders are registered). Positions as in sp_common.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fp4fuse.patterns.sp_common import NormFamily, Position, SPGroup, SPPattern

__all__ = ["FAMILIES", "TorchFP32Norm", "TorchFunctionalNorm", "TorchManualNorm", "build_patterns", "present"]


class _TorchNorm(NormFamily):
    def __init__(self, residual_first: bool = False) -> None:
        self.residual_first = residual_first

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + x if self.residual_first else x + residual
        return self.norm(total, weight, eps), total


class TorchFunctionalNorm(_TorchNorm):
    name = "torch_functional"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)


class TorchManualNorm(_TorchNorm):
    name = "torch_manual"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TorchFP32Norm(_TorchNorm):
    name = "torch_fp32"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


FAMILIES: tuple[type[_TorchNorm], ...] = (TorchFunctionalNorm, TorchManualNorm, TorchFP32Norm)


def build_patterns(group: SPGroup, dtype: torch.dtype, min_tokens: int = 0) -> list[SPPattern]:
    """Every torch form, both add orders, for ``group`` and one activation dtype (fp32 traces
    without the casts of bf16/fp16, so it is a pattern of its own; fp16 traces like bf16).
    LAST before MIDDLE, as in sp_fp4fuse_norm."""
    example_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    return [SPPattern(cls(residual_first), pos, group, example_dtype, min_tokens)
            for cls in FAMILIES for pos in (Position.FIRST, Position.LAST, Position.MIDDLE)
            for residual_first in ((False,) if pos is Position.FIRST else (False, True))]


def present(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` may hold a torch RMSNorm (every form decomposes to an ``rsqrt``)."""
    return bool(graph.find_nodes(op="call_function", target=torch.ops.aten.rsqrt.default))
