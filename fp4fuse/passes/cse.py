"""Common subexpressions: one computation where the graph repeats a pure one, above all the NVFP4
quantization of an activation that several linears read.

A Hugging Face decoder layer calls ``q_proj``, ``k_proj`` and ``v_proj`` (and ``gate_proj``,
``up_proj``) on the same tensor, and each NVFP4 linear quantizes its input itself: the amax, the
global scale and ``fp4fuse::scaled_fp4_quant`` of one activation run three (two) times, and
Inductor cannot merge the custom-op calls. This pass keeps the first of each set of equal nodes::

    before:  q1, s1 = scaled_fp4_quant(x, gs(amax(x)));  q2, s2 = scaled_fp4_quant(x, gs(amax(x)))
             mm_fp4(q1, Wq, s1, ..);  mm_fp4(q2, Wk, s2, ..)
    after:   q1, s1 = scaled_fp4_quant(x, gs(amax(x)))
             mm_fp4(q1, Wq, s1, ..);  mm_fp4(q1, Wk, s1, ..)

Two nodes are equal when they call the same pure target with equal arguments (nodes compared after
merging, literals by value): then they compute the same value, bit for bit. Pure: an ATen or prims
overload whose schema mutates nothing, that is not tagged nondeterministic (seeded or bitwise) and
that does not return uninitialized memory (the ``empty`` family: two calls are two buffers),
fp4fuse's local compute ops (``fp4fuse.ops.kernel_table.LOWERABLE_OPS``: quantization, GEMM,
norms), and ``operator.getitem``. Every other call -- a collective, an op that writes to its
input (a KV-cache update), a higher-order op -- is a barrier: nothing before it is merged with
anything after it, so no merge can cross a mutation of what the nodes read. Collectives are never
merged (a merged collective changes what each rank sends, which this pass does not reason about).
A node whose value reaches a graph output, directly or through aliasing ops (``getitem``, an op
whose schema returns an alias ``Tensor(a)``, and ``_unsafe_view`` and ``lift``, which Inductor
lowers to one), keeps its own node and its readers on that path (two outputs that eager returns
as separate tensors must not come back as one buffer); its other readers move to the first equal
node. The pass relies on the graph being functional, which a post-grad graph is when
``post_grad_custom_post_pass`` runs (Inductor reinplaces after it; a mutated graph input is
written back by ``copy_`` into its placeholder): a graph that writes to any other tensor in place
is left alone, with the reason as a skip.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from fp4fuse.ops.kernel_table import LOWERABLE_OPS
from fp4fuse.passes.base import GraphPass
from fp4fuse.patterns import base as pattern_base
from fp4fuse.patterns.base import annotated_args

__all__ = ["CommonSubexpressionPass", "merge_common_subexpressions", "mutated_intermediate"]

QUANT_PATTERN = "scaled_fp4_quant"
OTHER_PATTERN = "other"

_PURE_NAMESPACES = ("aten", "prims")
_IMPURE_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)
# Schemas that return a fresh tensor, but Inductor lowers them to an alias of their first argument.
_UNANNOTATED_ALIASES = (torch.ops.aten._unsafe_view.default, torch.ops.aten.lift.default)


def _uninitialized(target: torch._ops.OpOverload) -> bool:
    """``empty``, ``empty_like``, ``new_empty_strided``, ...: memory whose values are not a function
    of the arguments (and that a later op may fill in place), so two calls are two buffers."""
    return "empty" in target._opname


def _is_pure(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    namespace = target.namespace
    if namespace == "fp4fuse":
        return target._opname in LOWERABLE_OPS
    return (namespace in _PURE_NAMESPACES and not _uninitialized(target)
            and not any(tag in target.tags for tag in _IMPURE_TAGS))


def _key(value: Any, rep: dict[fx.Node, fx.Node]) -> Any:
    """A hashable stand-in for an argument: nodes by their merged representative, containers
    element by element, floats (and the parts of complex numbers) by their bits (NaN equals NaN,
    0.0 differs from -0.0, which ``==`` gets the other way round), other literals by type and
    value."""
    if isinstance(value, fx.Node):
        return ("node", rep.get(value, value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v, rep) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _key(v, rep)) for k, v in value.items()))
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, complex):
        return ("complex", value.real.hex(), value.imag.hex())
    return (type(value).__name__, value)


def _aliased_inputs(node: fx.Node) -> list[Any]:
    """The inputs ``node``'s value may alias: the first argument of ``getitem`` and of
    ``_UNANNOTATED_ALIASES``, the annotated arguments of an op whose schema returns an alias, and
    none of any other node."""
    target = node.target
    if node.op != "call_function" or not node.args:
        return []
    if target is operator.getitem or target in _UNANNOTATED_ALIASES:
        return [node.args[0]]
    if isinstance(target, torch._ops.OpOverload) \
            and any(ret.alias_info is not None for ret in target._schema.returns):
        return annotated_args(node, write=False)
    return []


def _reaching_outputs(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose value reaches a graph output, directly or through ``_aliased_inputs``."""
    reached: set[fx.Node] = set()
    stack = [a for out in graph.find_nodes(op="output") for a in out.all_input_nodes]
    while stack:
        node = stack.pop()
        if node not in reached:
            reached.add(node)
            stack.extend(a for a in _aliased_inputs(node) if isinstance(a, fx.Node))
    return reached


def mutated_intermediate(graph: fx.Graph) -> fx.Node | None:
    """The first node that writes to a tensor other than a graph input (or a view of one), if any.

    Post-grad graphs are functional when fp4fuse's passes run: Inductor reinplaces later, and an
    input the model mutates is written back by ``copy_`` into its placeholder. A merge of two equal
    nodes is only exact if neither is written to afterwards, so a graph that does write to an
    intermediate is not rewritten at all."""
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not node.target._schema.is_mutable:
            continue
        for base in annotated_args(node, write=True):
            while isinstance(base, fx.Node) and base.op == "call_function" and base.args \
                    and isinstance(base.target, torch._ops.OpOverload) and base.target.is_view:
                base = base.args[0]
            if isinstance(base, fx.Node) and base.op != "placeholder":
                return node
    return None


def merge_common_subexpressions(graph: fx.Graph) -> dict[str, int]:
    """Merge equal pure nodes of ``graph`` (module docstring); returns how many nodes were merged
    away, as ``{QUANT_PATTERN: quantizations, OTHER_PATTERN: other nodes}`` (zeros left out).
    A graph with a write to an intermediate (``mutated_intermediate``) is left as it is."""
    if mutated_intermediate(graph) is not None:
        return {}
    return _merge(graph)


def _merge(graph: fx.Graph) -> dict[str, int]:
    """``merge_common_subexpressions`` on a graph known to write to no intermediate."""
    rep: dict[fx.Node, fx.Node] = {}
    seen: dict[Any, fx.Node] = {}
    merged: list[tuple[fx.Node, fx.Node]] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if not _is_pure(node):
            seen.clear()  # a barrier: nothing after it is merged with anything before it
            continue
        try:
            key = (node.target, _key(node.args, rep), _key(node.kwargs, rep))
            first = seen.setdefault(key, node)
        except TypeError:  # an unhashable literal: leave the node alone
            continue
        if first is not node:
            rep[node] = first
            merged.append((node, first))
    kept = _reaching_outputs(graph)  # on such a node, the readers on the path to an output stay
    counts = {QUANT_PATTERN: 0, OTHER_PATTERN: 0}
    for node, first in merged:
        node.replace_all_uses_with(
            first, delete_user_cb=lambda user: node not in kept or (user.op != "output" and user not in kept))
        is_quant = isinstance(node.target, torch._ops.OpOverload) and node.target._opname == QUANT_PATTERN \
            and node.target.namespace == "fp4fuse"
        counts[QUANT_PATTERN if is_quant else OTHER_PATTERN] += 1
    for node, _ in reversed(merged):
        if not node.users:
            graph.erase_node(node)
    return {k: v for k, v in counts.items() if v}


class CommonSubexpressionPass(GraphPass):
    """Merge repeated pure computations (always on; changes no numerics): module docstring."""

    name = "cse"
    source_modules = (pattern_base,)

    def __call__(self, graph: fx.Graph) -> int:
        self.recorder.reset()
        writer = mutated_intermediate(graph)
        if writer is not None:
            self.recorder.skipped(OTHER_PATTERN, writer, f"the graph writes to an intermediate tensor in place "
                                  f"({writer.target}); merging equal computations is only exact in a functional "
                                  f"graph, so none are merged")
            return self.finish()
        for pattern, count in _merge(graph).items():
            self.recorder.matched(pattern, count)
        return self.finish()
