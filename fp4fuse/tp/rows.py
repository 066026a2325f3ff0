"""Activations as rows, and the row-parallel sum.

TP linears compute on 2-D ``[T, K]`` rows: an activation ``[..., K]`` with any leading dimensions
(``[batch, seq, hidden]`` in Hugging Face models) is flattened to ``T = prod(leading)`` rows for the
ops and its leading shape restored on the output. A 2-D input passes through untouched, so graphs of
2-D models hold no extra view nodes.

A column-parallel linear whose output every rank needs whole gathers its output features
(``gather_features``); a row-parallel linear given a whole input takes this rank's features of it
(``local_features``). The feature gather is an all-gather of rows followed by a chunk + cat written
here, not funcol's gather along the last dimension: torch 2.11's ``all_gather_tensor`` reassembles
through ``torch._utils._maybe_view_chunk_cat``, which Dynamo refuses to trace, so every gathered
linear was a graph break there (HF Phi-3, GLM and OLMo 2 plans), and no rewrite could span it.

A row-parallel linear sums its partial product over the group on the 2-D rows (``mm -> all_reduce``
stays adjacent in the graph, the form the fusion passes match), then adds the bias once, after the
reduction, then restores the leading shape.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from fp4fuse.tp.parallel import TPGroup

__all__ = ["from_rows", "gather_features", "local_features", "row_parallel_sum", "to_rows"]

# torch 2.13 renames funcol.all_gather_tensor (deprecated there) to all_gather_single; same arguments
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def to_rows(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """``x [..., K]`` -> ``(rows [T, K] contiguous, leading shape)``; leading shape None for 2-D x
    (a 1-D ``[K]`` is one row, as for ``nn.Linear``)."""
    if x.dim() == 2:
        return x.contiguous(), None
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


def gather_features(y: torch.Tensor, group: TPGroup, parts: tuple[int, ...] | None = None) -> torch.Tensor:
    """``y [..., N / size]`` on each rank -> ``[..., N]``, rank ``r``'s features at
    ``[r * N / size, (r + 1) * N / size)``: the whole output of a column-parallel linear, the same
    on every rank (a functional all-gather of rows, reassembled along the last dimension: module
    docstring).

    ``parts``: the local widths of a merged output (``ColumnParallelNVFP4Linear.local_parts``, e.g.
    q/k/v), each rank holding its slice of every part: the gathered output is then part by part,
    every rank's slice of part 0, then of part 1, ... (the merged weight's own order), not rank by rank."""
    if group.size == 1:
        return y
    stacked = _ALL_GATHER(y.contiguous(), gather_dim=0, group=group.name)  # [size * lead0, ..., N / size]
    chunks = torch.chunk(stacked, group.size, dim=0)
    if parts is None or len(parts) == 1:
        return torch.cat(chunks, dim=-1)
    if sum(parts) != y.shape[-1]:
        raise ValueError(f"gather_features: parts {tuple(parts)} do not sum to the local features {y.shape[-1]}")
    split = [chunk.split(list(parts), dim=-1) for chunk in chunks]
    return torch.cat([rank_parts[i] for i in range(len(parts)) for rank_parts in split], dim=-1)


def local_features(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """This rank's features of a whole input ``x [..., K]``: ``x[..., r * K / size : (r + 1) * K / size]``,
    contiguous (what a row-parallel linear multiplies). ValueError if K does not divide."""
    k = group.split(x.shape[-1], "row-parallel input features")
    return x if group.size == 1 else x.narrow(-1, group.rank * k, k).contiguous()
