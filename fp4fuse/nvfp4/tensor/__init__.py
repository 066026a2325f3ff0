"""``NVFP4Tensor``: an NVFP4 weight as a tensor subclass, for FSDP2 and DCP.

* ``subclass``: the class (inner tensors, construction, FSDP2 all-gather hooks, dispatch);
* ``op_table``: the aten override table its dispatch reads;
* ``aten_ops``: the overrides (views, copies, FSDP2/DCP's ops, dequantizing matmuls);
* ``dcp``: ``nvfp4_state_dict_for_dcp``, the raw payload for ``torch.distributed.checkpoint``.
"""
from fp4fuse.nvfp4.tensor import aten_ops  # noqa: F401  (fills the override table)
from fp4fuse.nvfp4.tensor.dcp import nvfp4_state_dict_for_dcp
from fp4fuse.nvfp4.tensor.subclass import NVFP4Tensor

__all__ = ["NVFP4Tensor", "nvfp4_state_dict_for_dcp"]
