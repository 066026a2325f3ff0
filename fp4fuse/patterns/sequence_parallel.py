"""Sequence-parallel (SP) rewrites of ``all_reduce -> rms_norm``, for every way a model writes the norm.

Each pattern is one ``Position`` of one norm family (which supplies ``norm`` and ``add_norm``),
built for one tensor-parallel group (name and size are constructor arguments; nothing here
reads global distributed state). Norm families (:data:`NORM_SETS`):

* ``fp4fuse``: fp4fuse's own ops, ``fp4fuse::rms_norm`` / ``fp4fuse::fused_add_rms_norm``;
* ``torch_functional``: ``torch.nn.functional.rms_norm(x, (hidden,), weight, eps)``;
* ``torch_manual``: ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight`` (in x's dtype);
* ``torch_fp32``: the Hugging Face Llama form, statistics in float32:
  ``weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)``, ``xf = x.float()``.

The torch forms add the residual with a plain ``+``, written either ``x + residual`` or
``residual + x`` (an FX pattern is not commutative, so both orders are registered). Before /
after, for a middle layer::

    y = all_reduce(x)                          y_r = reduce_scatter(x)              # rows of rank r
    out, res_out = add_norm(y, res, w)         out_r, res_r = add_norm(y_r, shard_rows(res), w)
                                               out = all_gather(out_r)
                                               res_out = all_gather(res_r)

Every rewrite is correct on its own: its outputs are the full, replicated tensors the graph had
before, so a graph where only some norms match is still right. The pass's later steps make it
fast: fp4fuse.patterns.quant_before_gather moves an NVFP4 quant of ``out`` before the gather (4.5 bits per
element on the wire instead of 16), and the cleanup folds ``shard_rows(all_gather(res_r))`` into
``res_r``, so the residual stream stays sharded from one layer to the next.

Positions: FIRST has no residual input (the all-reduced tensor is the residual stream), MIDDLE
adds a residual and passes the sum on, LAST adds one whose sum nobody reads.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import logging
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._inductor import pattern_matcher as pm
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fp4fuse.distributed import groups
from fp4fuse.ops import sp_ops  # noqa: F401  (registers fp4fuse::shard_rows)
from fp4fuse.patterns.base import ReplacementPattern, fake_value, get_arg, is_call

__all__ = [
    "EXAMPLE_EPS", "NORM_SETS", "NormFamily", "NormSet", "Position", "SPGroup", "SPMatch", "SPPattern",
    "guard_token_count",
]

logger = logging.getLogger(__name__)

c10d = torch.ops._c10d_functional

# The eps of a pattern is a wildcard (register_replacement's scalar_workaround): any float of the
# traced pattern equal to this value becomes a keyword argument. It must survive a round trip
# through float32 (F.rms_norm stores eps as a float32), hence a power of two, and be unlikely to
# occur elsewhere in a norm.
EXAMPLE_EPS = 2.0 ** -17


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
    """One way a model writes RMSNorm (the classes below; :data:`NORM_SETS` groups them)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``rms_norm(x) * weight``."""

    @abc.abstractmethod
    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
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


# --------------------------------------------------------------------------- matches


@dataclasses.dataclass(frozen=True)
class SPMatch:
    """What the check of an SP match looks at (decoded from a specific pattern match)."""

    all_reduce: fx.Node
    input: fx.Node
    residual: fx.Node | None
    weight: fx.Node
    tokens: int | torch.SymInt
    shape: tuple[Any, ...]

    @classmethod
    def decode(cls, match: pm.Match) -> SPMatch:
        reduce = next(n for n in match.nodes if is_call(n, c10d.all_reduce) and get_arg(n, 1, "reduce_op") == "sum")
        x = get_arg(reduce, 0, "input")
        shape = tuple(fake_value(x).shape)
        return cls(reduce, x, match.kwargs.get("residual"), match.kwargs["weight"], shape[0], shape)


def _shape_of(node: Any) -> tuple[Any, ...] | None:
    val = fake_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _is_exactly(value: Any, expected: int) -> bool:
    return bool(statically_known_true(value == expected))


def guard_token_count(tokens: int | torch.SymInt, group_size: int, min_tokens: int) -> str | None:
    """Why an SP rewrite over ``tokens`` rows must not fire, or None (and then it may).

    A static count must be divisible by the group size and at least ``min_tokens``. A symbolic
    count whose size hint satisfies both gets the guards ``tokens % size == 0`` and
    ``tokens >= min_tokens`` (``torch._check`` on a backed size installs a guard), so the compiled
    graph only ever runs on sizes it is correct and wanted for; other sizes recompile. A count
    without a hint (unbacked) is left alone.
    """
    if isinstance(tokens, int):
        if tokens % group_size:
            return f"token count {tokens} is not divisible by the group size {group_size}"
        if tokens < min_tokens:
            return f"token count {tokens} is below min_tokens={min_tokens}"
        return None
    node = tokens.node
    if not node.has_hint():
        return f"dynamic token count {tokens} has no size hint (unbacked); cannot guard it"
    hint = int(node.hint)
    if hint % group_size:
        return f"dynamic token count {tokens} (hint {hint}) is not divisible by the group size {group_size}"
    if hint < min_tokens:
        return f"dynamic token count {tokens} (hint {hint}) is below min_tokens={min_tokens}"
    torch._check(tokens % group_size == 0)
    if min_tokens > 0:
        torch._check(tokens >= min_tokens)
    logger.debug("guarded dynamic token count %s: divisible by %d, >= %d", tokens, group_size, min_tokens)
    return None


# --------------------------------------------------------------------------- the pattern


class SPPattern(ReplacementPattern):
    """``all_reduce -> [add residual ->] norm`` -> its sequence-parallel form.

    Before / after per position (``rs`` reduce_scatter, ``ag`` all_gather, all along dim 0)::

        FIRST   y = all_reduce(x); out = norm(y)            ->  y_r = rs(x); out = ag(norm(y_r)); y = ag(y_r)
        MIDDLE  out, t = add_norm(all_reduce(x), res)       ->  out_r, t_r = add_norm(rs(x), shard_rows(res))
                                                                out, t = ag(out_r), ag(t_r)
        LAST    out, _ = add_norm(all_reduce(x), res)       ->  out_r, _ = add_norm(rs(x), shard_rows(res))
                                                                out = ag(out_r)

    ``check`` rejects (with the reason) a residual that broadcasts, a norm weight that is not one
    row of ``hidden`` values, and a token count that is not divisible by the group size or is
    below ``min_tokens`` (a symbolic count is guarded instead, see :func:`guard_token_count`).
    """

    def __init__(self, family: NormFamily, position: Position, group: SPGroup,
                 dtype: torch.dtype = torch.bfloat16, min_tokens: int = 0) -> None:
        self.family, self.position, self.group = family, position, group
        self.dtype, self.min_tokens = dtype, min_tokens

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.position.value}.{self.family.name}"

    def arg_names(self) -> list[str]:
        """x, [residual], weight, eps (eps is a scalar wildcard, not an example tensor: one pattern
        serves every epsilon)."""
        return ["x"] + (["residual"] if self.position is not Position.FIRST else []) + ["weight", "eps"]

    def example_inputs(self) -> list[Any]:
        rows, hidden = 4 * self.group.size, 32
        tensors = {
            "x": torch.empty(rows, hidden, dtype=self.dtype),
            "residual": torch.empty(rows, hidden, dtype=self.dtype),
            "weight": torch.empty(hidden, dtype=self.dtype),
        }
        return [tensors[n] for n in self.arg_names() if n != "eps"]

    def pattern(self, *args: Any) -> Any:
        a = dict(zip(self.arg_names(), args))
        reduced = all_reduce_sum(a["x"], self.group)
        if self.position is Position.FIRST:
            return self.family.norm(reduced, a["weight"], a["eps"]), reduced
        out, residual_out = self.family.add_norm(reduced, a["residual"], a["weight"], a["eps"])
        return out if self.position is Position.LAST else (out, residual_out)

    def replacement(self, *args: Any) -> Any:
        a = dict(zip(self.arg_names(), args))
        shard = reduce_scatter_rows(a["x"], self.group)
        if self.position is Position.FIRST:
            out = self.family.norm(shard, a["weight"], a["eps"])
            return all_gather_rows(out, self.group), all_gather_rows(shard, self.group)
        residual = shard_rows(a["residual"], self.group)
        out, residual_shard = self.family.add_norm(shard, residual, a["weight"], a["eps"])
        if self.position is Position.LAST:
            return all_gather_rows(out, self.group)
        return all_gather_rows(out, self.group), all_gather_rows(residual_shard, self.group)

    def check(self, match: pm.Match) -> str | None:
        m = SPMatch.decode(match)
        if len(m.shape) < 2:
            return f"input of the all_reduce has shape {list(m.shape)}: need [tokens, hidden]"
        hidden = m.shape[-1]
        if m.residual is not None and _shape_of(m.residual) != m.shape:
            return (f"residual shape {_shape_of(m.residual)} differs from the all_reduce's {list(m.shape)} "
                    "(a broadcast residual cannot be sharded by rows)")
        weight_shape = _shape_of(m.weight)
        if weight_shape is None or len(weight_shape) != 1 or not _is_exactly(weight_shape[0], hidden):
            return f"norm weight shape {weight_shape} is not [hidden={hidden}] (it must not vary by row)"
        return guard_token_count(m.tokens, self.group.size, self.min_tokens)

    def scalar_workaround(self) -> dict[str, float]:
        return {"eps": EXAMPLE_EPS}


# --------------------------------------------------------------------------- norm families


class FP4FuseNorm(NormFamily):
    name = "fp4fuse"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.fp4fuse.rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, residual_out = torch.ops.fp4fuse.fused_add_rms_norm(x, residual, weight, eps)
        return out, residual_out


class _TorchNorm(NormFamily):
    def __init__(self, residual_first: bool = False) -> None:
        self.residual_first = residual_first

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + x if self.residual_first else x + residual
        return self.norm(total, weight, eps), total


class TorchFunctionalNorm(_TorchNorm):
    name = "torch_functional"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)


class TorchManualNorm(_TorchNorm):
    name = "torch_manual"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TorchFP32Norm(_TorchNorm):
    name = "torch_fp32"

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


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

    def build_patterns(self, group: SPGroup, dtype: torch.dtype, min_tokens: int = 0) -> list[SPPattern]:
        """Every family and position (and, for the torch forms, both add orders) for ``group`` and
        one activation dtype. A dtype-generic set (fp4fuse's ops) traces the same for every dtype;
        the torch forms trace fp32 without the casts of bf16/fp16 (fp16 traces like bf16)."""
        example_dtype = torch.bfloat16 if self.dtype_generic or dtype != torch.float32 else torch.float32
        patterns = []
        for family in self.families:
            for pos in _POSITIONS:
                orders = (False,) if family is FP4FuseNorm or pos is Position.FIRST else (False, True)
                for residual_first in orders:
                    norm = family() if family is FP4FuseNorm else family(residual_first)
                    patterns.append(SPPattern(norm, pos, group, example_dtype, min_tokens))
        return patterns


#: fp4fuse's norm ops, and the torch forms (every torch form decomposes to an ``rsqrt``).
NORM_SETS: tuple[NormSet, ...] = (
    NormSet("fp4fuse", (FP4FuseNorm,),
            (torch.ops.fp4fuse.rms_norm.default, torch.ops.fp4fuse.fused_add_rms_norm.default), True),
    NormSet("torch", (TorchFunctionalNorm, TorchManualNorm, TorchFP32Norm),
            (torch.ops.aten.rsqrt.default,), False),
)
