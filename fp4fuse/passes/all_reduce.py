"""``SymmAllReducePass``: functional all-reduces (sum) of a two-rank group become
``fp4fuse::all_reduce_sum``, which sums through symmetric memory on CUDA::

    before:  ar = _c10d_functional.all_reduce(x, "sum", group);  y = wait_tensor(ar)
    after:   y = fp4fuse.all_reduce_sum(x, group)

At decode sizes a TP model's all-reduces (one per row-parallel linear, one for a vocab-parallel
embedding) are latency-bound and NCCL's launch path is long; PyTorch's one-shot and two-shot
symmetric-memory kernels finish sooner (fp4fuse.distributed.symm_mem.all_reduce, with the
measurements). The op keeps NCCL for the calls it does not serve -- too large
(``FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES``), misaligned, a group symmetric memory cannot serve, a
capture the workspace is too small for -- deciding per call on what every rank agrees on, so no
size threshold is needed for correctness and ``FusionConfig.min_tokens`` does not apply. One
size rule, for speed only: an all-reduce larger than that limit at the size the graph is compiled
for (its example size; every size, where that is statically known) stays the functional
all-reduce. The op would send it to NCCL, after copying its input into a new output, where the
graph's own all-reduce sums in place (Inductor reinplaces it; the copies' cost is in
benchmarks/results/). Both paths give NCCL's bits, so a graph that also serves smaller sizes stays
correct there, on NCCL. The limit is therefore a compile-time switch too (``FusionPass.uuid()``). On CPU the op is the functional
all-reduce itself (the rewrite is exercised, nothing changes).

Fires only where the result is bitwise the functional all-reduce's: reduce op ``sum``, a group of
two ranks (a sum of two values does not depend on the order; above two, NCCL's ring and the
symmetric-memory kernels add in different orders), bfloat16 or float32 (the dtypes those kernels
reduce), a contiguous input, and the all-reduce read by exactly one ``wait_tensor``. Elsewhere the
all-reduce is left to NCCL, with the reason. The op is blocking (its result is ready when it
returns), so it goes where the all-reduce was issued.

It runs after the collective fusions (sequence parallelism consumes the all-reduces it rewrites;
its rank-uniformity proofs read functional all-reduces) and before the common-subexpression pass,
for which the op, as every collective, is a barrier.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fp4fuse.distributed.groups import group_size_of
from fp4fuse.distributed.symm_mem import all_reduce as symm_all_reduce
from fp4fuse.ops import all_reduce_ops
from fp4fuse.passes.base import GraphPass
from fp4fuse.patterns import base
from fp4fuse.patterns.base import (
    CollectiveKind, FunctionalCollective, erase_if_unused, fake_value, find_collectives, insert_call,
)

__all__ = ["SymmAllReducePass"]

PATTERN = "symm_mem"
_ALL_REDUCE_SUM = torch.ops.fp4fuse.all_reduce_sum.default


def _reason(collective: FunctionalCollective) -> str | None:
    """Why ``collective`` (an all-reduce) stays a functional all-reduce, or None."""
    if collective.reduce_op != "sum":
        return f"reduce op {collective.reduce_op!r}: the symmetric-memory all-reduce only sums"
    if collective.wait is None:
        return "the all-reduce is not read by exactly one wait_tensor"
    x = fake_value(collective.input)
    if not isinstance(x, torch.Tensor):
        return "the input has no tensor metadata"
    try:
        world = group_size_of(collective.group_name)
    except (RuntimeError, ValueError, KeyError) as exc:
        return f"group {collective.group_name!r} does not resolve here: {exc}"
    reason = symm_all_reduce.unserved_reason(world, x.dtype)
    if reason is not None:
        return reason
    if not x.is_contiguous():
        return f"the input is not contiguous (strides {tuple(x.stride())})"
    limit = symm_all_reduce.max_bytes()
    nbytes = x.numel() * x.element_size()
    example = base.size_hint(nbytes)
    if statically_known_true(nbytes > limit) or (example is not None and example > limit):
        return (f"{example if example is not None else nbytes} bytes at the size this graph is compiled for > "
                f"{symm_all_reduce.ENV_MAX_BYTES}={limit}: NCCL either way, and the graph's own all-reduce sums in "
                "place where fp4fuse's op would copy its input")
    return None


class SymmAllReducePass(GraphPass):
    """Functional all-reduces (sum, two ranks) -> ``fp4fuse::all_reduce_sum`` (module docstring)."""

    name = "all_reduce"
    reads_process_groups = True
    source_modules = (all_reduce_ops, symm_all_reduce, base)

    def __call__(self, graph: fx.Graph) -> int:
        self.recorder.reset()
        for collective in find_collectives(graph, CollectiveKind.ALL_REDUCE):
            reason = _reason(collective)
            if reason is not None:
                self.recorder.skipped(PATTERN, collective.node, reason)
                continue
            with graph.inserting_before(collective.node):
                summed = insert_call(graph, _ALL_REDUCE_SUM, (collective.input, collective.group_name))
            collective.wait.replace_all_uses_with(summed)
            erase_if_unused([collective.wait, collective.node])
            self.recorder.matched(PATTERN)
        return self.finish()
