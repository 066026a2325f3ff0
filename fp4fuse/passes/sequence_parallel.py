"""``SequenceParallelismPass``: ``all_reduce -> norm [-> NVFP4 quant]`` (RMSNorm, LayerNorm) becomes
``reduce_scatter -> norm [-> quant] -> all_gather``.

Steps of one call:

1. find the tensor-parallel groups: every group a ``sum`` all_reduce of the graph runs over;
2. norms (``fp4fuse/patterns/sequence_parallel.py``, Inductor pattern matcher): move views of
   all-reduced tensors before the all-reduce (``[tokens, h]`` rows viewed as ``[b, s, h]``),
   register the group's patterns for the norm families, dtypes and activation ranks present (once
   per pass instance; the forms with an epilogue, ``all_reduce(x) * number`` or ``+ row_bias``
   before the add / norm, only where one occurs; a row bias's views move before it first) and
   apply them. Each match is checked -- token count (the product of the
   leading dims) divisible by the group size and at least ``min_tokens`` (a symbolic count gets
   guards, see ``guard_token_count``; a norm output that quantizations with global scales of their
   own read, or a first or middle norm's output that neither a quantization nor a matmul reads,
   takes its own threshold from ``fp4fuse.patterns.thresholds.sp_thresholds``), per-row weight,
   unbroadcast residual, norm weight and
   residual the same on every rank (fp4fuse.patterns.rank_uniform) -- and skipped with a
   DEBUG-logged reason, or rewritten into a form that is correct on its own:
   ``reduce_scatter -> norm -> all_gather``. Under ``emulate_precision_casts`` the rewritten
   residual adds and epilogues get the eager-rounding mark AOT autograd gave the ops they replace
   (``round_residual_adds``). An all-reduce no pattern matched is recorded as skipped (key
   ``unmatched``) with what reads it;
3. no-op view chains the rewrites left (``view(all_gather(r), [b, s, h]).reshape(-1, h)``) fold;
4. quant before gather (fp4fuse.patterns.quant_before_gather): ``scaled_fp4_quant(all_gather(x), gs)``
   becomes ``all_gather(scaled_fp4_quant(x, gs))`` for a rank-uniform gs, a dynamic scale's amax
   becoming an all-reduce MAX over the group. Equal computations are merged first
   (``fp4fuse.passes.cse``, which the pipeline runs later anyway; it changes no value): the q, k and
   v projections of one norm output each quantize it with a dynamic scale computed the same way,
   and merged they share one amax all-reduce, one quantization and one gather of codes and scales
   instead of three (pattern key ``shared_quantization``: quantizations merged away). Quants with
   scales of their own (a checkpoint's static ``input_scale`` per projection) stay apart;
5. cleanup: fold ``shard_rows(all_gather(r))`` into ``r`` (the residual stream a rewritten layer
   hands to the next stays sharded) and erase the gathers nobody reads any more;
6. rank check: one ``fp4fuse::check_rank_uniform`` per group whose rewrites rely on graph inputs
   or compiled-in constants being the same on every rank (model state and a digest of the
   constants on the first call; with ``rank_check='always'`` also per-call inputs, every call),
   right after the graph's inputs. ``rank_checks`` lists them.

For a decoder of L layers whose norms all match (an input norm and a post-attention norm per
layer, a final norm whose output is not quantized): first = 1, middle = 2L - 1, last = 1, and
quant_before_gather = 2L (the inputs of qkv and gate_up) where each norm output is quantized once
(fused q/k/v and gate/up linears, or separate ones with dynamic scales, merged in step 4); separate
linears with static scales of their own quantize before the gather one by one (5L).

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
from fp4fuse.ops import fp4_ops, norm_ops, rank_check, sp_ops
from fp4fuse.passes import cleanup, cse
from fp4fuse.passes.base import GraphPass
from fp4fuse.passes.cleanup import fold_noop_views, read_sizes_from_graph_inputs
from fp4fuse.passes.cse import merge_common_subexpressions
from fp4fuse.patterns import base, collectives, quant_before_gather, rank_uniform, sequence_parallel, thresholds
from fp4fuse.patterns.base import CollectiveKind, erase_if_unused, fake_value, find_collectives, get_arg, is_call
from fp4fuse.patterns.quant_before_gather import QuantBeforeGather
from fp4fuse.patterns.rank_uniform import RankCheckSite, RankUniformity
from fp4fuse.patterns.thresholds import SPThresholds, sp_thresholds
from fp4fuse.patterns.sequence_parallel import (
    NORM_SETS, Epilogue, NormSet, SPGroup, epilogues_of_all_reduces, round_residual_adds, views_before_all_reduces,
    views_before_row_biases,
)

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
    """Sequence parallelism around RMSNorm and LayerNorm; see the module docstring."""

    name = "sequence_parallel"
    reads_process_groups = True
    source_modules = (sequence_parallel, quant_before_gather, rank_uniform, collectives, base, sp_ops, norm_ops,
                      fp4_ops, rank_check, cleanup, cse, thresholds)

    def __init__(self, config: FusionConfig) -> None:
        super().__init__(config)
        #: per (group, thresholds): the thresholds the group's patterns check
        self._patterns: dict[tuple[SPGroup, SPThresholds], pm.PatternMatcherPass] = {}
        self._registered: set[tuple[SPGroup, SPThresholds, str, torch.dtype, int, Epilogue]] = set()
        self.uniformity = RankUniformity(config.rank_check)
        self.quant_before_gather = QuantBeforeGather(config, self.uniformity)
        self.folded_residuals = 0
        self.rank_checks: list[RankCheckSite] = []

    def __call__(self, graph: fx.Graph) -> int:
        self.recorder.reset()
        self.folded_residuals = 0
        self.rank_checks = []
        if not self.config.enable_sequence_parallelism:
            return self.finish()
        self.uniformity.begin(graph)
        try:
            for group_name in self._reduced_groups(graph):
                group = self._resolve(group_name)
                if group is None:
                    continue
                views_before_row_biases(graph, group.name)
                views_before_all_reduces(graph, group.name)
                self._patterns_for(group, graph).apply(graph)
                round_residual_adds(graph, group.name)
                self._record_unmatched(graph, group)
            read_sizes_from_graph_inputs(graph)
            fold_noop_views(graph)
            self._share_quantizations(graph)
            self.quant_before_gather.apply(graph, self.recorder)
            self._cleanup(graph)
            self.rank_checks = self.uniformity.insert_checks(graph)
        finally:
            self.uniformity.end()
        total = self.finish()
        if total:
            logger.debug("sequence parallelism: %d rewrite(s) %s, %d residual gather(s) folded",
                         total, self.match_counts, self.folded_residuals)
        for site in self.rank_checks:
            logger.info("fp4fuse: the rewrites rely on %d graph input(s) being the same on every rank of group %r; "
                        "the compiled graph verifies them (model state on its first call%s): %s",
                        len(site.labels), site.group_name, ", per-call inputs on every call" if site.per_call else "",
                        ", ".join(site.labels))
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
        """The group's pattern pass, with the norm families, dtypes and activation ranks of
        ``graph`` registered (each once per pass instance)."""
        device = self._device_of(group, graph)
        thresholds = sp_thresholds(self.config.min_tokens, self.config.enable_async_tp, group.size, device)
        pm_pass = self._patterns.get((group, thresholds))
        if pm_pass is None:
            pm_pass = self._patterns[group, thresholds] = pm.PatternMatcherPass(pass_name=f"{self.name}[{group.name}]")
        epilogues = [Epilogue.NONE, *epilogues_of_all_reduces(graph, group.name)]
        for norm_set, dtype, ndim in self._blocks_needed(group, graph):
            for epilogue in epilogues:
                key = (group, thresholds, norm_set.name, dtype, ndim, epilogue)
                if key in self._registered:
                    continue
                for pattern in norm_set.build_patterns(group, self.uniformity, dtype, ndim, epilogue, thresholds):
                    pattern.register(pm_pass, self.recorder)
                self._registered.add(key)
        return pm_pass

    @staticmethod
    def _device_of(group: SPGroup, graph: fx.Graph) -> torch.device:
        """The device of the group's all-reduced activations in ``graph`` (CPU if none is known)."""
        for c in find_collectives(graph, CollectiveKind.ALL_REDUCE):
            val = fake_value(c.input)
            if c.group_name == group.name and isinstance(val, torch.Tensor):
                return val.device
        return torch.device("cpu")

    @staticmethod
    def _blocks_needed(group: SPGroup, graph: fx.Graph) -> list[tuple[NormSet, torch.dtype, int]]:
        """(norm set, example dtype, activation rank) for every norm set present in ``graph`` and
        every dtype and rank of the group's sum all-reduces."""
        kinds: list[tuple[torch.dtype, int]] = []
        for c in find_collectives(graph, CollectiveKind.ALL_REDUCE):
            val = fake_value(c.input)
            if c.group_name == group.name and c.reduce_op == "sum" and isinstance(val, torch.Tensor) and val.dim() >= 2:
                kind = (torch.float32 if val.dtype == torch.float32 else torch.bfloat16, val.dim())
                if kind not in kinds:
                    kinds.append(kind)
        return [(s, d, n) for s in NORM_SETS if s.present(graph) for d, n in kinds]

    def _record_unmatched(self, graph: fx.Graph, group: SPGroup) -> None:
        """Record a skip for every sum all-reduce of ``group`` that no pattern matched (a matched
        one that was left alone already has its reason)."""
        reported = {s.node for s in self.recorder.skips}
        for c in find_collectives(graph, CollectiveKind.ALL_REDUCE):
            if c.group_name != group.name or c.reduce_op != "sum" or c.node.name in reported:
                continue
            users = {u for w in c.node.users for u in w.users}
            readers = sorted({str(getattr(u, "target", u)) for u in users})
            leaves = any(u.op == "output" for u in users)
            self.recorder.skipped("unmatched", c.node, (
                f"no sequence-parallel norm pattern starts at this all_reduce (its result is read by "
                f"{', '.join(readers) or 'nothing'}); the patterns need all_reduce [* number | + row bias] -> "
                f"[residual add ->] norm, the norm written as one of "
                f"{', '.join(f.name for s in NORM_SETS for f in s.families)}"
                + ("; its result leaves this graph: where Dynamo broke the model's graph after this all_reduce "
                   "(TORCH_LOGS=graph_breaks names each break and its cause), the norm is in the next graph "
                   "and no rewrite can span the break" if leaves else "")))

    def _share_quantizations(self, graph: fx.Graph) -> None:
        """Step 4's merge of equal computations, where two or more quants read gathered activations:
        readers of one gathered activation that quantize it alike then share one quantization, so
        ``quant_before_gather`` moves one quant before one gather for all of them. Counted
        (``shared_quantization``): the quants of gathered activations merged away."""
        before = self._gathered_quants(graph)
        if before < 2:
            return
        merge_common_subexpressions(graph)
        shared = before - self._gathered_quants(graph)
        if shared:
            self.recorder.matched("shared_quantization", shared)

    def _gathered_quants(self, graph: fx.Graph) -> int:
        return sum(len(match.quants) for match in self.quant_before_gather.find(graph))

    def _cleanup(self, graph: fx.Graph) -> None:
        for pair in _GatherThenShard.find(graph):
            pair.fold()
            self.folded_residuals += 1
