"""Column- and row-parallel linears in the model's own dtype (no quantization).

The same TP structure as the NVFP4 linears of fp4fuse.tp.linear, with ``F.linear``: the baseline
that NVFP4 is measured against (``parallelize(..., weight_format=WeightFormat.BF16)``).

* ``ColumnParallelLinear``: ``weight`` ``[N/size, K]`` and ``bias`` ``[N/size]`` (this rank's output
  rows); input replicated, output this rank's features.
* ``RowParallelLinear``: ``weight`` ``[N, K/size]`` (this rank's input columns), ``bias`` ``[N]``
  unsharded; partial products summed with a functional ``all_reduce``, bias added once after it.

``gather_output`` (column) and ``input_is_parallel=False`` (row) give the plan styles
``colwise_gather_output`` / ``rowwise_split_input`` (fp4fuse.tp.plan), as for the NVFP4 linears.

Parameters are frozen (``requires_grad=False``): these layers serve inference, as the NVFP4 ones.
Inputs ``[..., K]`` run as 2-D rows (fp4fuse.tp.rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp4fuse.tp.parallel import TPGroup, shard
from fp4fuse.tp.rows import from_rows, gather_features, local_features, row_parallel_sum, to_rows

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach().contiguous(), requires_grad=False)


class _ShardedLinear(nn.Module):
    """``weight`` and ``bias`` already sliced for this rank."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup) -> None:
        super().__init__()
        self.weight = _frozen(weight)
        self.bias = _frozen(bias)
        self.group = group
        self.out_features, self.in_features = weight.shape

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp={self.group.rank}/{self.group.size}")


class ColumnParallelLinear(_ShardedLinear):
    """Output features split across the group: ``y_local = x @ W_local^T + b_local``;
    ``gather_output``: all-gathered to the whole ``y`` on every rank (``colwise_gather_output``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup, *,
                 gather_output: bool = False) -> None:
        super().__init__(weight, bias, group)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, lead = to_rows(x)
        out = from_rows(F.linear(rows, self.weight, self.bias), lead)
        return gather_features(out, self.group) if self.gather_output else out

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: TPGroup, *, gather_output: bool = False) -> ColumnParallelLinear:
        """This rank's column-parallel slice of ``linear``."""
        bias = None if linear.bias is None else shard(linear.bias.detach(), 0, group, "output features")
        return cls(shard(linear.weight.detach(), 0, group, "output features"), bias, group,
                   gather_output=gather_output)


class RowParallelLinear(_ShardedLinear):
    """Input features split across the group: ``y = all_reduce_sum(x_local @ W_local^T) + b``;
    ``input_is_parallel=False``: the input is whole and each rank takes its features of it
    (``rowwise_split_input``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup, *,
                 input_is_parallel: bool = True) -> None:
        super().__init__(weight, bias, group)
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, lead = to_rows(x if self.input_is_parallel else local_features(x, self.group))
        return row_parallel_sum(F.linear(rows, self.weight), self.group, self.bias, lead)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: TPGroup, *, input_is_parallel: bool = True) -> RowParallelLinear:
        """This rank's row-parallel slice of ``linear``."""
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(shard(linear.weight.detach(), 1, group, "input features"), bias, group,
                   input_is_parallel=input_is_parallel)
