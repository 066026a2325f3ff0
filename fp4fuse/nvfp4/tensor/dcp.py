"""The NVFP4 payload as plain tensors, for storage formats and readers that cannot hold a subclass.

``dcp.save(model.state_dict())`` / ``dcp.load(model.state_dict())`` need nothing from this module:
DCP stores an NVFP4Tensor entry as NVFP4Tensor chunks (``NVFP4Tensor.__get_tensor_shard__``,
pickled payload, loaded with ``weights_only=True``). That needs fp4fuse to read the checkpoint and
a storage format that pickles tensors (DCP's default ``FileSystemWriter``).
:func:`nvfp4_state_dict_for_dcp` is for the others: safetensors (``HuggingFaceStorageWriter``),
which writes raw tensor bytes, and any reader without fp4fuse. It replaces each NVFP4Tensor entry
``fqn`` (plain, or a DTensor whose local tensor is an NVFP4Tensor, as FSDP2's ``state_dict()``
gives) by three plain entries that **alias** its inner tensors:

* ``fqn.qdata``  uint8 ``[N, K/2]``;
* ``fqn.scale``  uint8 ``[N, K/16]`` (the float8_e4m3fn scales viewed as bytes);
* ``fqn.amax``   fp32 ``[1]``, a plain (replicated) tensor: every shard holds the same amax. A rank
  whose shard of a DTensor entry is empty (FSDP2 on more ranks than rows) leaves it out: its amax
  governs no value and is stale after a ``dcp.load`` (which never writes an empty shard), and DCP
  would store the copy of whichever rank its planner picks for a replicated entry.

A DTensor entry sharded on dim 0 (``Shard(0)``) or replicated becomes DTensors of the same mesh and
placements over qdata and scale, so DCP stores row shards with their global offsets and reshards
on load with its own planner. ``dcp.load`` of the converted dict writes the bytes back **in place**
into the inner tensors of the NVFP4Tensors it was built from (every row and the amax, so any
target works). ``orig_dtype`` and ``amax_group`` are not stored: they come from the target.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from fp4fuse.nvfp4.tensor.op_table import contiguous_strides
from fp4fuse.nvfp4.tensor.subclass import NVFP4Tensor

__all__ = ["nvfp4_state_dict_for_dcp"]

logger = logging.getLogger(__name__)

_PARTS = ("qdata", "scale", "amax")


def _payload(t: NVFP4Tensor) -> dict[str, torch.Tensor]:
    """Plain views of ``t``'s inner tensors (scale as uint8), keyed by part name."""
    return {"qdata": t.qdata, "scale": t.scale.view(torch.uint8), "amax": t.amax}


def _dtensor_payload(fqn: str, dt: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    for p in dt.placements:
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)):
            raise NotImplementedError(f"nvfp4_state_dict_for_dcp: {fqn} has placement {p}; NVFP4 "
                                      f"weights checkpoint only when sharded on dim 0 or replicated")
    local_tensor = dt.to_local()
    local = _payload(local_tensor)
    out: dict[str, torch.Tensor] = {}
    if local_tensor.numel() > 0 or dt.numel() == 0:  # the first shard is never empty (torch.chunk)
        out["amax"] = local["amax"]
    for part, divisor in (("qdata", 2), ("scale", 16)):
        shape = (*dt.shape[:-1], dt.shape[-1] // divisor)
        out[part] = DTensor.from_local(local[part], dt.device_mesh, dt.placements, run_check=False,
                                       shape=torch.Size(shape), stride=contiguous_strides(shape))
    return out


def nvfp4_state_dict_for_dcp(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``state_dict`` with each NVFP4Tensor entry ``fqn`` split into
    ``fqn.qdata`` / ``fqn.scale`` / ``fqn.amax`` aliasing its payload (see the module docstring);
    other entries are passed through unchanged. Use the result as the state dict of
    ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``."""
    # DTensor is imported here, not at module level: importing it costs seconds, and importing
    # fp4fuse imports this package (to register NVFP4Tensor for weights_only loads).
    from torch.distributed.tensor import DTensor
    out: dict[str, Any] = {}
    for fqn, value in state_dict.items():
        if isinstance(value, DTensor) and isinstance(value.to_local(), NVFP4Tensor):
            parts = _dtensor_payload(fqn, value)
        elif isinstance(value, NVFP4Tensor):
            parts = _payload(value)
        else:
            out[fqn] = value
            continue
        for part in _PARTS:
            key = f"{fqn}.{part}"
            if key in state_dict:
                raise ValueError(f"nvfp4_state_dict_for_dcp: {key} already exists in the state dict")
            if part in parts:
                out[key] = parts[part]
    return out
