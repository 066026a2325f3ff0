"""The shapes functional all-gathers and reduce-scatters take in a post-grad graph.

Written as Inductor pattern expressions (``CallFunction`` / ``KeywordArg``), group name and size
as wildcards, tried longest first (as in ``micro_pipeline_tp``)::

    all-gather along dim 0, optionally sent in another dtype (gloo has no float8 collectives):
        result = [view.dtype]( wait_tensor( all_gather_into_tensor( [view.dtype](shard), W, group )))
    all-gather along dim d > 0 (funcol.all_gather_tensor reassembles the rows):
        result = [view.dtype]( cat( [getitem(split(<dim-0 form>), i) for i], d ))
    reduce-scatter along dim d > 0 (funcol.reduce_scatter_tensor moves dim d to dim 0 first):
        reduce_scatter_tensor( cat( [getitem(split(source, n, d), i) for i] ), op, W, group )

Decoding is structural only; the fusion patterns check dtypes, dims and sizes and give reasons.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator

import torch
import torch.fx as fx
from torch._inductor import pattern_matcher as pm
from torch._inductor.pattern_matcher import MULTIPLE, CallFunction, Ignored, KeywordArg, ListOf

from fp4fuse.patterns.base import FunctionalCollective, decode_collective, fake_value, insert_call

__all__ = [
    "GatheredTensor", "ScatterSource", "chain_nodes", "decode_gathered", "decode_scatter_source",
    "external_users", "group_size_reason", "redirect_gathered",
]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_SPLITS = [aten.split.Tensor, aten.split_with_sizes.default]


@dataclasses.dataclass(frozen=True)
class GatheredTensor:
    """A tensor some consumer reads that is the all-gather of ``shard``.

    Attributes:
        collective: the all_gather_into_tensor call (``collective.wait`` is its wait_tensor).
        shard: the tensor gathered, before any wire-dtype view.
        result: the node the consumer reads.
        gather_dim: 0 for the plain form, d for the split + cat reassembly.
        nodes: every matched node after ``shard`` (views, collective, wait, split, cat), in graph order.
    """

    collective: FunctionalCollective
    shard: fx.Node
    result: fx.Node
    gather_dim: int
    nodes: tuple[fx.Node, ...]

    @property
    def after_wait(self) -> tuple[fx.Node, ...]:
        """The wait and the nodes that read the gathered rows (what other users may see)."""
        wait = self.collective.wait
        return tuple(n for n in self.nodes if wait is not None and (n is wait or n > wait))

    def round_trips(self) -> bool:
        """The consumer reads the shard's dtype (any wire-dtype view is undone)."""
        shard, result = fake_value(self.shard), fake_value(self.result)
        return (isinstance(shard, torch.Tensor) and isinstance(result, torch.Tensor)
                and shard.dtype == result.dtype)


def _dim0_gather(shard_view: bool) -> pm.PatternExpr:
    shard = (CallFunction(aten.view.dtype, KeywordArg("shard"), Ignored(), _users=MULTIPLE)
             if shard_view else KeywordArg("shard"))
    gather = CallFunction(c10d.all_gather_into_tensor.default, shard, KeywordArg("group_size"),
                          KeywordArg("group_name"))
    return CallFunction(c10d.wait_tensor.default, gather, _users=MULTIPLE)


def _gather_patterns() -> list[tuple[pm.PatternExpr, bool]]:
    """(pattern, reassembled along dim > 0), longest first."""
    found: list[tuple[int, pm.PatternExpr, bool]] = []
    for reassembled, result_view, shard_view in itertools.product((True, False), repeat=3):
        expr = _dim0_gather(shard_view)
        if reassembled:
            split = CallFunction(_SPLITS, expr, Ignored(), _users=MULTIPLE)
            expr = CallFunction(aten.cat.default, ListOf(CallFunction(operator.getitem, split, Ignored())),
                                KeywordArg("gather_dim"), _users=MULTIPLE)
        if result_view:
            expr = CallFunction(aten.view.dtype, expr, Ignored(), _users=MULTIPLE)
        found.append((2 * reassembled + result_view + shard_view, expr, reassembled))
    found.sort(key=lambda t: -t[0])
    return [(expr, reassembled) for _, expr, reassembled in found]


_GATHER_PATTERNS = _gather_patterns()

_SCATTER_REASSEMBLY = CallFunction(
    aten.cat.default,
    ListOf(CallFunction(operator.getitem,
                        CallFunction(aten.split.Tensor, KeywordArg("source"), Ignored(), KeywordArg("scatter_dim"),
                                     _users=MULTIPLE),
                        Ignored())),
)


def decode_gathered(node: object) -> GatheredTensor | None:
    """Decode ``node`` as an all-gathered tensor, or None if it is not one."""
    if not isinstance(node, fx.Node):
        return None
    for pattern, reassembled in _GATHER_PATTERNS:
        match = pattern.match(node)
        if not pm.is_match(match):
            continue
        gather_node = next(n for n in match.nodes if n.target is c10d.all_gather_into_tensor.default)
        collective = decode_collective(gather_node)
        shard = match.kwargs["shard"]
        if collective is None or not isinstance(shard, fx.Node):
            continue
        dim = match.kwargs["gather_dim"] if reassembled else 0
        return GatheredTensor(collective, shard, node, dim, tuple(sorted(set(match.nodes))))
    return None


@dataclasses.dataclass(frozen=True)
class ScatterSource:
    """What a reduce-scatter reduces: ``source`` scattered along ``scatter_dim``.

    ``nodes`` are the split/getitem/cat nodes between ``source`` and the collective (empty for
    dim 0).
    """

    collective: FunctionalCollective
    source: fx.Node
    scatter_dim: int
    nodes: tuple[fx.Node, ...]


def decode_scatter_source(collective: FunctionalCollective) -> ScatterSource:
    """Where ``collective`` (a reduce-scatter) takes its rows from."""
    match = _SCATTER_REASSEMBLY.match(collective.input)
    if pm.is_match(match) and isinstance(match.kwargs["source"], fx.Node):
        dim = match.kwargs["scatter_dim"]
        return ScatterSource(collective, match.kwargs["source"], dim, tuple(sorted(set(match.nodes))))
    return ScatterSource(collective, collective.input, 0, ())


def group_size_reason(group_name: str, group_size: int | None) -> str | None:
    """Why a collective's group cannot be used by a fused op at compile time, or None.

    The fused ops' fake implementations size their outputs from the process group registered
    under ``group_name``; it must exist in this process and agree with the size the collective
    states. (Only validated here; nothing read is baked into the graph.)
    """
    from fp4fuse.distributed.groups import group_size_of

    try:
        actual = group_size_of(group_name)
    except (RuntimeError, ValueError, KeyError) as err:
        return f"process group {group_name!r} is not registered in this process ({err})"
    if group_size is not None and actual != group_size:
        return f"the collective states group size {group_size} but group {group_name!r} has {actual} ranks"
    return None


def chain_nodes(gathers: list[GatheredTensor]) -> set[fx.Node]:
    return {n for g in gathers for n in g.nodes}


def external_users(gathers: list[GatheredTensor]) -> list[fx.Node]:
    """Nodes outside the gathers' own chains that read gathered rows, in graph order."""
    chain = chain_nodes(gathers)
    users = {u for g in gathers for n in g.after_wait for u in n.users if u not in chain}
    return sorted(users)


def redirect_gathered(gathered: GatheredTensor, replacement: fx.Node, chain: set[fx.Node]) -> None:
    """Point every reader outside ``chain`` of ``gathered``'s rows at ``replacement`` (the gathered
    tensor in the shard's dtype), adding a ``view.dtype`` for readers of another dtype. Call it
    at an insertion point before all those readers."""
    graph = replacement.graph
    for node in gathered.after_wait:
        outside = [u for u in node.users if u not in chain]
        if not outside:
            continue
        new = replacement
        dtype = fake_value(node).dtype
        if fake_value(replacement).dtype != dtype:
            new = insert_call(graph, aten.view.dtype, (replacement, dtype))
        node.replace_all_uses_with(new, delete_user_cb=lambda user: user not in chain)
