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
dtype as ``FP4FUSE_COLLECTIVE_CHECK`` says.

The op is defined on the dispatcher directly (as ``fp4fuse::_mm_fp4_hopper`` is, fp4fuse.ops.fp4_ops),
not through ``torch.library.custom_op``: a compiled graph without CUDA graphs calls it once per
row-parallel linear, and ``custom_op``'s autograd layer ran Python on every call (measured in
benchmarks/results/2026-11-27-all-reduce-op-host-2xh200.md). It has no gradient formula, so both
kernels refuse inputs that require a gradient while autograd records (``registration.refuse_gradients``).
"""
from __future__ import annotations

import torch

from fp4fuse.distributed import groups
from fp4fuse.distributed.symm_mem.all_reduce import symm_all_reduce_sum
from fp4fuse.ops.registration import refuse_gradients

__all__ = ["OP_CODE", "all_reduce_sum"]

_funcol = torch.ops._c10d_functional

_OP = "all_reduce_sum"
_QUALIFIED = f"fp4fuse::{_OP}"
#: This op's code in the cross-rank call signature (the collective GEMMs use 1-3).
OP_CODE = 16

_lib = torch.library.Library("fp4fuse", "FRAGMENT")
_lib.define("all_reduce_sum(Tensor x, str group_name) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))


def _functional_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _funcol.wait_tensor(_funcol.all_reduce(x.contiguous(), "sum", group_name))


def _all_reduce_sum_functional(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every device but CUDA (gloo on CPU): the functional all-reduce itself."""
    refuse_gradients(_QUALIFIED, x=x)
    return _functional_sum(x, group_name)


def _all_reduce_sum_cuda(x: torch.Tensor, group_name: str) -> torch.Tensor:
    refuse_gradients(_QUALIFIED, x=x)
    groups.check_ranks_agree(_OP, group_name, OP_CODE, {"x": x}, x.dtype)
    out = symm_all_reduce_sum(x, group_name)
    return _functional_sum(x, group_name) if out is None else out


_lib.impl(_OP, _all_reduce_sum_functional, "CompositeExplicitAutograd")
_lib.impl(_OP, _all_reduce_sum_cuda, "CUDA")


@torch.library.register_fake(_QUALIFIED, lib=_lib)
def _(x, group_name):
    return x.new_empty(x.shape)


#: ``fp4fuse.ops.all_reduce_sum(x, group_name)``; ``.default`` is the overload graphs hold.
all_reduce_sum = torch.ops.fp4fuse.all_reduce_sum
