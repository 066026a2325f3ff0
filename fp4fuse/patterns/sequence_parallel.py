"""Sequence-parallel (SP) rewrites of ``all_reduce -> norm`` (RMSNorm, LayerNorm), for every way a model
writes the norm.

Each pattern is one ``Position`` of one norm family (which supplies ``norm`` and ``add_norm``),
built for one tensor-parallel group (name and size are constructor arguments; nothing here
reads global distributed state). Norm families (:data:`NORM_SETS`):

* ``fp4fuse``: fp4fuse's own ops, ``fp4fuse::rms_norm`` / ``fp4fuse::fused_add_rms_norm``;
* ``torch_functional``: ``torch.nn.functional.rms_norm(x, (hidden,), weight, eps)``;
* ``torch_manual``: ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight`` (in x's dtype);
* ``torch_fp32``: the Hugging Face Llama form, statistics in float32:
  ``weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)``, ``xf = x.float()``;
* ``torch_offset_fp32``: the Hugging Face Gemma form, the weight stored as an offset from 1 and one
  rounding at the end: ``(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 +
  weight.float())).to(x.dtype)``. In fp32 it is the manual form with ``1 + weight`` as the weight,
  which is registered first and matches it there;
* ``torch_layer_norm``: ``torch.nn.functional.layer_norm(x, (hidden,), weight, bias, eps)``
  (``nn.LayerNorm``: Starcoder2); its bias is proven the same on every rank like the weight.

The torch forms add the residual with a plain ``+``, written either ``x + residual`` or
``residual + x`` (an FX pattern is not commutative, so both orders are registered). Every form also
comes with an :class:`Epilogue` on the all-reduced tensor before the add or the norm, which the
rewrite applies to the shard: times a number (Granite's ``embedding_multiplier`` /
``residual_multiplier``, MiniCPM's depth scale) or plus a ``[hidden]`` row (a row-parallel linear's
bias, added after its all-reduce: :func:`views_before_row_biases` first moves the view back to
``[b, s, h]`` before that add). Before /
after, for a middle layer (``x`` is ``[..., hidden]``; its rows, the product of the leading
dimensions, are the tokens that are split)::

    y = all_reduce(x)                          y_r = reduce_scatter(rows(x))        # rows of rank r
    out, res_out = add_norm(y, res, w)         out_r, res_r = add_norm(y_r, shard_rows(rows(res)), w)
                                               out = all_gather(out_r).view(x.shape)
                                               res_out = all_gather(res_r).view(x.shape)

``rows(t)`` is ``t.reshape(-1, hidden)`` (nothing for a 2-D ``t``). A row-parallel linear that
all-reduces its 2-D rows and then restores ``[batch, seq, hidden]`` (Hugging Face models) writes
``all_reduce(p).view(b, s, h)``; :func:`views_before_all_reduces` first turns that into
``all_reduce(p.view(b, s, h))`` (exact: a sum over ranks commutes with a view), so the patterns
see the all-reduce feed the residual add directly.

Every operand the shards are computed with must be the same on every rank -- the norm weight and
the residual -- or the gathered rows mix different values: ``check`` proves it
(fp4fuse.patterns.rank_uniform), relying on model state that the compiled graph verifies at run
time, and skips the match with the reason otherwise.

Numerics. The rewrite computes every row with the same ops in the same order, but Inductor does
not promise where it rounds fused bf16/fp16 intermediates: with ``emulate_precision_casts=False``
(its default) a low-precision pointwise result that is fused into its consumer stays in fp32,
one that is materialized is rounded. Whether ``x + residual`` is materialized before the norm
reads it depends on its other readers (Inductor realizes a sum that is also a graph output, and
inlines one read by an all-gather), and the rewrite changes those readers, so bf16/fp16 torch-form
norms may round differently from the graph without the pass (measured in
tests/e2e/test_norm_numerics_e2e.py: at most 2 ulp, in about a fifth of the outputs). With
``torch._inductor.config.emulate_precision_casts = True`` both graphs round every eager-level op as
eager does, and the rewrite is bitwise: AOT autograd marks eager-level low-precision ops
(``low_precision_pointwise_barrier``) for Inductor, the nodes a pattern replacement inserts lose
that mark, and :func:`round_residual_adds` puts it back on the ops of the replacements whose
rounding a fused kernel would skip: the residual add, the epilogues, and every op of a
``torch_manual`` norm in bf16/fp16 (the other torch forms compute in fp32 between explicit casts).
fp32, and fp4fuse's own norm ops (opaque to Inductor), are bitwise either way.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import logging
import math
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor import pattern_matcher as pm
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fp4fuse.distributed import groups
from fp4fuse.ops import sp_ops  # noqa: F401  (registers fp4fuse::shard_rows)
from fp4fuse.patterns.base import (
    CollectiveKind, QuantCall, ReplacementPattern, erase_if_unused, fake_value, find_collectives, get_arg,
    hoist_before, insert_call, is_call, is_schema_default, replacement_point, shapes_known_equal, threshold_reason,
)
from fp4fuse.patterns.rank_uniform import RankUniformity
from fp4fuse.patterns.thresholds import SPThresholds

__all__ = [
    "EXAMPLE_EPS", "EXAMPLE_SCALE", "Epilogue", "NORM_SETS", "NormFamily", "NormSet", "Position", "SPGroup",
    "SPMatch", "SPPattern", "epilogues_of_all_reduces", "guard_token_count", "readers_through_views",
    "round_residual_adds", "scales_of_quantizations",
    "views_before_all_reduces", "views_before_row_biases",
]

logger = logging.getLogger(__name__)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
#: AOT autograd's mark on an eager-level low-precision op: Inductor rounds its result as eager does
#: under ``emulate_precision_casts`` (module docstring, "Numerics")
_BARRIER = "low_precision_pointwise_barrier"
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
#: What reads a gathered norm output such that the gather can pay: a quantization (the gather then
#: moves its 4-bit codes) or a matmul (a collective GEMM can overlap the gather).
_GATHER_PAYS_FOR = (torch.ops.fp4fuse.scaled_fp4_quant.default, aten.mm.default, aten.addmm.default, aten.bmm.default)

# The eps of a pattern is a wildcard (register_replacement's scalar_workaround): any float of the
# traced pattern equal to this value becomes a keyword argument. It must survive a round trip
# through float32 (F.rms_norm stores eps as a float32), hence a power of two, and be unlikely to
# occur elsewhere in a norm.
EXAMPLE_EPS = 2.0 ** -17
# The scale of a scaled pattern (``all_reduce(x) * scale``, Granite's ``residual_multiplier``), a
# wildcard the same way; any other power of two.
EXAMPLE_SCALE = 2.0 ** -11


class Epilogue(enum.Enum):
    """What a model applies to the all-reduced rows before the residual add / norm; the rewrite
    applies the same elementwise op to the shard's rows, so the rows come out the same."""

    NONE = ""
    SCALED = "scaled"    # ``all_reduce(x) * number``: Granite's multipliers, MiniCPM's depth scale
    BIASED = "biased"    # ``all_reduce(x) + row_bias``: a row-parallel linear's bias, added after its sum

    def apply(self, t: torch.Tensor, a: dict[str, Any]) -> torch.Tensor:
        if self is Epilogue.SCALED:
            return t * a["scale"]
        if self is Epilogue.BIASED:
            return t + a["row_bias"]
        return t

    @staticmethod
    def of(user: fx.Node, wait: fx.Node) -> Epilogue | None:
        """The epilogue ``user`` applies to ``wait`` (an all-reduce's result), if it is one: a plain
        two-operand op (:func:`_plain_binary`; ``add(wait, b, alpha=2)`` is no bias add)."""
        if not (isinstance(user, fx.Node) and _plain_binary(user) and user.args[0] is wait):
            return None
        if is_call(user, aten.mul.Tensor) and isinstance(user.args[1], (int, float)):
            return Epilogue.SCALED
        if is_call(user, aten.add.Tensor) and isinstance(user.args[1], fx.Node):
            row, full = _shape_of(user.args[1]), _shape_of(wait)
            if row is not None and full is not None and len(row) == 1 and shapes_known_equal(row, full[-1:]):
                return Epilogue.BIASED
        return None


class Position(enum.Enum):
    FIRST = "first"      # all_reduce -> norm; the reduced tensor is also the residual stream
    MIDDLE = "middle"    # all_reduce -> add residual -> norm; the sum is the next residual
    LAST = "last"        # all_reduce -> add residual -> norm; the sum is not read again


@dataclasses.dataclass(frozen=True)
class SPGroup:
    """The tensor-parallel group a pattern is built for: its name and number of ranks."""

    name: str
    size: int


class NormFamily(abc.ABC):
    """One way a model writes its norm (the classes below; :data:`NORM_SETS` groups them).
    ``has_bias``: the norm also takes a ``bias`` row (LayerNorm), passed after ``eps``.
    ``one_row_as_among_many``: Inductor computes a one-row norm bit for bit as the same row among
    several. Not so for LayerNorm's Welford reduction (torch 2.13 CPU, hidden 288-4096: last-bit
    differences), so a rewrite that leaves one row per rank is skipped there."""

    name: ClassVar[str]
    has_bias: ClassVar[bool] = False
    one_row_as_among_many: ClassVar[bool] = True

    @abc.abstractmethod
    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *bias: torch.Tensor) -> torch.Tensor:
        """``rms_norm(x) * weight`` (or ``layer_norm(x) * weight + bias``)."""

    @abc.abstractmethod
    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, *bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``."""


# --------------------------------------------------------------------------- collectives (dim 0)


def all_reduce_sum(x: torch.Tensor, group: SPGroup) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group.name))


def reduce_scatter_rows(x: torch.Tensor, group: SPGroup) -> torch.Tensor:
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", group.size, group.name))


def all_gather_rows(x: torch.Tensor, group: SPGroup) -> torch.Tensor:
    return groups.all_gather_rows(x, group.name, group.size)


def shard_rows(x: torch.Tensor, group: SPGroup) -> torch.Tensor:
    return torch.ops.fp4fuse.shard_rows(x, group.name)


def rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., hidden]`` as ``[tokens, hidden]`` (a view; no node for a 2-D x once traced)."""
    return x.reshape(-1, x.shape[-1])


# --------------------------------------------------------------------------- matches


@dataclasses.dataclass(frozen=True)
class SPMatch:
    """What the check of an SP match looks at (decoded from a specific pattern match).

    ``tokens`` is the number of rows that are split: the product of the leading dimensions of
    the all-reduced ``[..., hidden]`` activation."""

    all_reduce: fx.Node
    input: fx.Node
    residual: fx.Node | None
    weight: fx.Node
    bias: fx.Node | None
    tokens: int | torch.SymInt
    shape: tuple[Any, ...]

    @classmethod
    def decode(cls, match: pm.Match) -> SPMatch:
        reduce = next(n for n in match.nodes if is_call(n, c10d.all_reduce) and get_arg(n, 1, "reduce_op") == "sum")
        x = get_arg(reduce, 0, "input")
        shape = tuple(fake_value(x).shape)
        return cls(reduce, x, match.kwargs.get("residual"), match.kwargs["weight"], match.kwargs.get("bias"),
                   math.prod(shape[:-1]), shape)


def readers_through_views(outputs: Any) -> list[fx.Node]:
    """The nodes that read ``outputs`` (nodes, None entries ignored), looking through views: each
    reader that is not itself a view, once."""
    readers: dict[fx.Node, None] = {}
    frontier = [n for n in outputs if isinstance(n, fx.Node)]
    seen = set(frontier)
    while frontier:
        for user in frontier.pop().users:
            if is_call(user, *_VIEWS):
                if user not in seen:
                    seen.add(user)
                    frontier.append(user)
            else:
                readers[user] = None
    return list(readers)


def scales_of_quantizations(outputs: Any) -> set[fx.Node | None]:
    """The global scales of the NVFP4 quantizations reading ``outputs`` (nodes, None entries
    ignored; read through views): a graph input or attribute (model state: a static scale held by
    one module) stands for itself, every scale computed in the graph for None (dynamic scales
    computed from one tensor alike are merged into one quantization before it is gathered:
    ``fp4fuse.passes.sequence_parallel``, step 4). More than one element: the readers cannot share
    one quantization."""
    scales: set[fx.Node | None] = set()
    for reader in readers_through_views(outputs):
        if is_call(reader, torch.ops.fp4fuse.scaled_fp4_quant.default):
            scale = QuantCall.of(reader).global_scale
            scales.add(scale if isinstance(scale, fx.Node) and scale.op in ("placeholder", "get_attr") else None)
    return scales


def _epilogue_operand(match: pm.Match, reduce: fx.Node) -> Any:
    """The second operand of the match's ``wait(all_reduce) * / + operand`` (None if it has none)."""
    for n in match.nodes:
        if (is_call(n, aten.mul.Tensor, aten.add.Tensor) and _plain_binary(n) and is_call(n.args[0], c10d.wait_tensor)
                and get_arg(n.args[0], 0, "input") is reduce):
            return n.args[1]
    return None


def _plain_binary(node: fx.Node) -> bool:
    """``node`` calls its op with two positional operands and keyword arguments only at their
    schema defaults (``alpha=1``): ``add(a, b, alpha=2)`` is ``a + 2 * b``, and an op rebuilt from
    its two operands (or a pattern traced without ``alpha``) would drop the factor."""
    return len(node.args) == 2 and all(is_schema_default(node.target, key, value) for key, value in node.kwargs.items())


def _shape_of(node: Any) -> tuple[Any, ...] | None:
    val = fake_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _is_exactly(value: Any, expected: int) -> bool:
    return bool(statically_known_true(value == expected))


def guard_token_count(tokens: int | torch.SymInt, group_size: int, min_tokens: int) -> str | None:
    """Why an SP rewrite over ``tokens`` rows must not fire, or None (and then it may).

    A static count must be divisible by the group size and at least ``min_tokens``. A symbolic
    count whose size hint is divisible, with at least two rows per rank (a hint of one row would
    specialize the shard size), gets the guard ``tokens % size == 0`` (``torch._check`` on a backed
    size installs one), and ``min_tokens`` is decided by the hint with a guard on either
    side (:func:`fp4fuse.patterns.base.threshold_reason`), so the compiled graph only ever runs on
    sizes it is correct and wanted for; other sizes recompile. A hint that fails the divisibility or
    the two rows is guarded on its side too (``tokens % size != 0``, ``tokens < 2 * size``): the
    graph left alone is correct for every count, but served first (a warm cache after a restart) it
    would otherwise run every later count unsharded. A count without a hint (unbacked) is left alone.
    """
    if isinstance(tokens, int):
        if tokens % group_size:
            return f"token count {tokens} is not divisible by the group size {group_size}"
        return threshold_reason(tokens, min_tokens)
    node = tokens.node
    if not node.has_hint():
        return f"dynamic token count {tokens} has no size hint (unbacked); cannot guard it"
    hint = int(node.hint)
    if hint % group_size:
        torch._check(tokens % group_size != 0)
        return (f"dynamic token count {tokens} (hint {hint}) is not divisible by the group size {group_size} "
                "(guarded: a divisible count recompiles)")
    if hint // group_size < 2:
        torch._check(tokens < 2 * group_size)
        return (f"dynamic token count {tokens} (hint {hint}) gives {hint // group_size} row per rank: tracing the "
                "sharded graph at that hint would specialize the count (sizes 0 and 1 are static to torch.compile), "
                "which breaks a mark_dynamic constraint; guarded: a call with more tokens compiles a graph that fuses")
    reason = threshold_reason(tokens, min_tokens)
    if reason is None:
        torch._check(tokens % group_size == 0)
        logger.debug("guarded dynamic token count %s: divisible by %d, >= %d", tokens, group_size, min_tokens)
    return reason


# --------------------------------------------------------------------------- the pattern


class SPPattern(ReplacementPattern):
    """``all_reduce -> [add residual ->] norm`` -> its sequence-parallel form.

    Before / after per position (``rs`` reduce_scatter, ``ag`` all_gather, all along dim 0 of
    the rows; every output viewed back to ``x``'s shape)::

        FIRST   y = all_reduce(x); out = norm(y)            ->  y_r = rs(x); out = ag(norm(y_r)); y = ag(y_r)
        MIDDLE  out, t = add_norm(all_reduce(x), res)       ->  out_r, t_r = add_norm(rs(x), shard_rows(res))
                                                                out, t = ag(out_r), ag(t_r)
        LAST    out, _ = add_norm(all_reduce(x), res)       ->  out_r, _ = add_norm(rs(x), shard_rows(res))
                                                                out = ag(out_r)

    ``epilogue`` (:class:`Epilogue`): an op the model applies to the all-reduced tensor before the
    add / norm (``all_reduce(x) * scale``, ``all_reduce(x) + row_bias``); the replacement applies it
    to the shard (``rs(x) * scale``: the same elementwise op on the same rows). Named
    ``<position>.<family>_<epilogue>``.

    ``check`` rejects (with the reason) a residual that broadcasts, a norm weight or bias that is not
    one row of ``hidden`` values, a scale that is a tensor rather than a number, a norm weight, bias,
    row bias or residual that may differ across ranks
    (:class:`~fp4fuse.patterns.rank_uniform.RankUniformity`), and a token count that is not
    divisible by the group size or is below ``min_tokens`` (a symbolic count is guarded instead,
    see :func:`guard_token_count`). ``thresholds`` (``fp4fuse.patterns.thresholds.SPThresholds``)
    holds that minimum and two more, each taken instead where larger, None skipping the match: for a
    norm output that NVFP4 quantizations with global scales of their own read
    (:func:`scales_of_quantizations`: more than one), and for a first or middle norm's output that
    neither a quantization nor a matmul reads (:func:`readers_through_views`).
    ``ndim`` is the rank of the activations the pattern is traced with (a norm over ``dim=-1``
    traces to the positive dim, so each rank needs its own pattern).
    """

    def __init__(self, family: NormFamily, position: Position, group: SPGroup, uniformity: RankUniformity,
                 dtype: torch.dtype = torch.bfloat16, ndim: int = 2, epilogue: Epilogue = Epilogue.NONE,
                 thresholds: SPThresholds = SPThresholds()) -> None:
        self.family, self.position, self.group, self.uniformity = family, position, group, uniformity
        self.dtype, self.ndim, self.epilogue, self.thresholds = dtype, ndim, epilogue, thresholds

    @property
    def name(self) -> str:  # type: ignore[override]
        suffix = f"_{self.epilogue.value}" if self.epilogue is not Epilogue.NONE else ""
        return f"{self.position.value}.{self.family.name}{suffix}"

    def arg_names(self) -> list[str]:
        """x, [residual], weight, eps, [bias], [scale | row_bias] (eps and scale are scalar
        wildcards, not example tensors: one pattern serves every epsilon and scale)."""
        epilogue = {Epilogue.NONE: [], Epilogue.SCALED: ["scale"], Epilogue.BIASED: ["row_bias"]}[self.epilogue]
        return (["x"] + (["residual"] if self.position is not Position.FIRST else []) + ["weight", "eps"]
                + (["bias"] if self.family.has_bias else []) + epilogue)

    def example_inputs(self) -> list[Any]:
        shape = (2,) * (self.ndim - 2) + (4 * self.group.size, 32)
        tensors = {
            "x": torch.empty(shape, dtype=self.dtype),
            "residual": torch.empty(shape, dtype=self.dtype),
            "weight": torch.empty(shape[-1], dtype=self.dtype),
            "bias": torch.empty(shape[-1], dtype=self.dtype),
            "row_bias": torch.empty(shape[-1], dtype=self.dtype),
        }
        return [tensors[n] for n in self.arg_names() if n not in self.scalar_workaround()]

    def _norm_args(self, a: dict[str, Any]) -> tuple[Any, ...]:
        return (a["weight"], a["eps"]) + ((a["bias"],) if self.family.has_bias else ())

    def pattern(self, *args: Any) -> Any:
        a = dict(zip(self.arg_names(), args))
        reduced = self.epilogue.apply(all_reduce_sum(a["x"], self.group), a)
        if self.position is Position.FIRST:
            return self.family.norm(reduced, *self._norm_args(a)), reduced
        out, residual_out = self.family.add_norm(reduced, a["residual"], *self._norm_args(a))
        return out if self.position is Position.LAST else (out, residual_out)

    def replacement(self, *args: Any) -> Any:
        a = dict(zip(self.arg_names(), args))
        x = a["x"]

        def gathered(shard: torch.Tensor) -> torch.Tensor:
            # a 2-D x is not viewed back: with a symbolic token count that view would read x's
            # size (a sym_size node keeping x's producer, e.g. an mm_fp4, from fusing)
            full = all_gather_rows(shard, self.group)
            return full if x.dim() == 2 else full.view(x.shape)

        shard = self.epilogue.apply(reduce_scatter_rows(rows(x), self.group), a)
        if self.position is Position.FIRST:
            return gathered(self.family.norm(shard, *self._norm_args(a))), gathered(shard)
        residual = shard_rows(rows(a["residual"]), self.group)
        out, residual_shard = self.family.add_norm(shard, residual, *self._norm_args(a))
        if self.position is Position.LAST:
            return gathered(out)
        return gathered(out), gathered(residual_shard)

    def anchor(self, match: pm.Match) -> fx.Node:
        return SPMatch.decode(match).all_reduce

    def check(self, match: pm.Match) -> str | None:
        # The epsilon is a wildcard (scalar_workaround), so rsqrt(mean(x^2) + eps_t) with a tensor eps_t
        # matches too: each rank would compute its rows with its own eps_t (nothing proves it the same
        # on every rank) and one computed after the replacement point would be read before it exists.
        # A number is compared across ranks with the match's other literals.
        eps = match.kwargs.get("eps")
        if isinstance(eps, fx.Node):
            return (f"the norm's epsilon is a tensor ({eps.name}), not a number: each rank would compute its rows "
                    "with its own tensor, which nothing proves the same on every rank; pass eps as a Python float")
        m = SPMatch.decode(match)
        if len(m.shape) < 2:
            return f"input of the all_reduce has shape {list(m.shape)}: need [..., hidden]"
        hidden = m.shape[-1]
        residual_shape = _shape_of(m.residual) if m.residual is not None else None
        if m.residual is not None and (residual_shape is None or not shapes_known_equal(residual_shape, m.shape)):
            return (f"residual shape {residual_shape} differs from the all_reduce's {list(m.shape)} "
                    "(a broadcast residual cannot be sharded by rows)")
        # read from the graph: torch 2.11 runs this check on a match of the pattern re-traced with the
        # actual scalars, where a scale is a literal, not a keyword argument
        operand = _epilogue_operand(match, m.all_reduce) if self.epilogue is not Epilogue.NONE else None
        if self.epilogue is Epilogue.SCALED and not isinstance(operand, (int, float)):
            return (f"the all_reduce's result is multiplied by {operand}, a tensor: only a number is applied "
                    "to the shard as it is to the whole")
        weight_shape = _shape_of(m.weight)
        if weight_shape is None or len(weight_shape) != 1 or not _is_exactly(weight_shape[0], hidden):
            return f"norm weight shape {weight_shape} is not [hidden={hidden}] (it must not vary by row)"
        if isinstance(m.weight, fx.Node):  # a weight computed in the graph (Gemma's 1 + w in fp32) may come late
            reason = hoist_before(m.weight, replacement_point(match), keep_out=match.nodes)
            if reason is not None:
                return f"norm weight: {reason}"
        row_operands = [("norm bias", m.bias)] if m.bias is not None else []
        if self.epilogue is Epilogue.BIASED:
            row_operands.append(("row-parallel bias", operand))
        for what, row in row_operands:
            row_shape = _shape_of(row)
            if row_shape is None or len(row_shape) != 1 or not _is_exactly(row_shape[0], hidden):
                return f"{what} shape {row_shape} is not [hidden={hidden}] (it must not vary by row)"
            reason = hoist_before(row, replacement_point(match), keep_out=match.nodes)
            if reason is not None:
                return f"{what}: {reason}"
        operands = ([("norm weight", m.weight)] + row_operands
                    + ([("residual", m.residual)] if m.residual is not None else []))
        reason, relies_on = self.uniformity.prove(self.group.name, operands)
        if reason is None:
            reason = self._token_count_reason(match, m.tokens)
        if reason is None and not self.family.one_row_as_among_many and _is_exactly(m.tokens, self.group.size):
            reason = (f"{m.tokens} tokens leave one row per rank, and Inductor computes a one-row {self.family.name} "
                      "(a Welford reduction) in another order than the same row among several: the rewrite "
                      "would change last bits of the unfused graph's output")
        if reason is None:  # the shards are also computed with the match's own literals (eps, a scale)
            self.uniformity.rely_on(self.group.name, relies_on.with_literals_of(match.nodes))
        return reason

    def _token_count_reason(self, match: pm.Match, tokens: int | torch.SymInt) -> str | None:
        """:func:`guard_token_count` against the least token count ``thresholds`` gives this match:
        ``min_tokens``, or the larger ``unquantized`` / ``unshared`` one where the norm output is
        read as those thresholds describe."""
        limits = self.thresholds
        outputs = match.output_nodes()
        if limits.unquantized != limits.min_tokens and self.position is not Position.LAST:
            readers = readers_through_views(outputs[:1])  # the norm output: the pattern's first output
            if readers and not any(is_call(r, *_GATHER_PAYS_FOR) for r in readers):
                names = ", ".join(sorted({str(r.target) for r in readers}))
                why = (f"the norm output is read by {names}, neither an NVFP4 quantization nor a matmul: after the "
                       "rewrite it would be gathered unquantized, and no collective GEMM could overlap that gather")
                return self._threshold_reason(tokens, limits.unquantized, why,
                                              "on this device such a rewrite measured slower than none")
        # the scales matter only where their threshold differs
        scales = scales_of_quantizations(outputs) if limits.unshared != limits.min_tokens else set()
        if len(scales) < 2:
            return guard_token_count(tokens, self.group.size, limits.min_tokens)
        why = (f"the norm output is quantized with {len(scales)} global scales of their own (static per-projection "
               "scales: the pass cannot prove them equal), so after the rewrite each would quantize and gather it on "
               "its own; sequence parallelism alone lost then at every size measured")
        return self._threshold_reason(tokens, limits.unshared, why,
                                      "the collective GEMMs, with which it pays, are off (enable_async_tp)",
                                      ", below where the GEMM + reduce-scatter fires")

    def _threshold_reason(self, tokens: int | torch.SymInt, least: int | None, why: str, never: str,
                          below: str = "") -> str | None:
        """Why a match of ``tokens`` rows that ``why`` describes is skipped: always where its
        threshold ``least`` is None (because ``never``), else below it (``below`` appended), or None."""
        if least is None:
            return f"{why}, and {never}"
        reason = guard_token_count(tokens, self.group.size, max(self.thresholds.min_tokens, least))
        return None if reason is None else f"{reason}: {why}{below}"

    def scalar_workaround(self) -> dict[str, float]:
        return {"eps": EXAMPLE_EPS, **({"scale": EXAMPLE_SCALE} if self.epilogue is Epilogue.SCALED else {})}


# --------------------------------------------------------------------------- norm families


class FP4FuseNorm(NormFamily):
    name = "fp4fuse"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *bias: torch.Tensor) -> torch.Tensor:
        return torch.ops.fp4fuse.rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, *bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, residual_out = torch.ops.fp4fuse.fused_add_rms_norm(x, residual, weight, eps)
        return out, residual_out


class _TorchNorm(NormFamily):
    def __init__(self, residual_first: bool = False) -> None:
        self.residual_first = residual_first

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, *bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + x if self.residual_first else x + residual
        return self.norm(total, weight, eps, *bias), total


class TorchFunctionalNorm(_TorchNorm):
    name = "torch_functional"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *bias: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)


class TorchManualNorm(_TorchNorm):
    name = "torch_manual"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *bias: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TorchFP32Norm(_TorchNorm):
    name = "torch_fp32"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *bias: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class TorchOffsetFP32Norm(_TorchNorm):
    name = "torch_offset_fp32"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *bias: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


class TorchLayerNorm(_TorchNorm):
    """``F.layer_norm(x, (hidden,), weight, bias, eps)`` (``nn.LayerNorm``: Starcoder2, StableLM)."""

    name = "torch_layer_norm"
    has_bias = True
    one_row_as_among_many = False

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, *bias, eps)


# LAST before MIDDLE in registration (= priority) order, so a final norm whose residual sum nobody
# reads counts as the last one.
_POSITIONS = (Position.FIRST, Position.LAST, Position.MIDDLE)


@dataclasses.dataclass(frozen=True)
class NormSet:
    """Norm families that share a presence test: their patterns are registered for a graph only
    when it may hold one of them (``marker_ops`` appear in it)."""

    name: str
    families: tuple[type[NormFamily], ...]
    marker_ops: tuple[Any, ...]
    dtype_generic: bool

    def present(self, graph: fx.Graph) -> bool:
        return any(graph.find_nodes(op="call_function", target=t) for t in self.marker_ops)

    def build_patterns(self, group: SPGroup, uniformity: RankUniformity, dtype: torch.dtype,
                       ndim: int = 2, epilogue: Epilogue = Epilogue.NONE,
                       thresholds: SPThresholds = SPThresholds()) -> list[SPPattern]:
        """Every family and position (and, for the torch forms, both add orders) for ``group``, one
        activation dtype and one activation rank, with one ``epilogue`` and its thresholds
        (:class:`SPPattern`). A dtype-generic set (fp4fuse's ops) traces the same for every dtype;
        the torch forms trace fp32 without the casts of bf16/fp16 (fp16 traces like bf16)."""
        example_dtype = torch.bfloat16 if self.dtype_generic or dtype != torch.float32 else torch.float32
        patterns = []
        for family in self.families:
            for pos in _POSITIONS:
                orders = (False,) if family is FP4FuseNorm or pos is Position.FIRST else (False, True)
                for residual_first in orders:
                    norm = family() if family is FP4FuseNorm else family(residual_first)
                    patterns.append(SPPattern(norm, pos, group, uniformity, example_dtype, ndim, epilogue, thresholds))
        return patterns


#: fp4fuse's norm ops, and the torch forms (every torch form decomposes to an ``rsqrt``).
NORM_SETS: tuple[NormSet, ...] = (
    NormSet("fp4fuse", (FP4FuseNorm,),
            (torch.ops.fp4fuse.rms_norm.default, torch.ops.fp4fuse.fused_add_rms_norm.default), True),
    NormSet("torch", (TorchFunctionalNorm, TorchManualNorm, TorchFP32Norm, TorchOffsetFP32Norm),
            (torch.ops.aten.rsqrt.default,), False),
    NormSet("torch_layer_norm", (TorchLayerNorm,), (torch.ops.aten.var_mean.correction,), False),
)


# --------------------------------------------------------------------------- graph canonicalization


def views_before_all_reduces(graph: fx.Graph, group_name: str) -> int:
    """Move views of all-reduced tensors before the all-reduce (module docstring); returns how
    many all-reduces over ``group_name`` moved. Before / after::

        y = wait(all_reduce(p, op, g)); v = view(y, shape)  ->  v = wait(all_reduce(reshape(p, shape), op, g))

    Only an all-reduce whose every reader is a view to one (provably) same shape moves (exact: a reduction over
    ranks commutes with a view)."""
    moved = 0
    for c in find_collectives(graph, CollectiveKind.ALL_REDUCE):
        if c.group_name != group_name or c.wait is None:
            continue
        views = _views_to_one_shape(c.wait)
        if views is None:
            continue
        first = views[0]
        with graph.inserting_before(first):
            view = insert_call(graph, aten.reshape.default, (c.input, get_arg(first, 1, "size")))
            reduced = insert_call(graph, c10d.all_reduce.default, (view, c.reduce_op, c.group_name))
            waited = insert_call(graph, c10d.wait_tensor.default, (reduced,))
        for v in views:
            v.replace_all_uses_with(waited)
        erase_if_unused([*views, c.wait, c.node])
        moved += 1
    return moved


def _views_to_one_shape(node: fx.Node) -> list[fx.Node] | None:
    """``node``'s readers, sorted, when there are some and every one is a view to one (provably)
    same shape; else None."""
    views = sorted(node.users)
    if not views or not all(is_call(v, *_VIEWS) for v in views):
        return None
    shapes = [_shape_of(v) for v in views]
    if shapes[0] is None or not all(s is not None and shapes_known_equal(s, shapes[0]) for s in shapes[1:]):
        return None
    return views


def epilogues_of_all_reduces(graph: fx.Graph, group_name: str) -> list[Epilogue]:
    """The :class:`Epilogue` s other than NONE applied to the sum all-reduces over ``group_name``
    (their patterns are registered only for graphs where they occur)."""
    found: list[Epilogue] = []
    for c in find_collectives(graph, CollectiveKind.ALL_REDUCE):
        if c.group_name == group_name and c.reduce_op == "sum" and c.wait is not None:
            for user in c.wait.users:
                kind = Epilogue.of(user, c.wait)
                if kind is not None and kind not in found:
                    found.append(kind)
    return found


def views_before_row_biases(graph: fx.Graph, group_name: str) -> int:
    """Move views of ``all_reduce(x) + row_bias`` before the add (a row-parallel linear adds its
    bias to the 2-D rows, then views them back to ``[b, s, h]``), so that
    :func:`views_before_all_reduces` can move them on; returns how many adds had their views moved::

        v = view(add(wait(all_reduce(p)), b), shape)  ->  v = add(view(wait(all_reduce(p)), shape), b)

    Exact: adding one ``[hidden]`` row to every row commutes with a view that keeps the last dim.
    Only an add whose every reader is a view to one (provably) same shape moves."""
    moved = 0
    for c in find_collectives(graph, CollectiveKind.ALL_REDUCE):
        if c.group_name != group_name or c.wait is None:
            continue
        for add in list(c.wait.users):
            views = _views_to_one_shape(add) if Epilogue.of(add, c.wait) is Epilogue.BIASED else None
            added = _shape_of(add)
            if views is None or added is None or not shapes_known_equal(_shape_of(views[0])[-1:], added[-1:]):
                continue
            with graph.inserting_before(views[0]):
                view = insert_call(graph, aten.reshape.default, (c.wait, get_arg(views[0], 1, "size")))
                biased = insert_call(graph, aten.add.Tensor, (view, add.args[1]))
            if _BARRIER in add.meta:  # keep the eager rounding AOT autograd marked
                biased.meta[_BARRIER] = add.meta[_BARRIER]
            for v in views:
                v.replace_all_uses_with(biased)
            erase_if_unused([*views, add])
            moved += 1
    return moved


def round_residual_adds(graph: fx.Graph, group_name: str) -> int:
    """Under ``emulate_precision_casts``, mark the residual adds (and the epilogues) of rewritten
    bf16/fp16 norms as eager-level ops, as AOT autograd marked the ops they replace (module
    docstring, "Numerics"): ``add(shard, shard_rows(...))`` in either order, where ``shard`` is
    ``wait(reduce_scatter(..., group))`` or that with its :class:`Epilogue`, an add only the
    replacements above write; each epilogue of ``wait(reduce_scatter(..., group))``; and the ops of a
    ``torch_manual`` norm in bf16/fp16 that reads one of these (all eager-level low-precision ops).
    Returns how many ops were marked (none without the setting)."""
    if not inductor_config.emulate_precision_casts:
        return 0
    marked = 0
    # what a rewritten norm reads: the shard, its epilogue or the residual add
    norm_inputs = [op for op in graph.find_nodes(op="call_function", target=c10d.wait_tensor.default)
                   if _is_local_shard(op, group_name)]
    for op in [*graph.find_nodes(op="call_function", target=aten.mul.Tensor),
               *graph.find_nodes(op="call_function", target=aten.add.Tensor)]:
        if _low_precision(op) and _is_epilogue_of_local_shard(op, group_name):
            op.meta[_BARRIER] = True
            marked += 1
            norm_inputs.append(op)
    for add in graph.find_nodes(op="call_function", target=aten.add.Tensor):
        args = [a for a in add.args if isinstance(a, fx.Node)]
        if (len(args) == 2 and _plain_binary(add) and _low_precision(add)
                and any(_is_local_shard(a, group_name) or _is_epilogue_of_local_shard(a, group_name) for a in args)
                and any(is_call(a, torch.ops.fp4fuse.shard_rows) for a in args)):
            add.meta[_BARRIER] = True
            marked += 1
            norm_inputs.append(add)
    for x in norm_inputs:
        for op in _low_precision_manual_norm(x):
            if not op.meta.get(_BARRIER):
                op.meta[_BARRIER] = True
                marked += 1
    return marked


def _low_precision_manual_norm(x: fx.Node) -> list[fx.Node]:
    """The ops of ``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight`` (``torch_manual``)
    computed on ``x`` in bf16/fp16, as the rewrite writes them: pow, mean, add, rsqrt and both muls.
    Each is an eager-level low-precision op, which AOT autograd marks in the graph the rewrite
    replaced (the other norm forms compute in fp32, or are fp4fuse's ops); [] where ``x`` has no
    such norm."""
    if not _low_precision(x):
        return []
    for square in x.users:
        if not (is_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2):
            continue
        chain = [square]
        for targets in ((aten.mean.dim,), (aten.add.Tensor, aten.add.Scalar), (aten.rsqrt.default,)):
            users = [u for u in chain[-1].users if is_call(u, *targets)]
            if len(users) != 1:
                break
            chain.append(users[0])
        else:
            scaled = [u for u in chain[-1].users if is_call(u, aten.mul.Tensor) and x in u.args]
            if len(scaled) == 1 and len(scaled[0].users) == 1 and is_call(next(iter(scaled[0].users)), aten.mul.Tensor):
                chain += [scaled[0], next(iter(scaled[0].users))]
                return [op for op in chain if _low_precision(op)]
    return []


def _low_precision(node: fx.Node) -> bool:
    val = fake_value(node)
    return isinstance(val, torch.Tensor) and val.dtype in (torch.bfloat16, torch.float16)


def _is_epilogue_of_local_shard(node: fx.Node, group_name: str) -> bool:
    """``node`` is ``wait(reduce_scatter(..., group_name))`` times a number or plus a row."""
    return bool(node.args) and _is_local_shard(node.args[0], group_name) and Epilogue.of(node, node.args[0]) is not None


def _is_local_shard(node: fx.Node, group_name: str) -> bool:
    """``node`` is ``wait(reduce_scatter(..., group_name))``."""
    if not is_call(node, c10d.wait_tensor):
        return False
    collective = get_arg(node, 0, "input")
    return is_call(collective, c10d.reduce_scatter_tensor) and get_arg(collective, 3, "group_name") == group_name
