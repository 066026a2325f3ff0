"""AsyncTP for plain (bf16/fp16/fp32) GEMMs: ``aten.mm`` + collectives -> ``torch.ops.symm_mem.*``.

Behind ``FusionConfig.enable_bf16_async_tp``. PyTorch's symmetric-memory ops have CUDA kernels
only (their Meta implementations are the unfused fallbacks), so on any other device every match
is skipped with that reason. Unlike PyTorch's micro-pipeline TP, the rewrite does not consult
``is_symm_mem_enabled_for_group``: that predicate only reflects the deprecated
``enable_symm_mem_for_group`` registration (pytorch/pytorch#193027), while symmetric-memory
rendezvous resolves a group by name. The rewrite thus depends on the graph alone, as a graph
served from the FX cache requires.

* ``AllGatherMm``: every ``aten.mm`` reading one all-gathered activation (dim 0) ->
  ``symm_mem.fused_all_gather_matmul(A_shard, [B0, B1, ...], 0, group, return_A=...)``;
  ``return_A`` is True only when the gathered activation has readers other than those mms.
  Pattern name ``all_gather_mm``; one rewrite per gathered activation.
* ``MmReduceScatter``: ``aten.mm -> reduce_scatter_tensor(sum|avg) -> wait_tensor`` ->
  ``symm_mem.fused_matmul_reduce_scatter``. Pattern name ``mm_reduce_scatter``. The reduction is
  torch's (in the output dtype), so numerics follow PyTorch's own micro-pipeline TP.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem.*)
import torch.fx as fx

from fp4fuse.patterns.base import (
    CollectiveKind, GraphRewrite, erase_if_unused, fake_value, find_collectives, insert_call, is_call,
    token_count_reason,
)
from fp4fuse.patterns.collectives import (
    GatheredTensor, ScatterSource, chain_nodes, decode_gathered, decode_scatter_source, external_users,
    group_size_reason, redirect_gathered,
)

__all__ = ["AllGatherMm", "AllGatherMmMatch", "MmReduceScatter", "MmReduceScatterMatch"]

aten = torch.ops.aten
MM = aten.mm.default


def _device_reason(node: fx.Node, op: str) -> str | None:
    device = fake_value(node).device
    if device.type != "cuda":
        return f"torch.ops.symm_mem.{op} has no kernel for device {device.type} (CUDA only)"
    return None


@dataclasses.dataclass(frozen=True)
class AllGatherMmMatch:
    """The ``aten.mm`` nodes (graph order) whose left operand is ``gathered``."""

    gathered: GatheredTensor
    mms: tuple[fx.Node, ...]

    @property
    def readers(self) -> list[fx.Node]:
        return external_users([self.gathered])

    @property
    def needs_gathered(self) -> bool:
        return any(user not in self.mms for user in self.readers)


class AllGatherMm(GraphRewrite[AllGatherMmMatch]):
    name = "all_gather_mm"

    def find(self, graph: fx.Graph) -> list[AllGatherMmMatch]:
        groups: dict[fx.Node, tuple[GatheredTensor, list[fx.Node]]] = {}
        for mm in graph.find_nodes(op="call_function", target=MM):
            gathered = decode_gathered(mm.args[0])
            if gathered is not None and mm.args[1] is not mm.args[0]:
                groups.setdefault(gathered.collective.node, (gathered, []))[1].append(mm)
        return [AllGatherMmMatch(g, tuple(mms)) for g, mms in groups.values()]

    def anchor(self, match: AllGatherMmMatch) -> fx.Node:
        return match.mms[0]

    def check(self, match: AllGatherMmMatch) -> str | None:
        g = match.gathered
        if g.gather_dim != 0:
            return f"the activation is all-gathered along dim {g.gather_dim} (split + cat); only dim 0 is fused"
        if g.collective.wait is None:
            return "the all-gather is not consumed by exactly one wait_tensor"
        if g.result is not g.collective.wait or g.collective.input is not g.shard:
            return "the all-gather is sent in another dtype (dtype views); symm_mem gathers the shard as is"
        assert g.collective.group_size is not None
        reason = (_device_reason(g.shard, "fused_all_gather_matmul")
                  or group_size_reason(g.collective.group_name, g.collective.group_size)
                  or token_count_reason(fake_value(g.shard).shape[0] * g.collective.group_size,
                                        g.collective.group_size, self.config.min_tokens or 0, require_divisible=False))
        if reason is not None:
            return reason
        first = match.readers[0]
        if any(isinstance(mm.args[1], fx.Node) and not mm.args[1] < first for mm in match.mms):
            return f"a weight operand is computed after another reader of the gathered activation ({first.name})"
        return None

    def rewrite(self, match: AllGatherMmMatch) -> str:
        """Before / after::

            A = wait(all_gather(A_shard, W, g));  C0 = mm(A, B0);  C1 = mm(A, B1)
        ->  A?, Cs = symm_mem.fused_all_gather_matmul(A_shard, [B0, B1], 0, g, return_A=<A read elsewhere>)
            C0 = Cs[0];  C1 = Cs[1]
        """
        g = match.gathered
        graph = match.mms[0].graph
        chain = chain_nodes([g])
        return_a = match.needs_gathered
        with graph.inserting_before(match.readers[0]):
            fused = insert_call(graph, torch.ops.symm_mem.fused_all_gather_matmul.default,
                                (g.shard, [mm.args[1] for mm in match.mms], 0, g.collective.group_name),
                                {"return_A": return_a})
            outs = insert_call(graph, operator.getitem, (fused, 1))
            for i, mm in enumerate(match.mms):
                mm.replace_all_uses_with(insert_call(graph, operator.getitem, (outs, i)))
            if return_a:
                redirect_gathered(g, insert_call(graph, operator.getitem, (fused, 0)), chain | set(match.mms))
        erase_if_unused([*match.mms, *chain])
        return "all_gather_mm"


@dataclasses.dataclass(frozen=True)
class MmReduceScatterMatch:
    mm: fx.Node
    scatter: ScatterSource


class MmReduceScatter(GraphRewrite[MmReduceScatterMatch]):
    name = "mm_reduce_scatter"

    def find(self, graph: fx.Graph) -> list[MmReduceScatterMatch]:
        found = []
        for rs in find_collectives(graph, CollectiveKind.REDUCE_SCATTER):
            scatter = decode_scatter_source(rs)
            if is_call(scatter.source, MM):
                found.append(MmReduceScatterMatch(scatter.source, scatter))
        return found

    def anchor(self, match: MmReduceScatterMatch) -> fx.Node:
        return match.scatter.collective.node

    def check(self, match: MmReduceScatterMatch) -> str | None:
        rs = match.scatter.collective
        if rs.wait is None:
            return "reduce_scatter_tensor is not consumed by exactly one wait_tensor"
        if match.scatter.scatter_dim != 0:
            return f"the product is reduce-scattered along dim {match.scatter.scatter_dim}; only dim 0 is fused"
        if rs.reduce_op not in ("sum", "avg"):
            return f"reduce op is {rs.reduce_op!r}; symm_mem supports sum and avg"
        if len(match.mm.users) != 1:
            return "the mm output has other readers besides the reduce-scatter"
        assert rs.group_size is not None
        return (_device_reason(match.mm, "fused_matmul_reduce_scatter")
                or group_size_reason(rs.group_name, rs.group_size)
                or token_count_reason(fake_value(match.mm).shape[0], rs.group_size, self.config.min_tokens or 0,
                                      require_divisible=True))

    def rewrite(self, match: MmReduceScatterMatch) -> str:
        """Before / after::

            P = mm(A, B);  Y = wait(reduce_scatter(P, op, W, g))
        ->  Y = symm_mem.fused_matmul_reduce_scatter(A, B, op, 0, g)
        """
        rs = match.scatter.collective
        assert rs.wait is not None
        graph = match.mm.graph
        with graph.inserting_before(rs.node):
            fused = insert_call(graph, torch.ops.symm_mem.fused_matmul_reduce_scatter.default,
                                (match.mm.args[0], match.mm.args[1], rs.reduce_op, 0, rs.group_name))
        rs.wait.replace_all_uses_with(fused)
        erase_if_unused([rs.wait, rs.node, match.mm])
        return "mm_reduce_scatter"
