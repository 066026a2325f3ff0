"""Activations as rows, and the row-parallel sum.

TP linears compute on 2-D ``[T, K]`` rows: an activation ``[..., K]`` with any leading dimensions
(``[batch, seq, hidden]`` in Hugging Face models) is flattened to ``T = prod(leading)`` rows for the
ops and its leading shape restored on the output. A 2-D input passes through untouched, so graphs of
2-D models hold no extra view nodes.

A row-parallel linear sums its partial product over the group on the 2-D rows (``mm -> all_reduce``
stays adjacent in the graph, the form the fusion passes match), then adds the bias once, after the
reduction, then restores the leading shape.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from fp4fuse.tp.parallel import TPGroup

__all__ = ["from_rows", "row_parallel_sum", "to_rows"]


def to_rows(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """``x [..., K]`` -> ``(rows [T, K] contiguous, leading shape)``; leading shape None for 2-D x
    (a 1-D ``[K]`` is one row, as for ``nn.Linear``)."""
    if x.dim() == 2:
        return x, None
    if x.dim() == 0:
        raise ValueError("TP linear: the input must have a feature dimension, got a 0-d tensor")
    return x.reshape(-1, x.shape[-1]).contiguous(), tuple(x.shape[:-1])


def from_rows(y: torch.Tensor, lead: tuple[int, ...] | None) -> torch.Tensor:
    """``y [T, N]`` -> ``[*lead, N]`` (unchanged when lead is None)."""
    return y if lead is None else y.reshape(*lead, y.shape[-1])


def row_parallel_sum(partial: torch.Tensor, group: TPGroup, bias: torch.Tensor | None,
                     lead: tuple[int, ...] | None) -> torch.Tensor:
    """``all_reduce_sum(partial [T, N]) + bias``, reshaped to ``[*lead, N]``: the output of a
    row-parallel linear, replicated on every rank of ``group``."""
    out = funcol.all_reduce(partial, "sum", group.name)
    if bias is not None:
        out = out + bias
    return from_rows(out, lead)
