"""``AsyncTPPass``: fuse TP collectives with the GEMMs that produce or consume them.

Order within the pass (each family finds its matches after the previous one rewrote, so no
match is stale):

1. ``async_tp.all_gather_mm_fp4`` / ``..._gathered``: all-gather(codes) + all-gather(scales) +
   ``mm_fp4`` -> ``fp4fuse::fused_all_gather_fp4_matmul[_gathered]``.
2. ``async_tp.mm_fp4_reduce_scatter``: ``mm_fp4`` + reduce-scatter -> ``fp4fuse::fused_fp4_matmul_reduce_scatter``.
3. with ``enable_bf16_async_tp``: ``async_tp.all_gather_mm`` and ``async_tp.mm_reduce_scatter``
   (``aten.mm`` -> ``torch.ops.symm_mem.*``, CUDA only).

All-gathers go first, as in PyTorch's micro-pipeline TP: an ``mm_fp4`` that both reads a
gathered activation and is reduce-scattered gets the all-gather fusion.

Nothing outside the input graph is baked in: group names and sizes come from the collectives
themselves, so the pass is rank-independent (``reads_process_groups`` stays False). The
process groups are consulted only to validate that a group exists with the stated size.
"""
from __future__ import annotations

import torch.fx as fx

from fp4fuse.config import FusionConfig
from fp4fuse.ops import collective_ops
from fp4fuse.passes.base import GraphPass
from fp4fuse.patterns import async_tp_bf16, async_tp_fp4, base, collectives
from fp4fuse.patterns.base import GraphRewrite

__all__ = ["AsyncTPPass"]


class AsyncTPPass(GraphPass):
    name = "async_tp"
    source_modules = (async_tp_fp4, async_tp_bf16, collectives, base, collective_ops)

    def __init__(self, config: FusionConfig) -> None:
        super().__init__(config)
        self.families: list[GraphRewrite] = [
            async_tp_fp4.AllGatherMmFp4(config),
            async_tp_fp4.MmFp4ReduceScatter(config),
        ]
        if config.enable_bf16_async_tp:
            self.families += [async_tp_bf16.AllGatherMm(config), async_tp_bf16.MmReduceScatter(config)]

    def __call__(self, graph: fx.Graph) -> int:
        self.recorder.reset()
        for family in self.families:
            family.apply(graph, self.recorder)
        return self.finish()
