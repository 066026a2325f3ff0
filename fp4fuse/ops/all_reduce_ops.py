"""``fp4fuse::all_reduce_sum(x, group_name) -> out``: the sum of ``x`` over the group, as
``wait_tensor(_c10d_functional.all_reduce(x, "sum", group_name))`` computes it (a new contiguous
tensor, the same on every rank). The all-reduce pass (fp4fuse.passes.all_reduce) rewrites a
compiled graph's functional all-reduces into it.

* CUDA: PyTorch's symmetric-memory one-shot / two-shot kernels at two ranks, bfloat16 / float32,
  up to ``FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES`` (fp4fuse.distributed.symm_mem.all_reduce: bitwise
  NCCL's sum); NCCL for every other call, with the reason logged once per group.
* Elsewhere (CPU, gloo): the functional all-reduce itself, nothing added (one path, no choice).

A CUDA call first agrees across ranks (fp4fuse.distributed.groups.check_ranks_agree): the
rank-uniform environment, which decides the path, at the group's first call, and the shape and
dtype as ``FP4FUSE_COLLECTIVE_CHECK`` says. The CUDA kernel is registered on the dispatcher's CUDA
key (fp4fuse.ops.registration): an eager decode step makes one call per row-parallel linear.
"""
from __future__ import annotations

import torch

from fp4fuse.distributed import groups
from fp4fuse.distributed.symm_mem.all_reduce import symm_all_reduce_sum
from fp4fuse.ops.registration import cuda_kernel

_funcol = torch.ops._c10d_functional

_OP = "all_reduce_sum"
#: This op's code in the cross-rank call signature (the collective GEMMs use 1-3).
OP_CODE = 16


def _functional_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _funcol.wait_tensor(_funcol.all_reduce(x.contiguous(), "sum", group_name))


@torch.library.custom_op("fp4fuse::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _functional_sum(x, group_name)


@all_reduce_sum.register_fake
def _(x, group_name):
    return x.new_empty(x.shape)


@cuda_kernel(all_reduce_sum)
def _(x, group_name):
    groups.check_ranks_agree(_OP, group_name, OP_CODE, {"x": x}, x.dtype)
    out = symm_all_reduce_sum(x, group_name)
    return _functional_sum(x, group_name) if out is None else out
