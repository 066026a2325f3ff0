"""Column- and row-parallel linears with NVFP4 weights and activations.

Weights are quantized once, at construction, for the local shard: ``weight_q`` uint8
``[N_local, K_local/2]``, ``weight_scale`` e4m3 ``[N_local, K_local/16]``, ``weight_global_scale``
fp32 ``[1]`` (from the shard's amax). Each call quantizes the activation with the layer's
``NVFP4Quantizer`` (fp4fuse.nvfp4.quantizer) and runs ``mm_fp4`` with ``alpha = 1 / (gs_a * gs_w)``.

* ``ColumnParallelNVFP4Linear``: the weight is split by output rows; the input is the full,
  replicated activation; the output holds this rank's output features. ``parts`` splits a merged
  weight (qkv, gate_up) part by part, so each rank holds matching slices of every part.
* ``RowParallelNVFP4Linear``: the weight is split by input columns; the input holds this rank's
  features; the partial products are summed with a functional ``all_reduce`` (which sequence
  parallelism later turns into a reduce-scatter).

Activation quantizers: a column-parallel input is replicated, so a dynamic scale from the local
amax is the same on every rank (``NVFP4Quantizer()``); a row-parallel input is a different slice on
each rank, and each rank's partial product carries its own alpha, so a local amax is right there too.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.nvfp4.quantizer import NVFP4Quantizer
from fp4fuse.tp.parallel import TPGroup, shard

__all__ = ["ColumnParallelNVFP4Linear", "NVFP4Linear", "RowParallelNVFP4Linear", "quantize_weight"]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, s, gs)`` of a 2-D weight, gs from its own amax (encode convention)."""
    gs = nvfp4.global_scale_from_amax(weight.float().abs().amax().reshape(1))
    q, s = torch.ops.fp4fuse.scaled_fp4_quant(weight.contiguous(), gs)
    return q, s, gs


class NVFP4Linear(nn.Module):
    """``y = x @ W^T`` with W held in NVFP4 and x quantized per call (no bias)."""

    def __init__(self, weight: torch.Tensor, act_quantizer: NVFP4Quantizer, out_dtype: torch.dtype) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"NVFP4Linear: weight must be 2-D, got shape {tuple(weight.shape)}")
        q, s, gs = quantize_weight(weight)
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", s)
        self.register_buffer("weight_global_scale", gs)
        self.act_quantizer = act_quantizer
        self.out_dtype = out_dtype
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        q, s, gs = self.act_quantizer.quantize(x)
        alpha = torch.reciprocal(gs * self.weight_global_scale)
        return torch.ops.fp4fuse.mm_fp4(q, self.weight_q, s, self.weight_scale, alpha, self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, act={self.act_quantizer}"


class ColumnParallelNVFP4Linear(NVFP4Linear):
    """Output features split across the group; ``full_weight`` is the unsharded ``[N, K]``."""

    def __init__(self, full_weight: torch.Tensor, group: TPGroup, act_quantizer: NVFP4Quantizer,
                 out_dtype: torch.dtype = torch.bfloat16, parts: tuple[int, ...] | None = None) -> None:
        parts = parts or (full_weight.shape[0],)
        if sum(parts) != full_weight.shape[0]:
            raise ValueError(f"ColumnParallelNVFP4Linear: parts {parts} do not sum to {full_weight.shape[0]} rows")
        local = torch.cat([shard(p, 0, group, "output features") for p in full_weight.split(list(parts), 0)])
        super().__init__(local, act_quantizer, out_dtype)
        self.group = group
        self.local_parts = tuple(group.split(p, "output features") for p in parts)


class RowParallelNVFP4Linear(NVFP4Linear):
    """Input features split across the group; the output is all-reduced (summed) over it."""

    def __init__(self, full_weight: torch.Tensor, group: TPGroup, act_quantizer: NVFP4Quantizer,
                 out_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(shard(full_weight, 1, group, "input features"), act_quantizer, out_dtype)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.matmul(x)
        return funcol.all_reduce(partial, "sum", self.group.name)
