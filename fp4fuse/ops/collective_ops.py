"""Collective NVFP4 GEMMs: the ops the AsyncTP pass rewrites into.

* ``fused_all_gather_fp4_matmul(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name)``
  ``= mm_fp4(all_gather(a_shard), b, all_gather(a_scale_shard), b_scale, alpha, out_dtype)``,
  gathered along dim 0 in rank order. ``fused_all_gather_fp4_matmul_gathered`` is the same op that
  also returns the gathered ``(a, a_scale)`` for graphs that still use them.
* ``fused_fp4_matmul_reduce_scatter(a, b, a_scale, b_scale, alpha, out_dtype, group_name)``
  ``= reduce_scatter_sum(mm_fp4(a, b, a_scale, b_scale, alpha, out_dtype))`` along dim 0: each rank
  gets rows ``[rank*M/W, (rank+1)*M/W)``. The per-rank partials are ``out_dtype`` (what ``mm_fp4``
  returns); they are summed in fp32 and rounded once to ``out_dtype``. For two ranks that equals a
  reduce-scatter in ``out_dtype``.

This module holds the contracts and the path that runs everywhere: functional collectives plus
``mm_fp4`` (gloo on CPU, or a CUDA group symmetric memory cannot serve) -- identical results to the
unfused graph, no overlap. Scales travel as uint8 views (gloo has no float8 collectives).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fp4fuse.ops import validation

_funcol = torch.ops._c10d_functional


def group_size_of(group_name: str) -> int:
    """World size of the process group registered under ``group_name``."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    return dist.get_world_size(_resolve_process_group(group_name))


def group_rank_of(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group
    return dist.get_rank(_resolve_process_group(group_name))


def all_gather_rows(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """All-gather along dim 0 through functional collectives; float8 travels as uint8."""
    world = group_size_of(group_name)
    is_fp8 = t.dtype == torch.float8_e4m3fn
    payload = t.view(torch.uint8) if is_fp8 else t
    out = _funcol.wait_tensor(_funcol.all_gather_into_tensor(payload.contiguous(), world, group_name))
    return out.view(torch.float8_e4m3fn) if is_fp8 else out


def reduce_scatter_rows_fp32(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum ``partial`` over the group in fp32 and return this rank's dim-0 chunk in its dtype."""
    world = group_size_of(group_name)
    summed = _funcol.wait_tensor(
        _funcol.reduce_scatter_tensor(partial.float().contiguous(), "sum", world, group_name))
    return summed.to(partial.dtype)


def _check_rows_divisible(op: str, rows: int, world: int) -> None:
    if rows % world != 0:
        raise ValueError(f"fp4fuse.{op}: a has {rows} rows, which must be divisible by the group size {world}")


def all_gather_fp4_matmul_fallback(
    a_shard: torch.Tensor, a_scale_shard: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unfused path: gather data and scales, then one ``mm_fp4``. Returns (out, a, a_scale)."""
    a = all_gather_rows(a_shard, group_name)
    a_scale = all_gather_rows(a_scale_shard, group_name)
    out = torch.ops.fp4fuse.mm_fp4(a, b, a_scale, b_scale, alpha, out_dtype)
    return out, a, a_scale


def fp4_matmul_reduce_scatter_fallback(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype, group_name: str,
) -> torch.Tensor:
    """Unfused path: full ``mm_fp4`` then an fp32 reduce-scatter of the partials."""
    partial = torch.ops.fp4fuse.mm_fp4(a, b, a_scale, b_scale, alpha, out_dtype)
    return reduce_scatter_rows_fp32(partial, group_name)


@torch.library.custom_op("fp4fuse::fused_all_gather_fp4_matmul", mutates_args=())
def fused_all_gather_fp4_matmul(
    a_shard: torch.Tensor, a_scale_shard: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype, group_name: str,
) -> torch.Tensor:
    validation.check_mm_inputs(a_shard, b, a_scale_shard, b_scale, alpha, out_dtype, op="fused_all_gather_fp4_matmul")
    return all_gather_fp4_matmul_fallback(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name)[0]


@fused_all_gather_fp4_matmul.register_fake
def _(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name):
    world = group_size_of(group_name)
    return a_shard.new_empty((a_shard.shape[0] * world, b.shape[0]), dtype=out_dtype)


@torch.library.custom_op("fp4fuse::fused_all_gather_fp4_matmul_gathered", mutates_args=())
def fused_all_gather_fp4_matmul_gathered(
    a_shard: torch.Tensor, a_scale_shard: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    validation.check_mm_inputs(a_shard, b, a_scale_shard, b_scale, alpha, out_dtype,
                               op="fused_all_gather_fp4_matmul_gathered")
    return all_gather_fp4_matmul_fallback(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name)


@fused_all_gather_fp4_matmul_gathered.register_fake
def _(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name):
    world = group_size_of(group_name)
    m = a_shard.shape[0] * world
    return (a_shard.new_empty((m, b.shape[0]), dtype=out_dtype),
            a_shard.new_empty((m, a_shard.shape[1])),
            a_scale_shard.new_empty((m, a_scale_shard.shape[1])))


@torch.library.custom_op("fp4fuse::fused_fp4_matmul_reduce_scatter", mutates_args=())
def fused_fp4_matmul_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype, group_name: str,
) -> torch.Tensor:
    op = "fused_fp4_matmul_reduce_scatter"
    validation.check_mm_inputs(a, b, a_scale, b_scale, alpha, out_dtype, op=op)
    _check_rows_divisible(op, a.shape[0], group_size_of(group_name))
    return fp4_matmul_reduce_scatter_fallback(a, b, a_scale, b_scale, alpha, out_dtype, group_name)


@fused_fp4_matmul_reduce_scatter.register_fake
def _(a, b, a_scale, b_scale, alpha, out_dtype, group_name):
    world = group_size_of(group_name)
    _check_rows_divisible("fused_fp4_matmul_reduce_scatter", a.shape[0], world)
    return a.new_empty((a.shape[0] // world, b.shape[0]), dtype=out_dtype)
