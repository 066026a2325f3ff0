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

Targets that are rows of a larger payload (several parameters viewing one NVFP4Tensor, e.g. fused
q/k/v rows) share its amax: setting it for one would rescale the rows of the others. Where rows
outside the target hold nonzero codes, the load therefore spans the whole payload: the first such
target to change the amax zeroes the whole payload (rows not loaded yet read 0), and every target
of that payload must bring the same amax until as many elements were written as the payload holds,
else ``ValueError`` (views of one payload cannot take different amaxes from a checkpoint). Rows
outside that hold only zero codes (FSDP2's padding) are 0 under any amax and change nothing.
"""
from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["CheckpointRestore", "payload_outside", "restore_of"]

logger = logging.getLogger(__name__)


class _Payload(Protocol):
    qdata: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor

    def numel(self) -> int: ...


def _bits(amax: torch.Tensor) -> torch.Tensor:
    return amax.view(torch.int32)


def _amax_mismatch(expected_bits: torch.Tensor, got_bits: torch.Tensor, message: str) -> ValueError:
    """``ValueError(message)`` with ``{expected!r}`` / ``{got!r}`` filled in from two amaxes' fp32 bits."""
    return ValueError(message.format(expected=expected_bits.view(torch.float32).item(),
                                     got=got_bits.view(torch.float32).item()))


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def payload_outside(qdata: torch.Tensor) -> list[torch.Tensor] | None:
    """The bytes of ``qdata``'s storage before and after ``qdata`` (None if not contiguous).

    The tensors that share an NVFP4Tensor's amax are the views of one payload, i.e. of that storage."""
    if not qdata.is_contiguous():
        return None
    storage = _storage_bytes(qdata)
    return [storage[:qdata.storage_offset()], storage[qdata.storage_offset() + qdata.numel():]]


def _holds_codes(outside: list[torch.Tensor] | None) -> bool:
    """Some byte of ``outside`` (:func:`payload_outside`) holds a code that is not ±0 (its value
    depends on the shared amax); True when that cannot be told (None: not contiguous)."""
    return outside is None or any(bool(((part & 0x77) != 0).any()) for part in outside)


class _PayloadLoad:
    """The open load of a payload that several targets view (module docstring)."""

    def __init__(self, bits: torch.Tensor, numel: int) -> None:
        self.bits, self.numel, self.written = bits, numel, 0


# qdata storage -> its open _PayloadLoad; an entry dies with the storage.
_PAYLOAD_LOADS: WeakIdKeyDictionary = WeakIdKeyDictionary()


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
            self._begin(bits, src.amax)
            self._amax_bits = bits.clone()
        elif not torch.equal(bits, self._amax_bits):
            raise _amax_mismatch(
                self._amax_bits, bits,
                "dcp.load into an NVFP4Tensor: the checkpoint chunks of this weight carry different "
                "amax values ({expected!r} for the chunks read so far, {got!r} for this one). Rows "
                "quantized with different global scales cannot share one NVFP4Tensor: load it with "
                "the sharding it was saved with, or requantize it")
        dst.qdata.copy_(src.qdata, non_blocking)
        dst.scale.copy_(src.scale, non_blocking)
        self._written += dst.numel()
        if self._written >= self._numel:
            self._amax_bits, self._written = None, 0
        storage = self._payload[0].untyped_storage()
        shared = _PAYLOAD_LOADS.get(storage)
        if shared is not None:
            shared.written += dst.numel()
            if shared.written >= shared.numel:
                del _PAYLOAD_LOADS[storage]

    def _begin(self, bits: torch.Tensor, amax: torch.Tensor) -> None:
        """The first chunk of a load into the target: set the amax to the chunk's ``bits``."""
        qdata = self._payload[0]
        changes = not torch.equal(bits, _bits(self._amax))
        outside = payload_outside(qdata)
        if outside is not None and all(part.numel() == 0 for part in outside):
            if changes:  # the target is its whole payload: nothing else decodes under its amax
                self._reset(self._payload, amax)
            return
        storage = qdata.untyped_storage()
        if _holds_codes(outside):
            shared = _PAYLOAD_LOADS.get(storage)
            if shared is not None:  # another view of this payload was loaded in this load
                if changes or not torch.equal(bits, shared.bits):
                    raise _amax_mismatch(
                        shared.bits, bits,
                        "dcp.load into an NVFP4Tensor that shares its payload and amax with other "
                        "tensors (views of one NVFP4Tensor, e.g. fused rows): the checkpoint gives "
                        "it amax {got!r}, but the rows of the other views loaded in this load carry "
                        "{expected!r}, and one amax cannot decode both. Give each view its own "
                        "payload (clone it), or save and load the shared tensor as one entry")
                return
            if changes:  # rows of other views would decode under the new amax: zero them all
                self._reset((_storage_bytes(qdata), _storage_bytes(self._payload[1])), amax)
        elif changes:
            self._reset(self._payload, amax)
        _PAYLOAD_LOADS[storage] = _PayloadLoad(bits.clone(), storage.nbytes() * 2)

    def _reset(self, payload: tuple[torch.Tensor, ...], amax: torch.Tensor) -> None:
        """Zero ``payload`` (codes and scales, or their whole storages) and take ``amax``."""
        for inner in payload:
            inner.zero_()
        self._amax.copy_(amax)


_RESTORES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def restore_of(target: _Payload) -> CheckpointRestore:
    """The open restore of ``target`` (created on first use; lives as long as ``target``)."""
    restore = _RESTORES.get(target)
    if restore is None:
        restore = _RESTORES[target] = CheckpointRestore(target)
    return restore
