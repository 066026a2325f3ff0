"""Rank uniformity: which values of a post-grad graph are the same on every rank of a TP group,
and the run-time check of the graph inputs that proof rests on.

A rewrite that moves work from a gathered (replicated) tensor to each rank's shard -- quantize
before the gather, the sequence-parallel norms -- is only equal to the graph it replaces when the
other operands are the same on every rank: the global scale, the norm weight, the residual.
:func:`prove_rank_uniform` walks a value's ancestors:

* constants (ops without tensor inputs) and pure ``aten`` / ``prims`` ops of uniform values are
  uniform; so are fp4fuse's pure ops and ``operator`` arithmetic on sizes;
* an ``all_reduce`` or ``all_gather_into_tensor`` result is uniform over *its own* group, which
  proves it for the TP group only when that group covers the TP group's ranks (same name, or
  resolved with torch.distributed; a name that does not resolve proves nothing);
* ``reduce_scatter``, ``fp4fuse::shard_rows``, random ops and ops of other namespaces may differ
  (their result is rank-local, or nothing says otherwise);
* graph inputs are uniform *if verified*: model state (parameters, buffers, constant attributes:
  replicated by construction) is compared across the group on the first call of the compiled
  graph; per-call inputs (activations, token ids) only with ``RankCheck.ALWAYS``, on every call.
  With ``RankCheck.OFF`` model state is trusted unverified and per-call inputs are not trusted.

:class:`RankUniformity` (one per pass, :meth:`~RankUniformity.begin` per graph) answers the
patterns' checks and, once the rewrites are done, inserts one ``fp4fuse::check_rank_uniform`` per
TP group whose rewrites rely on graph inputs, right after the graph's inputs::

    before:  w = placeholder; gs = placeholder; ...        after:  w = placeholder; gs = placeholder
                                                                   check_rank_uniform([w, gs], [ids], names, group, id)
                                                                   ...

Which graph inputs are model state is read from the graph's metadata: AOT autograd's input
descriptors (``ParamAOTInput`` / ``BufferAOTInput``) and, under torch.compile, the static input
indices of the active tracing context (Dynamo marks parameters and buffers static). Source names
(``L['self'].layers[0].input_norm.weight``) come from the descriptors or, when the pass runs inside
Dynamo's compile, from Dynamo's graph arguments; elsewhere errors name the placeholder only.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import operator
import re
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from fp4fuse.config import RankCheck
from fp4fuse.distributed.groups import resolve_group
from fp4fuse.ops import rank_check as rank_check_op
from fp4fuse.patterns.base import CollectiveKind, decode_collective, fake_value, insert_call, is_call

__all__ = [
    "GraphInput", "InputKind", "RankUniformity", "Uniformity", "graph_inputs", "group_covers",
    "prove_rank_uniform",
]

logger = logging.getLogger(__name__)

c10d = torch.ops._c10d_functional
fp4 = torch.ops.fp4fuse
_PURE_FP4FUSE_OPS = frozenset({
    fp4.scaled_fp4_quant.default, fp4.mm_fp4.default, fp4.rms_norm.default, fp4.fused_add_rms_norm.default,
    fp4.rms_norm_fp4_quant.default, fp4.fused_add_rms_norm_fp4_quant.default,
})
_UNIFORM_COLLECTIVES = (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER)


class InputKind(enum.Enum):
    MODEL_STATE = "model state"      # a parameter, buffer or constant attribute
    PER_CALL = "per-call input"      # anything else passed to the graph


@dataclasses.dataclass(frozen=True)
class GraphInput:
    """A placeholder or ``get_attr`` node, what it is, and where it came from (if known)."""

    node: fx.Node
    kind: InputKind
    source: str | None = None

    @property
    def label(self) -> str:
        return self.node.name if self.source is None else f"{self.node.name} ({self.source})"


# --------------------------------------------------------------------------- graph inputs


_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")


def _readable_source(name: str) -> str:
    """``L['self']._modules['layers']._modules['0']._parameters['w']`` -> ``L['self'].layers[0].w``."""
    return _SOURCE_PART.sub(lambda m: f"[{m[1]}]" if m[1].isdigit() else f".{m[1]}", name)


def _static_input_indices() -> frozenset[int]:
    """Positions of parameters and buffers among the inputs of the graph torch.compile is
    compiling now (empty outside a tracing context)."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    return frozenset(getattr(metadata, "static_input_indices", None) or ())


def _dynamo_sources() -> list[tuple[str | None, torch.Size | None]] | None:
    """(source name, shape) of each input of the graph Dynamo is compiling now, in order; None
    when the pass does not run inside Dynamo's compile (an FX-cache hit never runs it)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        return None
    if tx is None:
        return None
    found = []
    for node in tx.output.graph.find_nodes(op="placeholder"):
        source = getattr(node, "_dynamo_source", None)
        example = node.meta.get("example_value")
        found.append((None if source is None else _readable_source(source.name),
                      example.shape if isinstance(example, torch.Tensor) else None))
    return found


def graph_inputs(graph: fx.Graph) -> dict[fx.Node, GraphInput]:
    """Every placeholder and ``get_attr`` of ``graph``, classified (module docstring)."""
    static = _static_input_indices()
    sources = _dynamo_sources()
    found: dict[fx.Node, GraphInput] = {}
    for position, node in enumerate(graph.find_nodes(op="placeholder")):
        desc = node.meta.get("desc")
        kind = InputKind.MODEL_STATE if position in static else InputKind.PER_CALL
        source = None
        if getattr(desc, "is_param", lambda: False)() or getattr(desc, "is_buffer", lambda: False)():
            kind, source = InputKind.MODEL_STATE, desc.target
        elif sources is not None and isinstance(getattr(desc, "idx", None), int) and desc.idx < len(sources):
            name, shape = sources[desc.idx]
            val = fake_value(node)
            if shape is not None and isinstance(val, torch.Tensor) and len(shape) == val.dim():
                source = name
        found[node] = GraphInput(node, kind, source)
    for node in graph.find_nodes(op="get_attr"):
        found[node] = GraphInput(node, InputKind.MODEL_STATE, str(node.target))
    return found


# --------------------------------------------------------------------------- proofs


def group_covers(group_name: str, tp_group: str) -> str | None:
    """Why a collective over ``group_name`` does not prove a value uniform over ``tp_group``, or None."""
    if group_name == tp_group:
        return None
    try:
        ranks = set(dist.get_process_group_ranks(resolve_group(group_name)))
        tp_ranks = set(dist.get_process_group_ranks(resolve_group(tp_group)))
    except (RuntimeError, ValueError, KeyError) as err:
        return f"its group {group_name!r} or the TP group {tp_group!r} does not resolve in this process ({err})"
    if tp_ranks <= ranks:
        return None
    return (f"its group {group_name!r} (ranks {sorted(ranks)}) does not cover the TP group {tp_group!r} "
            f"(ranks {sorted(tp_ranks)})")


def _rank_independent(target: object) -> bool:
    """A call of ``target`` on equal inputs gives equal results on every rank."""
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags:
            return False
        return target.namespace in ("aten", "prims") or target in _PURE_FP4FUSE_OPS
    return getattr(target, "__module__", None) == operator.getitem.__module__  # getitem, size arithmetic


@dataclasses.dataclass(frozen=True)
class Uniformity:
    """The outcome of :func:`prove_rank_uniform`: the graph inputs the proof rests on, or why
    there is none (``reason`` set)."""

    relies_on: tuple[GraphInput, ...] = ()
    reason: str | None = None


def prove_rank_uniform(node: fx.Node, tp_group: str, inputs: Mapping[fx.Node, GraphInput],
                       mode: RankCheck) -> Uniformity:
    """Whether ``node`` is the same on every rank of ``tp_group`` (module docstring), and on which
    graph inputs that rests (to be verified at run time; none with ``RankCheck.OFF``)."""
    relies: dict[fx.Node, GraphInput] = {}
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            graph_input = inputs.get(n, GraphInput(n, InputKind.PER_CALL))
            if graph_input.kind is InputKind.PER_CALL and mode is not RankCheck.ALWAYS:
                return Uniformity(reason=(
                    f"it depends on {graph_input.label}, a per-call graph input, whose values are compared "
                    "across ranks only with rank_check='always' (FP4FUSE_RANK_CHECK=always)"))
            if mode is not RankCheck.OFF:
                relies[n] = graph_input
            continue
        if n.op != "call_function":
            return Uniformity(reason=f"it depends on {n.name}, a {n.op} node")
        collective = decode_collective(n)
        if collective is not None:
            if collective.kind not in _UNIFORM_COLLECTIVES:
                return Uniformity(reason=f"it depends on {collective.kind.value} {n.name}, whose result is rank-local")
            why = group_covers(collective.group_name, tp_group)
            if why is not None:
                return Uniformity(reason=f"it depends on {collective.kind.value} {n.name}, and {why}")
            continue
        if not (is_call(n, c10d.wait_tensor) or _rank_independent(n.target)):
            return Uniformity(reason=(f"it depends on {n.name} ({getattr(n.target, '__name__', n.target)}), which "
                                      "is not known to give the same result on every rank"))
        stack.extend(n.all_input_nodes)
    return Uniformity(relies_on=tuple(sorted(relies.values(), key=lambda g: g.node)))


# --------------------------------------------------------------------------- per pass, per graph


@dataclasses.dataclass(frozen=True)
class RankCheckSite:
    """One inserted ``check_rank_uniform``: its group and the labels of what it verifies (model
    state on the first call, per-call inputs on every call). Plain strings: a pass keeps these
    after its graph is gone (and Inductor deep-copies passes with its config)."""

    group_name: str
    model_state: tuple[str, ...]
    per_call: tuple[str, ...]

    @property
    def labels(self) -> list[str]:
        return [*self.model_state, *self.per_call]


class RankUniformity:
    """The rank-uniformity bookkeeping of one pass (module docstring).

    Per graph: :meth:`begin`, then any number of :meth:`prove` (pure) and :meth:`rely_on` (for
    the proofs of rewrites that fire), then :meth:`insert_checks` and :meth:`end`.
    """

    def __init__(self, mode: RankCheck) -> None:
        self.mode = mode
        self._inputs: dict[fx.Node, GraphInput] = {}
        self._relied: dict[str, dict[fx.Node, GraphInput]] = {}

    def begin(self, graph: fx.Graph) -> None:
        self._inputs = graph_inputs(graph)
        self._relied = {}

    def end(self) -> None:
        """Drop the graph's nodes (nothing of a graph outlives its pass call)."""
        self._inputs = {}
        self._relied = {}

    def prove(self, tp_group: str, values: Sequence[tuple[str, fx.Node]]) -> tuple[str | None, tuple[GraphInput, ...]]:
        """``(reason, ())`` if one of ``values`` (``(role, node)`` pairs) may differ across the
        ranks of ``tp_group``; else ``(None, the graph inputs the proofs rest on)``."""
        relies: list[GraphInput] = []
        for role, node in values:
            outcome = prove_rank_uniform(node, tp_group, self._inputs, self.mode)
            if outcome.reason is not None:
                return f"the {role} {node.name} may differ across ranks: {outcome.reason}", ()
            relies.extend(outcome.relies_on)
        return None, tuple(relies)

    def rely_on(self, tp_group: str, inputs: tuple[GraphInput, ...]) -> None:
        """Record that a rewrite over ``tp_group`` fired on the promise that ``inputs`` are uniform."""
        if inputs:
            self._relied.setdefault(tp_group, {}).update((g.node, g) for g in inputs)

    def insert_checks(self, graph: fx.Graph) -> list[RankCheckSite]:
        """One ``fp4fuse::check_rank_uniform`` per group with relied-on inputs, after the last
        graph input it reads (placeholders first, so before every collective of the graph)."""
        sites = []
        placeholders = graph.find_nodes(op="placeholder")
        for group_name, relied in self._relied.items():
            ordered = sorted(relied.values(), key=lambda g: g.node)
            state = tuple(g for g in ordered if g.kind is InputKind.MODEL_STATE)
            per_call = tuple(g for g in ordered if g.kind is InputKind.PER_CALL)
            anchor = max([*placeholders, *(g.node for g in ordered)])
            labels = [g.label for g in (*state, *per_call)]
            with graph.inserting_after(anchor):
                node = insert_call(graph, rank_check_op.check_rank_uniform, (
                    [g.node for g in state], [g.node for g in per_call],
                    rank_check_op.NAME_SEPARATOR.join(labels), group_name, _check_id(group_name, state, per_call)))
            node.meta["val"] = None
            sites.append(RankCheckSite(group_name, tuple(g.label for g in state), tuple(g.label for g in per_call)))
        return sites


def _check_id(group_name: str, state: tuple[GraphInput, ...], per_call: tuple[GraphInput, ...]) -> str:
    """The same string on every rank for the same graph: group, and each input's label, shape, dtype."""
    hasher = hashlib.sha256(group_name.encode())
    for g in (*state, *per_call):
        val = fake_value(g.node)
        hasher.update(f"|{g.kind.value}:{g.label}:{getattr(val, 'shape', None)}:{getattr(val, 'dtype', None)}".encode())
    return hasher.hexdigest()[:24]
