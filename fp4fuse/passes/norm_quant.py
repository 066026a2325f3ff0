"""``NormQuantFusionPass``: fp4fuse's ``rms_norm`` / ``fused_add_rms_norm`` feeding
``scaled_fp4_quant`` become the fused norm + NVFP4 quantize ops (static global scales)::

    q, s = scaled_fp4_quant(rms_norm(x, w, eps), gs)          ->  q, s = rms_norm_fp4_quant(x, w, eps, gs)
    out, r = fused_add_rms_norm(x, res, w, eps)                ->  q, s, r = fused_add_rms_norm_fp4_quant(
    q, s = scaled_fp4_quant(out, gs)                                             x, res, w, eps, gs)

Steps of one call: fold no-op view chains (so a quant reads the norm output itself), then the
rewrite of fp4fuse.patterns.norm_quant (find -> check, with the reason a match is left alone ->
rewrite), then record the quants of torch-form norms, which are not fused, with their reason.

Place in the pipeline: after sequence parallelism and AsyncTP, before kernel lowering. The SP
rewrite turns ``all_reduce -> norm -> quant`` into ``reduce_scatter -> norm -> quant ->
all_gather``, whose ``norm -> quant`` on the local shard this pass then fuses; lowering replaces
the fused op on CUDA by its Triton launch. The rewrite is exact (the fused ops compute the two ops'
bits), reads no process group, and changes nothing in a graph without fp4fuse norm ops.
"""
from __future__ import annotations

import torch.fx as fx

from fp4fuse.config import FusionConfig
from fp4fuse.ops import fp4_ops, norm_ops, validation
from fp4fuse.passes import cleanup
from fp4fuse.passes.base import GraphPass
from fp4fuse.passes.cleanup import fold_noop_views
from fp4fuse.patterns import base, norm_quant, sequence_parallel
from fp4fuse.patterns.norm_quant import NormQuantFusion, TorchNormQuants

__all__ = ["NormQuantFusionPass"]


class NormQuantFusionPass(GraphPass):
    """Fuse fp4fuse norms with the NVFP4 quantization of their output; see the module docstring."""

    name = "norm_quant"
    source_modules = (norm_quant, sequence_parallel, base, cleanup, norm_ops, fp4_ops, validation)

    def __init__(self, config: FusionConfig) -> None:
        super().__init__(config)
        self.fusion = NormQuantFusion(config)
        self.torch_norms = TorchNormQuants()

    def __call__(self, graph: fx.Graph) -> int:
        self.recorder.reset()
        fold_noop_views(graph)
        self.fusion.apply(graph, self.recorder)
        self.torch_norms.apply(graph, self.recorder)
        return self.finish()
