"""AsyncTP for NVFP4 GEMMs: fuse functional collectives with ``fp4fuse::mm_fp4``.

Two families, each find -> check (reason) -> rewrite:

* ``AllGatherMmFp4``: an ``mm_fp4`` whose activation codes and block scales are both
  all-gathered along dim 0 over one group -> ``fused_all_gather_fp4_matmul``; when the gathered
  tensors have other readers (another ``mm_fp4`` of the same gathered activation, a graph output)
  -> ``fused_all_gather_fp4_matmul_gathered``, whose gathered outputs feed those readers.
  Pattern names ``all_gather_mm_fp4`` and ``all_gather_mm_fp4_gathered``. One rewrite per
  gathered (codes, scales) pair; its first ``mm_fp4`` in graph order is the one fused.
* ``MmFp4ReduceScatter``: ``mm_fp4 -> reduce_scatter_tensor(sum) -> wait_tensor`` ->
  ``fused_fp4_matmul_reduce_scatter``. Pattern name ``mm_fp4_reduce_scatter``.

Numerics of the reduce-scatter rewrite. The fused op sums the per-rank ``out_dtype`` partials in
fp32 and rounds once; the unfused reduce-scatter adds them in ``out_dtype``. With 2 ranks (one
addition of two ``out_dtype`` values, exact in fp32) and for ``out_dtype=float32`` the two are
identical. With more ranks in bf16/fp16 the unfused sum rounds after each addition and the
fused one does not: the fused result is the more accurate one, different in the last bits.
Choice: the rewrite fires for every group size (the fused result is never less accurate), so
bit-equality with the unfused graph holds for 2-rank groups and fp32 outputs only.
"""
from __future__ import annotations

import collections
import dataclasses
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fp4fuse.distributed.symm_mem.policy import CollectiveGemmKind
from fp4fuse.patterns.base import (
    CollectiveKind, GraphRewrite, erase_if_unused, fake_value, find_collectives, get_arg, insert_call,
    is_call, token_count_reason,
)
from fp4fuse.patterns.thresholds import async_tp_min_rows
from fp4fuse.patterns.collectives import (
    GatheredTensor, ScatterSource, chain_nodes, decode_gathered, decode_scatter_source, external_users,
    group_size_reason, redirect_gathered,
)

__all__ = ["AllGatherMmFp4", "AllGatherMmFp4Match", "MmFp4Args", "MmFp4ReduceScatter", "MmFp4ReduceScatterMatch"]

fp4 = torch.ops.fp4fuse
MM_FP4 = fp4.mm_fp4.default


@dataclasses.dataclass(frozen=True)
class MmFp4Args:
    """The arguments of one ``mm_fp4`` call, by name."""

    a: fx.Node
    b: fx.Node
    a_scale: fx.Node
    b_scale: fx.Node
    alpha: fx.Node
    out_dtype: torch.dtype

    @classmethod
    def of(cls, node: fx.Node) -> MmFp4Args:
        return cls(*(get_arg(node, i, f.name) for i, f in enumerate(dataclasses.fields(cls))))

    def operands_before(self, node: fx.Node) -> bool:
        """``b``, ``b_scale`` and ``alpha`` are available at ``node``."""
        return all(not isinstance(x, fx.Node) or x < node for x in (self.b, self.b_scale, self.alpha))


def _rows(node: fx.Node) -> object:
    return fake_value(node).shape[0]


# --------------------------------------------------------------------------- all-gather + mm_fp4


@dataclasses.dataclass(frozen=True)
class AllGatherMmFp4Match:
    """``mm_fp4`` consumers of one all-gathered activation.

    Attributes:
        mms: the ``mm_fp4`` nodes reading this (codes, scales) pair, graph order; ``mms[0]`` is fused.
        data: the gather producing ``a`` (None if ``a`` is not gathered).
        scale: the gather producing ``a_scale`` (None if it is not gathered).
        shares_gather: ``data`` or ``scale`` also feeds an ``mm_fp4`` paired with another gather
            (matches would overlap; all of them are left alone).
    """

    mms: tuple[fx.Node, ...]
    data: GatheredTensor | None
    scale: GatheredTensor | None
    shares_gather: bool = False

    @property
    def gathers(self) -> list[GatheredTensor]:
        return [g for g in (self.data, self.scale) if g is not None]

    @property
    def readers(self) -> list[fx.Node]:
        """Every reader of the gathered rows outside the gather chains, graph order."""
        return external_users(self.gathers)

    @property
    def needs_gathered(self) -> bool:
        return any(user is not self.mms[0] for user in self.readers)


class AllGatherMmFp4(GraphRewrite[AllGatherMmFp4Match]):
    name = "all_gather_mm_fp4"

    def find(self, graph: fx.Graph) -> list[AllGatherMmFp4Match]:
        groups: dict[tuple[fx.Node, fx.Node], list[fx.Node]] = {}
        decoded: dict[tuple[fx.Node, fx.Node], tuple[GatheredTensor | None, GatheredTensor | None]] = {}
        for mm in graph.find_nodes(op="call_function", target=MM_FP4):
            args = MmFp4Args.of(mm)
            data, scale = decode_gathered(args.a), decode_gathered(args.a_scale)
            if data is None and scale is None:
                continue
            key = (data.collective.node if data else mm, scale.collective.node if scale else mm)
            groups.setdefault(key, []).append(mm)
            decoded[key] = (data, scale)
        uses = collections.Counter(node for key in groups for node in key)
        return [AllGatherMmFp4Match(tuple(mms), *decoded[key], shares_gather=any(uses[n] > 1 for n in key))
                for key, mms in groups.items()]

    def anchor(self, match: AllGatherMmFp4Match) -> fx.Node:
        return match.mms[0]

    def check(self, match: AllGatherMmFp4Match) -> str | None:
        data, scale = match.data, match.scale
        if data is None:
            return "a_scale is all-gathered but a is not"
        if scale is None:
            return "a is all-gathered but a_scale is not"
        if match.shares_gather:
            return "the gathered a or a_scale also feeds an mm_fp4 that pairs it with a different gather"
        for role, g in (("a", data), ("a_scale", scale)):
            if g.gather_dim != 0:
                return (f"{role} is all-gathered along dim {g.gather_dim} (split + cat); "
                        "the fused op gathers along dim 0")
            if g.collective.wait is None:
                return f"the all-gather of {role} is not consumed by exactly one wait_tensor"
            if not g.round_trips():
                return (f"{role} is gathered as {fake_value(g.shard).dtype} but read as "
                        f"{fake_value(g.result).dtype}")
        d, s = data.collective, scale.collective
        if (d.group_name, d.group_size) != (s.group_name, s.group_size):
            return (f"a and a_scale are gathered over different groups "
                    f"({d.group_name!r}/{d.group_size} vs {s.group_name!r}/{s.group_size})")
        if not statically_known_true(_rows(data.shard) == _rows(scale.shard)):
            return f"a has {_rows(data.shard)} rows per rank but a_scale has {_rows(scale.shard)}"
        reason = group_size_reason(d.group_name, d.group_size) or token_count_reason(
            _rows(data.shard) * d.group_size, d.group_size,
            async_tp_min_rows(self.config.min_tokens, CollectiveGemmKind.ALL_GATHER_MATMUL, d.group_size,
                              fake_value(data.shard).device), require_divisible=False)
        if reason is not None:
            return reason
        first = match.readers[0]
        if not MmFp4Args.of(match.mms[0]).operands_before(first):
            return ("b, b_scale or alpha of mm_fp4 is computed after another reader of the gathered "
                    f"activation ({first.name})")
        # the fused op goes before the first reader of either gathered tensor, and it reads both shards
        late = [role for role, g in (("a", data), ("a_scale", scale)) if not g.shard < first]
        if late:
            return (f"the shard of {' and '.join(late)} is computed after {first.name}, a reader of the other "
                    "gathered tensor, where the fused op must go (it may even be computed from that reader)")
        return None

    def rewrite(self, match: AllGatherMmFp4Match) -> str:
        """Before / after (``W`` ranks, codes gathered as uint8, scales as uint8 or float8)::

            qa = wait(all_gather(q, W, g));  sa = view(wait(all_gather(view(s, u8), W, g)), f8)
            y  = mm_fp4(qa, b, sa, sb, alpha, dt)
        ->  y  = fused_all_gather_fp4_matmul(q, s, b, sb, alpha, dt, g)

        and when ``qa`` / ``sa`` have other readers (e.g. ``y2 = mm_fp4(qa, b2, sa, ...)``)::

            y, qa, sa = fused_all_gather_fp4_matmul_gathered(q, s, b, sb, alpha, dt, g)
            y2 = mm_fp4(qa, b2, sa, ...)
        """
        mm = match.mms[0]
        chain = chain_nodes(match.gathers)
        gathered = match.needs_gathered
        with mm.graph.inserting_before(match.readers[0]):
            if gathered:
                _insert_fused_gathered(match, chain)
            else:
                _insert_fused(match)
        erase_if_unused([mm, *chain])
        return "all_gather_mm_fp4_gathered" if gathered else "all_gather_mm_fp4"


def _fused_args(match: AllGatherMmFp4Match) -> tuple[object, ...]:
    assert match.data is not None and match.scale is not None
    args = MmFp4Args.of(match.mms[0])
    return (match.data.shard, match.scale.shard, args.b, args.b_scale, args.alpha, args.out_dtype,
            match.data.collective.group_name)


def _insert_fused(match: AllGatherMmFp4Match) -> None:
    mm = match.mms[0]
    mm.replace_all_uses_with(insert_call(mm.graph, fp4.fused_all_gather_fp4_matmul.default, _fused_args(match)))


def _insert_fused_gathered(match: AllGatherMmFp4Match, chain: set[fx.Node]) -> None:
    assert match.data is not None and match.scale is not None
    mm = match.mms[0]
    fused = insert_call(mm.graph, fp4.fused_all_gather_fp4_matmul_gathered.default, _fused_args(match))
    out, a, a_scale = (insert_call(mm.graph, operator.getitem, (fused, i)) for i in range(3))
    mm.replace_all_uses_with(out)
    redirect_gathered(match.data, a, chain | {mm})
    redirect_gathered(match.scale, a_scale, chain | {mm})


# --------------------------------------------------------------------------- mm_fp4 + reduce-scatter


@dataclasses.dataclass(frozen=True)
class MmFp4ReduceScatterMatch:
    """An ``mm_fp4`` whose product is reduce-scattered."""

    mm: fx.Node
    scatter: ScatterSource


class MmFp4ReduceScatter(GraphRewrite[MmFp4ReduceScatterMatch]):
    name = "mm_fp4_reduce_scatter"

    def find(self, graph: fx.Graph) -> list[MmFp4ReduceScatterMatch]:
        found = []
        for rs in find_collectives(graph, CollectiveKind.REDUCE_SCATTER):
            scatter = decode_scatter_source(rs)
            if is_call(scatter.source, MM_FP4):
                found.append(MmFp4ReduceScatterMatch(scatter.source, scatter))
        return found

    def anchor(self, match: MmFp4ReduceScatterMatch) -> fx.Node:
        return match.scatter.collective.node

    def check(self, match: MmFp4ReduceScatterMatch) -> str | None:
        rs = match.scatter.collective
        if rs.wait is None:
            return "reduce_scatter_tensor is not consumed by exactly one wait_tensor"
        if match.scatter.scatter_dim != 0:
            return (f"mm_fp4 output is reduce-scattered along dim {match.scatter.scatter_dim} (split + cat); "
                    "the fused op scatters along dim 0")
        if rs.reduce_op != "sum":
            return f"reduce op is {rs.reduce_op!r}; the fused op sums"
        if len(match.mm.users) != 1:
            return ("mm_fp4 output has other readers besides the reduce-scatter "
                    "(the fused op does not return the full product)")
        assert rs.group_size is not None
        return group_size_reason(rs.group_name, rs.group_size) or token_count_reason(
            _rows(match.mm), rs.group_size,
            async_tp_min_rows(self.config.min_tokens, CollectiveGemmKind.MATMUL_REDUCE_SCATTER, rs.group_size,
                              fake_value(match.mm).device), require_divisible=True)

    def rewrite(self, match: MmFp4ReduceScatterMatch) -> str:
        """Before / after::

            p = mm_fp4(a, b, sa, sb, alpha, dt);  y = wait(reduce_scatter(p, "sum", W, g))
        ->  y = fused_fp4_matmul_reduce_scatter(a, b, sa, sb, alpha, dt, g)
        """
        rs = match.scatter.collective
        assert rs.wait is not None
        args = MmFp4Args.of(match.mm)
        graph = match.mm.graph
        with graph.inserting_before(rs.node):
            fused = insert_call(graph, fp4.fused_fp4_matmul_reduce_scatter.default,
                                (args.a, args.b, args.a_scale, args.b_scale, args.alpha, args.out_dtype,
                                 rs.group_name))
        rs.wait.replace_all_uses_with(fused)
        erase_if_unused([rs.wait, rs.node, match.mm])
        return "mm_fp4_reduce_scatter"
