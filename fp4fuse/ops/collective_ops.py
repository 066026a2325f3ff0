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

Two implementations, the same results:

* CUDA, a group symmetric memory can serve, at least
  :func:`~fp4fuse.distributed.symm_mem.policy.overlap_min_rows` total rows: the overlapped
  pipelines of :mod:`fp4fuse.distributed.symm_mem.pipelines` driving
  :class:`~fp4fuse.ops.collective_gemm.RowBlockGemm` (registered as the ops' CUDA kernels).
* Everywhere else (CPU / gloo, small calls, groups symmetric memory cannot serve): functional
  collectives plus ``mm_fp4``, no overlap; the reason is logged once per group at INFO. Scales
  travel as uint8 views (gloo has no float8 collectives).

Empty calls (0 rows, N = 0 or K = 0) are valid and return the empty (or ``alpha * 0``) result of
the contract's shape and dtype on every path.

Every call starts with :func:`~fp4fuse.distributed.groups.check_ranks_agree`: the ranks agree on
the rank-uniform environment (first call per group) and, as ``FP4FUSE_COLLECTIVE_CHECK`` says, on
shapes and dtypes; a mismatch it checks is a ``ValueError`` on every rank, not a hang (that
module's doc says which calls each mode checks).
"""
from __future__ import annotations

import logging

import torch

from fp4fuse.distributed import groups
from fp4fuse.distributed.groups import all_gather_rows, group_size_of, reduce_scatter_rows_fp32
from fp4fuse.distributed.symm_mem import pipelines, workspace
from fp4fuse.distributed.symm_mem import policy
from fp4fuse.distributed.symm_mem.policy import CollectiveGemmKind, NoOverlapReason
from fp4fuse.ops import validation
from fp4fuse.ops.backend import call_on_device
from fp4fuse.ops.collective_gemm import RowBlockGemm, sum_in_rank_order

logger = logging.getLogger(__name__)

_funcol = torch.ops._c10d_functional

_AG_OP = "fused_all_gather_fp4_matmul"
_AG_GATHERED_OP = "fused_all_gather_fp4_matmul_gathered"
_RS_OP = "fused_fp4_matmul_reduce_scatter"


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


# ----------------------------------------------------------------------------------------------
# Shared front half: agree across ranks, validate, choose the path
# ----------------------------------------------------------------------------------------------
def _prepare_all_gather(
    op: str, kind: CollectiveGemmKind, a_shard: torch.Tensor, a_scale_shard: torch.Tensor, b: torch.Tensor,
    b_scale: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype, group_name: str,
) -> int:
    """Agreement + validation; returns the total (gathered) row count."""
    groups.check_ranks_agree(op, group_name, int(kind), {
        "a_shard": a_shard, "a_scale_shard": a_scale_shard, "b": b, "b_scale": b_scale, "alpha": alpha,
    }, out_dtype)
    validation.check_mm_inputs(a_shard, b, a_scale_shard, b_scale, alpha, out_dtype, op=op,
                               a_names=("a_shard", "a_scale_shard"))
    return a_shard.shape[0] * group_size_of(group_name)


def _prepare_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype, group_name: str,
) -> int:
    """Agreement + validation (rows divisible by the group); returns the total row count."""
    groups.check_ranks_agree(_RS_OP, group_name, int(CollectiveGemmKind.MATMUL_REDUCE_SCATTER), {
        "a": a, "b": b, "a_scale": a_scale, "b_scale": b_scale, "alpha": alpha,
    }, out_dtype)
    validation.check_mm_inputs(a, b, a_scale, b_scale, alpha, out_dtype, op=_RS_OP)
    groups.check_rows_divisible(_RS_OP, "a", a.shape[0], group_size_of(group_name))
    return a.shape[0]


def _overlap_workspace(op: str, kind: CollectiveGemmKind, group_name: str, total_rows: int, b: torch.Tensor,
                       device: torch.device):
    """The symmetric workspace to overlap this CUDA call on, or ``None`` (reason logged once).

    Every input of the decision is the same on every rank (agreed shapes, env, a collective
    capability answer), so all ranks take the same path. An empty call (no rows, an empty
    weight ``b``: N = 0 or K = 0) runs the functional path, which handles empty tensors."""
    world = group_size_of(group_name)
    if world == 1:
        reason, detail = NoOverlapReason.SINGLE_RANK, ""
    elif policy.overlap_disabled():
        reason, detail = NoOverlapReason.DISABLED, ""
    elif total_rows == 0 or b.numel() == 0:
        reason, detail = NoOverlapReason.EMPTY, f"{total_rows} rows, weight {list(b.shape)}"
    elif total_rows < policy.overlap_min_rows(kind, world):
        reason = NoOverlapReason.BELOW_THRESHOLD
        detail = f"{total_rows} rows < {policy.overlap_min_rows(kind, world)} ({policy.ENV_MIN_ROWS})"
    else:
        try:
            return workspace.get_workspace(group_name, device)
        except workspace.WorkspaceUnavailable as exc:
            reason, detail = NoOverlapReason.SYMM_MEM_UNAVAILABLE, str(exc)
    policy.log_no_overlap_once(op, group_name, reason, detail)
    return None


def _all_gather_matmul_cuda(
    need_gathered: bool, a_shard: torch.Tensor, a_scale_shard: torch.Tensor, b: torch.Tensor,
    b_scale: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both all-gather ops' CUDA kernel, run with the inputs' GPU current (``call_on_device``: the
    pipelines launch on the current device's streams): ``(out, a, a_scale)``, the gathered operand
    made where ``need_gathered`` (or where the functional path gathers it anyway)."""
    op, kind = ((_AG_GATHERED_OP, CollectiveGemmKind.ALL_GATHER_MATMUL_GATHERED) if need_gathered
                else (_AG_OP, CollectiveGemmKind.ALL_GATHER_MATMUL))
    total = _prepare_all_gather(op, kind, a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name)
    ws = _overlap_workspace(op, kind, group_name, total, b, a_shard.device)
    if ws is None:
        return all_gather_fp4_matmul_fallback(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name)
    res = _overlapped_all_gather(ws, a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, need_gathered=need_gathered)
    return res.out, res.a, res.a_scale


def _overlapped_all_gather(
    ws: workspace.SymmWorkspace, a_shard: torch.Tensor, a_scale_shard: torch.Tensor, b: torch.Tensor,
    b_scale: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype, *, need_gathered: bool,
) -> pipelines.GatheredMatmul:
    """The symmetric-memory all-gather pipeline driving a :class:`RowBlockGemm` (CUDA)."""
    m = a_shard.shape[0]
    gemm = RowBlockGemm(b, b_scale, alpha, out_dtype, m, total_rows=ws.world_size * m)
    schedule = policy.all_gather_schedule(ws.world_size, m, b.shape[0], a_shard.shape[1] * 2)
    return pipelines.all_gather_and_consume(ws, a_shard, a_scale_shard, gemm, need_gathered=need_gathered,
                                            schedule=schedule)


# ----------------------------------------------------------------------------------------------
# fused_all_gather_fp4_matmul
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fp4fuse::fused_all_gather_fp4_matmul", mutates_args=())
def fused_all_gather_fp4_matmul(
    a_shard: torch.Tensor, a_scale_shard: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype, group_name: str,
) -> torch.Tensor:
    _prepare_all_gather(_AG_OP, CollectiveGemmKind.ALL_GATHER_MATMUL, a_shard, a_scale_shard, b, b_scale, alpha,
                        out_dtype, group_name)
    policy.log_no_overlap_once(_AG_OP, group_name, NoOverlapReason.NOT_CUDA, a_shard.device.type)
    return all_gather_fp4_matmul_fallback(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name)[0]


@fused_all_gather_fp4_matmul.register_fake
def _(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name):
    world = group_size_of(group_name)
    return a_shard.new_empty((a_shard.shape[0] * world, b.shape[0]), dtype=out_dtype)


@fused_all_gather_fp4_matmul.register_kernel("cuda")
def _(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name):
    return call_on_device(a_shard.device, _all_gather_matmul_cuda, False, a_shard, a_scale_shard, b, b_scale,
                          alpha, out_dtype, group_name)[0]


# ----------------------------------------------------------------------------------------------
# fused_all_gather_fp4_matmul_gathered
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fp4fuse::fused_all_gather_fp4_matmul_gathered", mutates_args=())
def fused_all_gather_fp4_matmul_gathered(
    a_shard: torch.Tensor, a_scale_shard: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _prepare_all_gather(_AG_GATHERED_OP, CollectiveGemmKind.ALL_GATHER_MATMUL_GATHERED, a_shard, a_scale_shard, b,
                        b_scale, alpha, out_dtype, group_name)
    policy.log_no_overlap_once(_AG_GATHERED_OP, group_name, NoOverlapReason.NOT_CUDA, a_shard.device.type)
    return all_gather_fp4_matmul_fallback(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name)


@fused_all_gather_fp4_matmul_gathered.register_fake
def _(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name):
    world = group_size_of(group_name)
    m = a_shard.shape[0] * world
    return (a_shard.new_empty((m, b.shape[0]), dtype=out_dtype),
            a_shard.new_empty((m, a_shard.shape[1])),
            a_scale_shard.new_empty((m, a_scale_shard.shape[1])))


@fused_all_gather_fp4_matmul_gathered.register_kernel("cuda")
def _(a_shard, a_scale_shard, b, b_scale, alpha, out_dtype, group_name):
    return call_on_device(a_shard.device, _all_gather_matmul_cuda, True, a_shard, a_scale_shard, b, b_scale,
                          alpha, out_dtype, group_name)


# ----------------------------------------------------------------------------------------------
# fused_fp4_matmul_reduce_scatter
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fp4fuse::fused_fp4_matmul_reduce_scatter", mutates_args=())
def fused_fp4_matmul_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype, group_name: str,
) -> torch.Tensor:
    _prepare_reduce_scatter(a, b, a_scale, b_scale, alpha, out_dtype, group_name)
    policy.log_no_overlap_once(_RS_OP, group_name, NoOverlapReason.NOT_CUDA, a.device.type)
    return fp4_matmul_reduce_scatter_fallback(a, b, a_scale, b_scale, alpha, out_dtype, group_name)


@fused_fp4_matmul_reduce_scatter.register_fake
def _(a, b, a_scale, b_scale, alpha, out_dtype, group_name):
    world = group_size_of(group_name)
    groups.check_rows_divisible(_RS_OP, "a", a.shape[0], world)
    return a.new_empty((a.shape[0] // world, b.shape[0]), dtype=out_dtype)


@fused_fp4_matmul_reduce_scatter.register_kernel("cuda")
def _(a, b, a_scale, b_scale, alpha, out_dtype, group_name):
    return call_on_device(a.device, _matmul_reduce_scatter_cuda, a, b, a_scale, b_scale, alpha, out_dtype,
                          group_name)


def _matmul_reduce_scatter_cuda(a, b, a_scale, b_scale, alpha, out_dtype, group_name):
    total = _prepare_reduce_scatter(a, b, a_scale, b_scale, alpha, out_dtype, group_name)
    ws = _overlap_workspace(_RS_OP, CollectiveGemmKind.MATMUL_REDUCE_SCATTER, group_name, total, b, a.device)
    if ws is None:
        return fp4_matmul_reduce_scatter_fallback(a, b, a_scale, b_scale, alpha, out_dtype, group_name)
    gemm = RowBlockGemm(b, b_scale, alpha, out_dtype, a.shape[0] // ws.world_size, total_rows=a.shape[0])
    return sum_in_rank_order(pipelines.reduce_scatter_partials(ws, a, a_scale, gemm))
