"""Loading an NVFP4Tensor chunk by chunk, as ``dcp.load`` does, without a wrong row in between.

DCP loads a tensor in place: for every checkpoint chunk that overlaps the local tensor it calls

    target = state_dict[fqn].__get_tensor_shard__(index)     # NVFP4Tensor.__get_tensor_shard__
    target.narrow(0, a, n).detach().copy_(chunk.narrow(0, c, n))

until the chunks cover the target (resharding 2 -> 3 ranks: two chunks per target). Each chunk
carries the amax of the tensor it was saved from; the target holds one amax for all its rows. A
plain ``copy_`` into rows ``[a, a + n)`` cannot change that amax (the other rows would decode
under it, so ``fp4fuse.nvfp4.tensor.aten_ops`` refuses), so ``__get_tensor_shard__`` hands DCP a
*restore view* whose copies go through :class:`CheckpointRestore` instead:

* the first chunk of a load sets the amax; if that changes it, the whole target is zeroed first,
  so a row is never decoded under another row's amax (rows the checkpoint does not cover read 0);
* every later chunk must bring the same amax, else ``ValueError`` (a checkpoint whose shards were
  quantized with different global scales cannot be resharded into one tensor);
* once as many elements were written as the target holds, the load is complete and the next
  chunk starts a new one. A load that stops short leaves the restore open: the next load must then
  bring the same amax, or it fails with the same error (never a silent mix).
"""
from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["CheckpointRestore", "restore_of"]

logger = logging.getLogger(__name__)


class _Payload(Protocol):
    qdata: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor

    def numel(self) -> int: ...


def _bits(amax: torch.Tensor) -> torch.Tensor:
    return amax.view(torch.int32)


class CheckpointRestore:
    """The open DCP load into one NVFP4Tensor ``target`` (see the module docstring).

    Holds the target's inner tensors, not the target, so that the registry entry of
    :func:`restore_of` dies with the target."""

    def __init__(self, target: _Payload) -> None:
        self._payload = (target.qdata, target.scale)
        self._amax = target.amax
        self._numel = target.numel()
        self._amax_bits: torch.Tensor | None = None
        self._written = 0

    def copy_(self, dst: _Payload, src: _Payload, non_blocking: bool = False) -> None:
        """Write checkpoint chunk ``src`` into ``dst``, rows of the target (a view of it)."""
        bits = _bits(src.amax).to(self._amax.device)
        if self._amax_bits is None:
            if not torch.equal(bits, _bits(self._amax)):
                for inner in self._payload:
                    inner.zero_()
                self._amax.copy_(src.amax)
            self._amax_bits = bits.clone()
        elif not torch.equal(bits, self._amax_bits):
            expected = self._amax_bits.view(torch.float32).item()
            got = bits.view(torch.float32).item()
            raise ValueError(
                f"dcp.load into an NVFP4Tensor: the checkpoint chunks of this weight carry different "
                f"amax values ({expected!r} for the chunks read so far, {got!r} for this one). Rows "
                f"quantized with different global scales cannot share one NVFP4Tensor: load it with "
                f"the sharding it was saved with, or requantize it")
        dst.qdata.copy_(src.qdata, non_blocking)
        dst.scale.copy_(src.scale, non_blocking)
        self._written += dst.numel()
        if self._written >= self._numel:
            self._amax_bits, self._written = None, 0


_RESTORES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def restore_of(target: _Payload) -> CheckpointRestore:
    """The open restore of ``target`` (created on first use; lives as long as ``target``)."""
    restore = _RESTORES.get(target)
    if restore is None:
        restore = _RESTORES[target] = CheckpointRestore(target)
    return restore
