"""Quantize before the all-gather: the NVFP4 half of sequence parallelism.

After the SP norm rewrites (fp4fuse.patterns.sequence_parallel) a norm output reaches its GEMM as
``scaled_fp4_quant(all_gather(out_r), gs)``. Quantization is row-wise (16-element blocks along K)
with one global scale, so when ``gs`` is the same on every rank it commutes with the gather::

    before:  g = all_gather(out_r)                      after:  q_r, s_r = scaled_fp4_quant(out_r, gs)
             q, s = scaled_fp4_quant(g, gs)                     q = all_gather(q_r)
                                                                s = all_gather(s_r.view(uint8)).view(e4m3)

4.5 bits per element go over the wire instead of 16. ``gs`` must be provably the same on every
rank of the gather's group (fp4fuse.patterns.rank_uniform): built from constants, from
all-reduces / all-gathers over a group that covers it, and from model state -- a checkpoint's
static ``input_scale`` held as a buffer -- which the compiled graph verifies across the group on
its first call. A gathered activation read by several quants (q, k and v projections of one norm
output, each with its own scale) has each quant moved before its own gather; quants that compute
the same value (dynamic scales computed alike) are merged into one by the sequence-parallel pass
before this rewrite runs (fp4fuse.passes.sequence_parallel, step 4), so they share one gather.

A dynamic scale reads the amax of the gathered tensor (``NVFP4Quantizer``:
``global_scale_from_amax(abs_amax(g))``, the row maxima first; a single ``g.abs().amax()`` is
recognized too). That amax is replaced, exactly, by the all-reduce MAX of the shards' amaxes, so
``g`` itself is no longer needed::

    before:  a = amax(abs(g))                           after:  m = amax(abs(out_r))
                                                                r = all_reduce_max([nan_to_num(m, nan=inf), isnan(m)])
                                                                a = r[1] > 0 ? nan : r[0]

(one two-element all-reduce; the NaN flag keeps NaN propagation exact whatever the backend's MAX
does with NaN). Pattern keys, one count per quant moved: ``quant_before_gather`` (static scale)
and ``quant_before_gather.dynamic_scale`` (amax replaced too). A gathered tensor read by anything
else stays as it is, and so do the quants after it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator

import torch
import torch.fx as fx

from fp4fuse.config import FusionConfig
from fp4fuse.distributed import groups
from fp4fuse.nvfp4.quantizer import abs_amax
from fp4fuse.patterns.base import (
    GraphRewrite, QuantCall, erase_if_unused, fake_value, get_arg, insert_call, insert_traced, is_call,
    token_count_reason,
)
from fp4fuse.patterns.thresholds import sp_min_tokens
from fp4fuse.patterns.collectives import GatheredTensor, decode_gathered, external_users
from fp4fuse.patterns.rank_uniform import RankUniformity

__all__ = ["AmaxOfGathered", "QuantBeforeGather", "QuantsOfGatheredMatch"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
QUANT = torch.ops.fp4fuse.scaled_fp4_quant.default


def _amax_dims(node: fx.Node) -> list[int] | None:
    """The dims (non-negative, sorted; every dim for ``[]``) an ``aten.amax`` without keepdim
    reduces; None for anything else."""
    if not is_call(node, aten.amax):
        return None
    dims = get_arg(node, 1, "dim", [])
    keepdim = get_arg(node, 2, "keepdim", False)
    ndim = fake_value(node.args[0]).dim()
    return None if keepdim else sorted({d % ndim for d in dims} if dims else range(ndim))


@dataclasses.dataclass(frozen=True)
class AmaxOfGathered:
    """``max |g|`` over all of ``g``'s elements: ``amax(abs(g))``, or ``amax(amax(abs(g), -1))``
    (``fp4fuse.nvfp4.quantizer.abs_amax``: row maxima first; ``rows`` the inner node). ``abs_node``
    may have other readers."""

    amax: fx.Node
    abs_node: fx.Node
    rows: fx.Node | None = None

    @classmethod
    def decode(cls, reader: fx.Node, gathered: fx.Node) -> AmaxOfGathered | None:
        """The amax at ``reader``, a reader of ``gathered`` (the gathered tensor in its shard's
        dtype), or None. An ``abs`` of another node of the gather's chain (the rows as they travel,
        e.g. a ``uint8`` view) is none: its maximum is not ``max |g|``."""
        if not is_call(reader, aten.abs) or reader.args[0] is not gathered or len(reader.users) != 1:
            return None
        (amax,) = reader.users
        dims = _amax_dims(amax)
        ndim = fake_value(reader).dim()
        if dims == list(range(ndim)):
            return cls(amax, reader)
        if dims != [ndim - 1] or len(amax.users) != 1:
            return None
        (outer,) = amax.users
        if _amax_dims(outer) != list(range(ndim - 1)):
            return None
        return cls(outer, reader, rows=amax)


@dataclasses.dataclass(frozen=True)
class QuantsOfGatheredMatch:
    """The NVFP4 quants of one all-gathered activation ``g``.

    Attributes:
        gathered: how ``g`` was gathered (shard, collective, chain of nodes).
        quants: every ``scaled_fp4_quant`` reading ``g``, graph order.
        amaxes: full ``amax(abs(g))`` readers of ``g`` (dynamic scales), replaced exactly.
        others: any other readers of ``g`` (they would keep the bf16 gather alive).
    """

    gathered: GatheredTensor
    quants: tuple[QuantCall, ...]
    amaxes: tuple[AmaxOfGathered, ...]
    others: tuple[fx.Node, ...]


class QuantBeforeGather(GraphRewrite[QuantsOfGatheredMatch]):
    """Move NVFP4 quantization of an all-gathered activation before the gather (module docstring)."""

    name = "quant_before_gather"

    def __init__(self, config: FusionConfig, uniformity: RankUniformity) -> None:
        super().__init__(config)
        self.uniformity = uniformity

    def find(self, graph: fx.Graph) -> list[QuantsOfGatheredMatch]:
        by_gather: dict[fx.Node, tuple[GatheredTensor, list[fx.Node]]] = {}
        for quant in graph.find_nodes(op="call_function", target=QUANT):
            gathered = decode_gathered(quant.args[0])
            if gathered is not None:
                by_gather.setdefault(gathered.collective.node, (gathered, []))[1].append(quant)
        found = []
        for gathered, quant_nodes in by_gather.values():
            readers = [u for u in external_users([gathered]) if u not in quant_nodes]
            amaxes = tuple(a for r in readers if (a := AmaxOfGathered.decode(r, gathered.result)) is not None)
            covered = {a.abs_node for a in amaxes}
            quants = tuple(QuantCall.of(q) for q in quant_nodes)
            found.append(QuantsOfGatheredMatch(gathered, quants, amaxes, tuple(u for u in readers if u not in covered)))
        return found

    def anchor(self, match: QuantsOfGatheredMatch) -> fx.Node:
        return match.quants[0].quant

    def check(self, match: QuantsOfGatheredMatch) -> str | None:
        g = match.gathered
        if g.gather_dim != 0:
            return f"the activation is gathered along dim {g.gather_dim}, not 0 (rows)"
        if not g.round_trips():
            return "the gathered activation is sent in another dtype than it is quantized in"
        if match.others:
            return (f"the gathered activation is also read by {[n.name for n in match.others]}: "
                    "quantizing before the gather would need the bf16 gather as well")
        if any(not is_call(u, operator.getitem) for q in match.quants for u in q.outputs):
            return "a quant's outputs are read other than through getitem"
        shard = fake_value(g.shard)
        if shard.dim() != 2 or not shard.is_contiguous():
            return f"the gathered shard is not a contiguous 2-D tensor (shape {list(shard.shape)})"
        size = g.collective.group_size
        reason = token_count_reason(shard.shape[0] * size, size, sp_min_tokens(self.config.min_tokens, shard.device),
                                    require_divisible=False)
        if reason is not None:
            return reason
        scales = [("global scale", q.global_scale) for q in match.quants]
        reason, relies_on = self.uniformity.prove(g.collective.group_name, scales)
        if reason is not None:
            return reason
        self.uniformity.rely_on(g.collective.group_name, relies_on)
        return None

    def rewrite(self, match: QuantsOfGatheredMatch) -> str:
        graph = match.gathered.shard.graph
        g = match.gathered
        group_name, size = g.collective.group_name, g.collective.group_size
        for amax in match.amaxes:
            with graph.inserting_before(amax.amax):
                replacement = _insert_group_amax(graph, g.shard, group_name)
            amax.amax.replace_all_uses_with(replacement)
            erase_if_unused([amax.amax, *([amax.rows] if amax.rows is not None else []), amax.abs_node])
        for q in match.quants:
            with graph.inserting_before(q.quant):
                local = insert_call(graph, QUANT, (g.shard, q.global_scale))
                q_r = insert_call(graph, operator.getitem, (local, 0))
                s_r = insert_call(graph, operator.getitem, (local, 1))
                gathered = (_insert_all_gather(graph, q_r, size, group_name),
                            _insert_all_gather(graph, s_r, size, group_name))
            for out in q.outputs:
                out.replace_all_uses_with(gathered[out.args[1]])
            erase_if_unused([*q.outputs, q.quant])
        erase_if_unused(g.nodes)
        return self.name if not match.amaxes else "quant_before_gather.dynamic_scale"

    def count(self, match: QuantsOfGatheredMatch) -> int:
        return len(match.quants)


def _insert_all_gather(graph: fx.Graph, shard: fx.Node, size: int, group_name: str) -> fx.Node:
    """:func:`fp4fuse.distributed.groups.all_gather_rows` of ``shard``, inserted at the insertion point."""
    gather = functools.partial(groups.all_gather_rows, group_name=group_name, group_size=size)
    (out,) = insert_traced(graph, gather, [shard])
    return out


def _group_amax(shard: torch.Tensor, group_name: str) -> torch.Tensor:
    """``amax(abs(all_gather(shard)))`` without the gather (module docstring), in shard's dtype."""
    local = abs_amax(shard).float()
    nan = torch.isnan(local)
    packed = torch.stack([torch.where(nan, math.inf, local), nan.float()])
    reduced = c10d.wait_tensor(c10d.all_reduce(packed, "max", group_name))
    return torch.where(reduced[1] > 0, math.nan, reduced[0]).to(shard.dtype)


def _insert_group_amax(graph: fx.Graph, shard: fx.Node, group_name: str) -> fx.Node:
    """:func:`_group_amax` of ``shard``, inserted at the insertion point as decomposed aten ops."""
    (out,) = insert_traced(graph, functools.partial(_group_amax, group_name=group_name), [shard])
    return out
