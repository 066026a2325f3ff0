"""All-reduce (sum) through symmetric memory at two ranks: PyTorch's one-shot and two-shot kernels
(``torch.ops.symm_mem``) on a group's fp4fuse workspace.

At decode and small-prefill sizes a TP model's all-reduces (one after each row-parallel linear) are
latency-bound, and NCCL's path costs more than the data, on the device and in host time per eager
call (``benchmarks/bench_all_reduce.py``; benchmarks/results/2026-11-26-symm-all-reduce-2xh200.md).

* one-shot (up to ``ONE_SHOT_MAX_BYTES``): one kernel copies the input into this rank's buffer,
  meets the peers at a signal-pad barrier, and every rank adds all ranks' buffers in rank order;
* two-shot (above, up to ``max_bytes()``): the input copied into the buffer, then each rank reduces
  its half of the rows from both buffers and the halves are gathered back.

Bits: at two ranks each element is ``x0 + x1`` rounded once to the dtype -- what NCCL computes,
whatever its algorithm, since a sum of two values does not depend on the order. Above two ranks the
kernels add in rank order and NCCL's ring in another, so the bits could differ: those groups are not
served here (:func:`unserved_reason`). The same result lands on every rank.

Which path a call takes depends only on what every rank agrees on (the group, the shape and dtype,
the workspace's capacity, which grows collectively, and ``FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES``, a
rank-uniform variable), so all ranks take the same one. The buffer is the group's
:class:`~fp4fuse.distributed.symm_mem.workspace.SymmWorkspace`, shared in stream order with the
collective GEMMs (each of their calls ends with every peer done reading; each all-reduce kernel
ends with a barrier after the reads). The kernels run on the workspace's side stream, joined to the
caller's (``SymmWorkspace.on_side_stream``), so calls made from several streams run one after
another in the order the host issued them, as NCCL's do, instead of racing on the buffer. During
CUDA-graph capture the buffer cannot grow: a call that does not fit runs NCCL (the same on every
rank: capacities are equal).
"""
from __future__ import annotations

import logging

import torch

from fp4fuse.config import env_int
from fp4fuse.distributed.groups import group_size_of
from fp4fuse.distributed.symm_mem import workspace

__all__ = ["ENV_MAX_BYTES", "ONE_SHOT_MAX_BYTES", "DEFAULT_MAX_BYTES", "max_bytes", "symm_all_reduce_sum",
           "unserved_reason"]

logger = logging.getLogger(__name__)

ENV_MAX_BYTES = "FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES"
#: Largest input (bytes) the one-shot kernel takes; above it two-shot (the crossover measured on
#: 2x H200 by benchmarks/bench_all_reduce.py).
ONE_SHOT_MAX_BYTES = 1 << 20
#: Largest input (bytes) served by default. Two-shot measured faster than NCCL on every size up to
#: 32 MiB, less so the larger; the cap bounds the workspace an all-reduce alone makes a group hold.
DEFAULT_MAX_BYTES = 16 << 20
#: The dtypes PyTorch's symmetric-memory reduction kernels take.
DTYPES = (torch.bfloat16, torch.float32)
_ALIGN = 16

_symm = torch.ops.symm_mem


def max_bytes() -> int:
    """Largest all-reduce (bytes) served through symmetric memory (``FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES``;
    0 turns it off)."""
    return env_int(ENV_MAX_BYTES, DEFAULT_MAX_BYTES)


def unserved_reason(world: int, dtype: torch.dtype) -> str | None:
    """Why a group of ``world`` ranks and tensors of ``dtype`` are never served here, or None."""
    if world != 2:
        return (f"the group has {world} ranks: above two the symmetric-memory kernels add the ranks' values in "
                "rank order and NCCL in its ring's order, so the bits could differ")
    if dtype not in DTYPES:
        return f"{dtype} all-reduces: PyTorch's symmetric-memory kernels reduce only bfloat16 and float32"
    return None


def _size_reason(x: torch.Tensor, nbytes: int) -> str | None:
    limit = max_bytes()
    if nbytes == 0:
        return "empty input"
    if nbytes > limit:
        return f"{nbytes} bytes > {ENV_MAX_BYTES}={limit}"
    if not x.is_contiguous() or nbytes % _ALIGN or (x.storage_offset() * x.element_size()) % _ALIGN \
            or x.data_ptr() % _ALIGN:
        return "the input is not a contiguous, 16-byte aligned run of a multiple of 16 bytes"
    return None


_logged: set[tuple[str, str]] = set()


def _log_once(group_name: str, reason: str) -> None:
    if (group_name, reason) not in _logged:
        _logged.add((group_name, reason))
        logger.info("fp4fuse.all_reduce_sum: group %r runs NCCL for this call: %s (logged once per group and reason)",
                    group_name, reason)


def symm_all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor | None:
    """The sum of ``x`` (CUDA) over ``group_name`` as a new contiguous tensor, or None where this
    module does not serve the call (the caller runs NCCL); the same answer on every rank."""
    nbytes = x.numel() * x.element_size()
    reason = unserved_reason(group_size_of(group_name), x.dtype) or _size_reason(x, nbytes)
    if reason is None:
        try:
            ws = workspace.get_workspace(group_name, x.device)
        except workspace.WorkspaceUnavailable as exc:
            reason = f"symmetric memory cannot serve the group: {exc}"
    if reason is None and torch.cuda.is_current_stream_capturing() and nbytes > ws.capacity:
        reason = (f"{nbytes} bytes do not fit the workspace ({ws.capacity} bytes), which cannot grow "
                  "during CUDA-graph capture (run the model once before capturing)")
    if reason is not None:
        _log_once(group_name, reason)
        return None
    ws.ensure_capacity(nbytes)
    buf = ws.local_tensor(x.shape, x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    with ws.on_side_stream():
        if nbytes <= ONE_SHOT_MAX_BYTES:
            _symm.one_shot_all_reduce_copy_out(buf, x, "sum", group_name, out)
        else:
            buf.copy_(x)
            _symm.two_shot_all_reduce_out(buf, "sum", group_name, out)
    return out
