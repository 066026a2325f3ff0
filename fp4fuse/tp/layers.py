"""RMSNorm (fp4fuse ops or native torch) and a vocab-parallel embedding."""
from __future__ import annotations

import enum

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from fp4fuse.tp.parallel import TPGroup, shard

__all__ = ["NormImpl", "RMSNorm", "VocabParallelEmbedding"]


class NormImpl(enum.Enum):
    FP4FUSE = "fp4fuse"                  # fp4fuse::rms_norm / fp4fuse::fused_add_rms_norm
    TORCH_FUNCTIONAL = "torch_functional"  # torch.nn.functional.rms_norm, residual added with +
    TORCH_MANUAL = "torch_manual"        # x * rsqrt(mean(x^2) + eps) * w in x's dtype, residual added with +


class RMSNorm(nn.Module):
    """``forward(x)`` -> ``norm(x)``; ``forward(x, residual)`` -> ``(norm(x + residual), x + residual)``.

    With ``NormImpl.FP4FUSE`` the sum is rounded to x's dtype before the norm (fused_add_rms_norm's
    contract); the torch forms compute the sum in x's dtype as well."""

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6, impl: NormImpl = NormImpl.FP4FUSE) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.impl = impl

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl is NormImpl.FP4FUSE:
            return torch.ops.fp4fuse.rms_norm(x, self.weight, self.eps)
        if self.impl is NormImpl.TORCH_FUNCTIONAL:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        if self.impl is NormImpl.FP4FUSE:
            out, total = torch.ops.fp4fuse.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return out, total
        total = x + residual
        return self._norm(total), total

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, impl={self.impl.value}"


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across the group; each rank looks up its rows (zeros elsewhere) and
    the partial results are summed with a functional all_reduce (exact: one non-zero term).

    Token ids must lie in ``[0, num_embeddings)``, as for ``F.embedding``; ids are replicated, so
    every rank checks the same ids before the all_reduce and all ranks fail alike. Eager on CPU an
    id out of range raises ``IndexError`` naming it (``F.embedding``'s error type). Under
    ``torch.compile`` (also ``fullgraph=True``) and on CUDA the check is ``torch._assert_async``, a
    graph op with no host sync: a ``RuntimeError`` with the same message on CPU, a device-side
    assert on CUDA -- what ``F.embedding`` itself raises there (a data-dependent ``IndexError``
    would need a graph break or a host sync per call)."""

    def __init__(self, full_weight: torch.Tensor, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(shard(full_weight, 0, group, "vocab size"), requires_grad=False)
        self.group = group
        self.num_embeddings = full_weight.shape[0]
        self.vocab_start = group.rank * self.weight.shape[0]
        self.vocab_end = self.vocab_start + self.weight.shape[0]

    def _check_ids(self, ids: torch.Tensor) -> None:
        valid = (ids >= 0) & (ids < self.num_embeddings)
        message = f"VocabParallelEmbedding: token ids must be in [0, {self.num_embeddings})"
        if ids.device.type == "cpu" and not torch.compiler.is_compiling():
            if not bool(valid.all()):
                bad = ids[~valid]
                raise IndexError(f"{message}; got {bad.numel()} out of range, e.g. {int(bad[0])}")
        else:
            torch._assert_async(valid.all(), message)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(ids)
        local = (ids >= self.vocab_start) & (ids < self.vocab_end)
        rows = torch.where(local, ids - self.vocab_start, torch.zeros_like(ids))
        out = F.embedding(rows, self.weight)
        out = torch.where(local.unsqueeze(-1), out, torch.zeros_like(out))
        return funcol.all_reduce(out, "sum", self.group.name)
