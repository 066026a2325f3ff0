"""``SequenceParallelismPass``: ``all_reduce -> rms_norm [-> NVFP4 quant]`` becomes
``reduce_scatter -> rms_norm [-> quant] -> all_gather``.

Steps of one call:

1. find the tensor-parallel groups: every group a ``sum`` all_reduce of the graph runs over;
2. norms (``fp4fuse/patterns/sequence_parallel.py``, Inductor pattern matcher): register the
   group's patterns for the norm families and dtypes present (once per pass instance) and apply
   them. Each match is checked -- token count divisible by the group size and at least
   ``min_tokens`` (a symbolic count gets guards, see ``guard_token_count``), per-row weight,
   unbroadcast residual -- and skipped with a DEBUG-logged reason, or rewritten into a form that
   is correct on its own: ``reduce_scatter -> norm -> all_gather``;
3. quant before gather (fp4fuse.patterns.quant_before_gather): ``scaled_fp4_quant(all_gather(x), gs)``
   becomes ``all_gather(scaled_fp4_quant(x, gs))`` for a rank-uniform gs, a dynamic scale's amax
   becoming an all-reduce MAX over the group;
4. cleanup: fold ``shard_rows(all_gather(r))`` into ``r`` (the residual stream a rewritten layer
   hands to the next stays sharded) and erase the gathers nobody reads any more.

For a decoder of L layers whose norms all match (an input norm and a post-attention norm per
layer, a final norm whose output is not quantized): first = 1, middle = 2L - 1, last = 1, and
quant_before_gather = 2L (the inputs of qkv and gate_up).

The rewritten graph holds the group size (a reduce_scatter needs it), which an input graph of
plain all_reduces does not state; ``reads_process_groups`` puts the process-group layout into
``FusionPass.uuid()`` so that no other layout is served this graph from the FX cache. The rank
is never baked in: ``fp4fuse::shard_rows`` reads it when it runs.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor import pattern_matcher as pm

from fp4fuse.config import FusionConfig
from fp4fuse.distributed.groups import resolve_group
from fp4fuse.ops import fp4_ops, norm_ops, sp_ops
from fp4fuse.passes.base import GraphPass
from fp4fuse.patterns import base, collectives, quant_before_gather, sequence_parallel
from fp4fuse.patterns.base import CollectiveKind, erase_if_unused, fake_value, find_collectives, get_arg, is_call
from fp4fuse.patterns.quant_before_gather import QuantBeforeGather
from fp4fuse.patterns.sequence_parallel import NORM_SETS, NormSet, SPGroup

__all__ = ["SequenceParallelismPass"]

logger = logging.getLogger(__name__)

c10d = torch.ops._c10d_functional
_SHARD_ROWS = torch.ops.fp4fuse.shard_rows.default


@dataclasses.dataclass(frozen=True)
class _GatherThenShard:
    """``shard_rows(wait(all_gather(source, W, g)), g)``: this rank's rows of a gather are ``source``."""

    shard: fx.Node
    wait: fx.Node
    gather: fx.Node
    source: fx.Node

    @classmethod
    def find(cls, graph: fx.Graph) -> list[_GatherThenShard]:
        found = []
        for shard in graph.find_nodes(op="call_function", target=_SHARD_ROWS):
            wait = get_arg(shard, 0, "x")
            if not is_call(wait, c10d.wait_tensor):
                continue
            gather = get_arg(wait, 0, "input")
            if not is_call(gather, c10d.all_gather_into_tensor):
                continue
            if get_arg(gather, 2, "group_name") != get_arg(shard, 1, "group_name"):
                continue
            found.append(cls(shard, wait, gather, get_arg(gather, 0, "input")))
        return found

    def fold(self) -> None:
        """``r = ag(r_rank); t = shard_rows(r)`` -> ``t = r_rank``; the gather goes if nobody else reads it."""
        self.shard.replace_all_uses_with(self.source)
        self.shard.graph.erase_node(self.shard)
        erase_if_unused([self.wait, self.gather])


class SequenceParallelismPass(GraphPass):
    """Sequence parallelism around RMSNorm; see the module docstring."""

    name = "sequence_parallel"
    reads_process_groups = True
    source_modules = (sequence_parallel, quant_before_gather, collectives, base, sp_ops, norm_ops, fp4_ops)

    def __init__(self, config: FusionConfig) -> None:
        super().__init__(config)
        self._patterns: dict[SPGroup, pm.PatternMatcherPass] = {}
        self._registered: set[tuple[SPGroup, str, torch.dtype]] = set()
        self.quant_before_gather = QuantBeforeGather(config)
        self.folded_residuals = 0

    def __call__(self, graph: fx.Graph) -> int:
        self.recorder.reset()
        self.folded_residuals = 0
        if not self.config.enable_sequence_parallelism:
            return self.finish()
        for group_name in self._reduced_groups(graph):
            group = self._resolve(group_name)
            if group is None:
                continue
            self._patterns_for(group, graph).apply(graph)
        self.quant_before_gather.apply(graph, self.recorder)
        self._cleanup(graph)
        total = self.finish()
        if total:
            logger.debug("sequence parallelism: %d rewrite(s) %s, %d residual gather(s) folded",
                         total, self.match_counts, self.folded_residuals)
        return total

    # ------------------------------------------------------------------ steps

    @staticmethod
    def _reduced_groups(graph: fx.Graph) -> list[str]:
        names: list[str] = []
        for c in find_collectives(graph, CollectiveKind.ALL_REDUCE):
            if c.reduce_op == "sum" and c.group_name not in names:
                names.append(c.group_name)
        return names

    def _resolve(self, group_name: str) -> SPGroup | None:
        """The group's size, read from the process group registered under ``group_name``."""
        if not (dist.is_available() and dist.is_initialized()):
            self.recorder.skipped("group", None, f"group {group_name!r}: torch.distributed is not initialized")
            return None
        try:
            pg = resolve_group(group_name)
        except (ValueError, RuntimeError, KeyError) as exc:
            self.recorder.skipped("group", None, f"group {group_name!r} does not resolve in this process: {exc}")
            return None
        size = dist.get_world_size(pg)
        if size < 2:
            self.recorder.skipped("group", None, f"group {group_name!r} has {size} rank: nothing to shard")
            return None
        return SPGroup(group_name, size)

    def _patterns_for(self, group: SPGroup, graph: fx.Graph) -> pm.PatternMatcherPass:
        """The group's pattern pass, with the norm families and dtypes of ``graph`` registered
        (each family x dtype once per pass instance)."""
        pm_pass = self._patterns.get(group)
        if pm_pass is None:
            pm_pass = self._patterns[group] = pm.PatternMatcherPass(pass_name=f"{self.name}[{group.name}]")
        for norm_set, dtype in self._blocks_needed(group, graph):
            if (group, norm_set.name, dtype) in self._registered:
                continue
            for pattern in norm_set.build_patterns(group, dtype, self.config.min_tokens):
                pattern.register(pm_pass, self.recorder)
            self._registered.add((group, norm_set.name, dtype))
        return pm_pass

    @staticmethod
    def _blocks_needed(group: SPGroup, graph: fx.Graph) -> list[tuple[NormSet, torch.dtype]]:
        dtypes: list[torch.dtype] = []
        for c in find_collectives(graph, CollectiveKind.ALL_REDUCE):
            val = fake_value(c.input)
            if c.group_name == group.name and c.reduce_op == "sum" and isinstance(val, torch.Tensor):
                dtype = torch.float32 if val.dtype == torch.float32 else torch.bfloat16
                if dtype not in dtypes:
                    dtypes.append(dtype)
        return [(s, d) for s in NORM_SETS if s.present(graph) for d in dtypes]

    def _cleanup(self, graph: fx.Graph) -> None:
        for pair in _GatherThenShard.find(graph):
            pair.fold()
            self.folded_residuals += 1
