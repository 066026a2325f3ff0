"""``NVFP4Tensor``: an NVFP4 weight as a tensor subclass, for FSDP2 and DCP.

* ``subclass``: the class (inner tensors, construction, FSDP2 all-gather hooks, DCP's
  ``__get_tensor_shard__``, dispatch); importing it registers the class for ``weights_only`` loads;
* ``op_table``: the aten override table its dispatch reads;
* ``aten_ops``: the overrides (views, copies, FSDP2/DTensor/DCP's ops, functional collectives,
  dequantizing matmuls);
* ``linear``: ``F.linear`` with a frozen NVFP4 weight (autograd to the input and bias);
* ``restore``: the rules of a ``dcp.load`` into an NVFP4Tensor, chunk by chunk;
* ``dcp``: ``nvfp4_state_dict_for_dcp``, the payload as plain tensors (storage formats and readers
  that cannot hold a tensor subclass).
"""
from fp4fuse.nvfp4.tensor import aten_ops  # noqa: F401  (fills the override table)
from fp4fuse.nvfp4.tensor.dcp import nvfp4_state_dict_for_dcp
from fp4fuse.nvfp4.tensor.subclass import NVFP4Tensor

__all__ = ["NVFP4Tensor", "nvfp4_state_dict_for_dcp"]
