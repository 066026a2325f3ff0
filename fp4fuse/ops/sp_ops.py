"""``fp4fuse::shard_rows``: this rank's dim-0 chunk of a replicated tensor, rank read at run time.

    shard_rows(x [M, ...], group_name) -> x[r*M/W : (r+1)*M/W]      r = rank in the group, W = its size

The sequence-parallel pass slices the residual stream to the local token shard with it. The
rank is resolved from the process group when the op runs, never baked into the graph: ranks on
one host share the Inductor FX graph cache, and a graph holding ``rank * M/W`` as a constant
served one rank's slice to every rank (docs/design.md, "Rank uniformity and the FX cache").

The output is a fresh contiguous tensor (custom ops must not return views of their inputs).
``M`` must be divisible by the group size; the fake implementation states that with
``torch._check``, so a symbolic ``M`` gets the matching guard.
"""
from __future__ import annotations

import torch

from fp4fuse.distributed.groups import group_rank_of, group_size_of

__all__ = ["shard_rows"]


def _rows_per_rank(rows: int | torch.SymInt, world: int) -> int | torch.SymInt:
    torch._check(
        rows % world == 0,
        lambda: f"fp4fuse.shard_rows: x has {rows} rows, which must be divisible by the group size {world}",
    )
    return rows // world


@torch.library.custom_op("fp4fuse::shard_rows", mutates_args=())
def shard_rows(x: torch.Tensor, group_name: str) -> torch.Tensor:
    if x.dim() < 1:
        raise ValueError(f"fp4fuse.shard_rows: x must have at least one dimension, got shape {tuple(x.shape)}")
    world = group_size_of(group_name)
    rows = _rows_per_rank(x.shape[0], world)
    start = group_rank_of(group_name) * rows
    return x[start:start + rows].clone(memory_format=torch.contiguous_format)


@shard_rows.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    if x.dim() < 1:
        raise ValueError(f"fp4fuse.shard_rows: x must have at least one dimension, got shape {tuple(x.shape)}")
    rows = _rows_per_rank(x.shape[0], group_size_of(group_name))
    return x.new_empty((rows, *x.shape[1:]))
