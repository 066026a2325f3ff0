"""The tensor-parallel group as TP layers hold it, and seeded, layout-independent initialization.

Layers keep the group's *name* (a string, what functional collectives take; a constant under
torch.compile), its size and this rank's index in it -- never the ProcessGroup object.

Initialization draws each full (unsharded) tensor from a generator seeded by the model seed and the
tensor's name, then each rank keeps its shard: the same seed gives the same model at any TP size
and in any construction order.
"""
from __future__ import annotations

import dataclasses
import zlib

import torch
import torch.distributed as dist

__all__ = ["TPGroup", "seeded_normal", "shard"]


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """``name``: the process group's name; ``size``: its ranks; ``rank``: this process's index in it."""

    name: str
    size: int
    rank: int

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None = None) -> TPGroup:
        """The TP group from a process group (default: the default group). Needs an initialized
        torch.distributed and a process that is a member of ``group``."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TPGroup.from_process_group: torch.distributed is not initialized")
        group = dist.group.WORLD if group is None else group
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("TPGroup.from_process_group: this process is not a member of the group")
        return cls(group.group_name, dist.get_world_size(group), rank)

    def split(self, n: int, what: str) -> int:
        """``n / size``, with an error naming ``what`` if it does not divide."""
        if n % self.size:
            raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size {self.size}")
        return n // self.size


def seeded_normal(seed: int, name: str, shape: tuple[int, ...], std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    """A float32 CPU tensor ``N(mean, std)`` that depends only on ``(seed, name, shape)``."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (2 ** 63))
    return torch.randn(shape, generator=gen) * std + mean


def shard(full: torch.Tensor, dim: int, group: TPGroup, what: str) -> torch.Tensor:
    """This rank's contiguous chunk of ``full`` along ``dim``."""
    n = group.split(full.shape[dim], what)
    return full.narrow(dim, group.rank * n, n).contiguous()
