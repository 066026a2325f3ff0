"""The dynamic global scale of an NVFP4 activation, recognized in a post-grad graph.

An NVFP4 linear with a dynamic activation scale (``fp4fuse.nvfp4.quantizer``: ``group_amax`` without
a group, then ``fp4fuse.nvfp4.format.global_scale_from_amax``) computes, decomposed the way Inductor
sees it (torch 2.11 to 2.13)::

    a  = reshape(convert_element_type(amax(T), float32), [1])      # T: partial maxima of |x|
    v  = where(isnan(a), full([1], inf), a)
    gs = where(mul(eq(v, v), ne(abs(v), inf)),                     # isfinite(v)
               where(eq(v, 0), full([1], 1), mul(reciprocal(v), 2688.0)),
               full([1], nan))

``T`` may be any tensor; the quantizer's is ``|x|``'s row maxima (``quantizer.abs_amax``). Inductor
computes ``gs`` in a kernel of its own before the quantization; ``fp4fuse.passes.lowering`` gives
the quantization's launch ``T`` instead (``quant.scaled_fp4_quant_of_maxima_triton``), which
computes the same operations in the same order. Other forms of the scale are not matched (the
graph keeps Inductor's kernel).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from fp4fuse.nvfp4.format import E2M1_MAX, E4M3_MAX
from fp4fuse.patterns.base import fake_value, get_arg, is_call

__all__ = ["ScaleOfMaxima", "scale_of_maxima"]

aten = torch.ops.aten
prims = torch.ops.prims

_SCALE_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688
_AND = (aten.mul.Tensor, aten.logical_and.default, aten.bitwise_and.Tensor)
_RESHAPES = (aten.reshape.default, aten.view.default)


@dataclasses.dataclass(frozen=True)
class ScaleOfMaxima:
    """A matched global scale: ``maxima`` is ``T``; ``nodes`` every node from ``amax(T)`` to the
    scale and its ``full`` constants: the match alone reads them (a constant may have other
    readers), and they can go once the scale has no reader."""

    maxima: fx.Node
    nodes: tuple[fx.Node, ...]


def _constant(arg: Any, value: float) -> bool:
    if not isinstance(arg, (int, float)) or isinstance(arg, bool):
        return False
    return math.isnan(arg) if math.isnan(value) else arg == value


def _full(node: Any, value: float, constants: list[fx.Node]) -> bool:
    """``full([1], value)`` in fp32 (added to ``constants``)."""
    if (is_call(node, aten.full.default) and _constant(node.args[1], value)
            and node.kwargs.get("dtype") == torch.float32):
        constants.append(node)
        return True
    return False


def _unary(node: Any, target: Callable[..., Any]) -> fx.Node | None:
    """The operand of ``target(operand)``, else None."""
    return node.args[0] if is_call(node, target) and len(node.args) == 1 and isinstance(node.args[0], fx.Node) else None


def _operands(node: Any, target: Callable[..., Any] | tuple, arity: int = 2) -> tuple[Any, ...] | None:
    """The ``arity`` positional operands of ``target(...)`` (one of ``target`` where a tuple), else None."""
    targets = target if isinstance(target, tuple) else (target,)
    return tuple(node.args) if is_call(node, *targets) and len(node.args) == arity and not node.kwargs else None


def _isfinite_of(cond: Any, v: fx.Node, seen: list[fx.Node]) -> bool:
    """``cond`` is ``eq(v, v) & ne(abs(v), inf)`` (either order)."""
    pair = _operands(cond, _AND)
    if pair is None:
        return False
    for eq, ne in (pair, pair[::-1]):
        ne_args = _operands(ne, aten.ne.Scalar)
        if _operands(eq, aten.eq.Tensor) == (v, v) and ne_args is not None and _constant(ne_args[1], math.inf):
            if _unary(ne_args[0], aten.abs.default) is v:
                seen += [cond, eq, ne, ne_args[0]]
                return True
    return False


def _amax_of(a: Any, seen: list[fx.Node]) -> fx.Node | None:
    """``T`` where ``a`` is an fp32 one-element ``amax(T)`` over every dim, through reshapes / views
    and a conversion to fp32, in any order; else None."""
    val = fake_value(a) if isinstance(a, fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.dtype == torch.float32 and val.numel() == 1):
        return None
    node = a
    while is_call(node, *_RESHAPES) or (is_call(node, prims.convert_element_type.default)
                                         and node.args[1] == torch.float32):
        seen.append(node)
        node = node.args[0]
    if not is_call(node, aten.amax.default) or not isinstance(node.args[0], fx.Node):
        return None
    if list(get_arg(node, 1, "dim", [])) or get_arg(node, 2, "keepdim", False):
        return None
    seen.append(node)
    return node.args[0]


def scale_of_maxima(gs: fx.Node) -> ScaleOfMaxima | None:
    """The match of the module docstring's form ending at ``gs``, or None (another form, a scale
    that is not fp32 ``[1]``, or a node of it that something else reads too)."""
    # the launch that replaces it writes an fp32 [1] tensor, which every reader of gs then reads: a
    # 0-d or [1, 1] scale (numel 1 too) would change the shape of what they compute (an output)
    val = fake_value(gs)
    if not (isinstance(val, torch.Tensor) and val.dtype == torch.float32 and tuple(val.shape) == (1,)):
        return None
    seen: list[fx.Node] = [gs]
    constants: list[fx.Node] = []
    outer = _operands(gs, aten.where.self, 3)
    if outer is None or not _full(outer[2], math.nan, constants):
        return None
    cond, inner = outer[0], outer[1]
    inner_args = _operands(inner, aten.where.self, 3)
    if inner_args is None or not _full(inner_args[1], 1.0, constants):
        return None
    seen.append(inner)
    zero, scaled = inner_args[0], inner_args[2]
    zero_args = _operands(zero, aten.eq.Scalar)
    if zero_args is None or not _constant(zero_args[1], 0.0):
        return None
    v = zero_args[0]
    product = _operands(scaled, aten.mul.Tensor)
    if product is None:
        return None
    recip = product[0] if _constant(product[1], _SCALE_NUMERATOR) else product[1]
    if not (_constant(product[0], _SCALE_NUMERATOR) or _constant(product[1], _SCALE_NUMERATOR)):
        return None
    if _unary(recip, aten.reciprocal.default) is not v or not _isfinite_of(cond, v, seen):
        return None
    seen += [zero, scaled, recip]
    v_args = _operands(v, aten.where.self, 3)
    if v_args is None or not _full(v_args[1], math.inf, constants):
        return None
    a = v_args[2]
    if _unary(v_args[0], aten.isnan.default) is not a:
        return None
    seen += [v, v_args[0]]
    maxima = _amax_of(a, seen)
    if maxima is None:
        return None
    inside = set(seen)
    if any(user not in inside for node in seen[1:] for user in node.users):
        return None
    return ScaleOfMaxima(maxima, tuple(sorted(inside | set(constants))))
