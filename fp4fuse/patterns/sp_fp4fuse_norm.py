"""SP patterns around fp4fuse's own norm ops (``fp4fuse::rms_norm``, ``fp4fuse::fused_add_rms_norm``).

    first:   all_reduce -> fp4fuse.rms_norm
    middle:  all_reduce -> fp4fuse.fused_add_rms_norm      (residual_out read later)
    last:    all_reduce -> fp4fuse.fused_add_rms_norm      (residual_out not read)

The rewrites themselves live in fp4fuse.patterns.sp_common.SPPattern.
"""
from __future__ import annotations

import torch

from fp4fuse.patterns.sp_common import NormFamily, Position, SPGroup, SPPattern

__all__ = ["FP4FuseNorm", "build_patterns", "present"]


class FP4FuseNorm(NormFamily):
    name = "fp4fuse"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.fp4fuse.rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, residual_out = torch.ops.fp4fuse.fused_add_rms_norm(x, residual, weight, eps)
        return out, residual_out


def build_patterns(group: SPGroup, dtype: torch.dtype, min_tokens: int = 0) -> list[SPPattern]:
    """The family's patterns for ``group`` in registration (= priority) order: LAST before
    MIDDLE, so a final norm (residual sum unread) counts as the last one. The ops are
    dtype-generic, so ``dtype`` does not change the patterns."""
    return [SPPattern(FP4FuseNorm(), pos, group, min_tokens=min_tokens)
            for pos in (Position.FIRST, Position.LAST, Position.MIDDLE)]


def present(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` holds this family's norms (so its patterns are worth registering)."""
    return any(graph.find_nodes(op="call_function", target=t)
               for t in (torch.ops.fp4fuse.rms_norm.default, torch.ops.fp4fuse.fused_add_rms_norm.default))
