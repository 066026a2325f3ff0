"""Rank uniformity: which values of a post-grad graph are the same on every rank of a TP group,
and the run-time check of the graph inputs that proof rests on.

A rewrite that moves work from a gathered (replicated) tensor to each rank's shard -- quantize
before the gather, the sequence-parallel norms -- is only equal to the graph it replaces when the
other operands are the same on every rank: the global scale, the norm weight, the residual.
:func:`prove_rank_uniform` walks a value's ancestors:

* constants (ops without tensor inputs) and pure ``aten`` / ``prims`` ops of uniform values are
  uniform *if their literal arguments are the same on every rank*, except the ``empty`` family
  (uninitialized memory differs from rank to rank); so are fp4fuse's pure ops and
  ``operator`` arithmetic on sizes. Dynamo compiles Python numbers into each rank's own graph
  (``torch.full((1,), scale)`` of ``NVFP4Quantizer(global_scale=...)``, a multiplier), and ranks
  may have compiled different ones, so the literal arguments a proof walks (and those of the
  rewritten match itself: a norm's epsilon) are verified with the model state (below);
* an ``all_reduce`` or ``all_gather_into_tensor`` result is uniform over *its own* group, which
  proves it for the TP group only when that group covers the TP group's ranks (same name, or
  resolved with torch.distributed; a name that does not resolve proves nothing);
* ``reduce_scatter``, ``fp4fuse::shard_rows``, random ops and ops of other namespaces may differ
  (their result is rank-local, or nothing says otherwise);
* graph inputs are uniform *if verified*: model state (parameters and buffers the graph does not
  write, constant attributes: replicated by construction) is compared across the group on the
  first call of the compiled graph; per-call inputs (activations, token ids, tensors marked with
  ``torch._dynamo.mark_static_address``, buffers the graph writes) only with ``RankCheck.ALWAYS``,
  on every call. With ``RankCheck.OFF`` model state and literals are trusted unverified and
  per-call inputs are not trusted.

:class:`RankUniformity` (one per pass, :meth:`~RankUniformity.begin` per graph) answers the
patterns' checks and, once the rewrites are done, inserts one ``fp4fuse::check_rank_uniform`` per
TP group whose rewrites rely on graph inputs or literals, right after the graph's inputs::

    before:  w = placeholder; gs = placeholder; ...    after:  w = placeholder; gs = placeholder
                                                               c = full([1], digest of the literals)
                                                               check_rank_uniform([w, gs, c], [ids], names, group, id)
                                                               ...

Which graph inputs are model state is read from the graph's metadata: AOT autograd's input
descriptors (``ParamAOTInput`` / ``BufferAOTInput``) and, under torch.compile, the Dynamo source of
each input (``..._parameters['weight']``, ``..._buffers['input_global_scale']``; not AOT's static
input indices, which also hold ``mark_static_address`` tensors that carry new data every call); an
input the graph writes (``copy_`` back into a buffer) is per-call whatever it is. Source names
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
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils import _pytree as pytree

from fp4fuse.config import RankCheck
from fp4fuse.distributed.groups import resolve_group
from fp4fuse.ops import rank_check as rank_check_op
from fp4fuse.patterns.base import (
    CollectiveKind, annotated_args, decode_collective, fake_value, insert_call, is_call,
)

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


#: The end of a Dynamo source that names a module's parameter or buffer:
#: ``L['self']._modules['norm']._parameters['weight']``, ``..._buffers['input_global_scale']``.
_PARAM_OR_BUFFER_SOURCE = re.compile(r"\._(?:parameters|buffers)\['[^']+'\]$")


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
        found.append((None if source is None else source.name,
                      example.shape if isinstance(example, torch.Tensor) else None))
    return found


def _written_inputs(graph: fx.Graph) -> set[fx.Node]:
    """The graph inputs an op of ``graph`` writes to (``copy_`` back into a mutated input, any op
    whose schema marks the argument as written): their data changes with the calls."""
    written: set[fx.Node] = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        written.update(arg for arg in annotated_args(node, write=True)
                       if isinstance(arg, fx.Node) and arg.op in ("placeholder", "get_attr"))
    return written


def graph_inputs(graph: fx.Graph) -> dict[fx.Node, GraphInput]:
    """Every placeholder and ``get_attr`` of ``graph``, classified (module docstring): model state
    where AOT autograd's descriptor says parameter or buffer, or Dynamo's source names one
    (``..._parameters['w']``, ``..._buffers['b']``), and the graph does not write it. Anything
    else -- a tensor marked with ``torch._dynamo.mark_static_address`` (a static KV cache, an input
    buffer a serving loop refills: in AOT's ``static_input_indices`` like a parameter, yet new data
    every call), a plain tensor attribute, an input whose source is unknown -- is a per-call input."""
    sources = _dynamo_sources()
    written = _written_inputs(graph)
    found: dict[fx.Node, GraphInput] = {}
    for node in graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        kind, source = InputKind.PER_CALL, None
        if getattr(desc, "is_param", lambda: False)() or getattr(desc, "is_buffer", lambda: False)():
            kind, source = InputKind.MODEL_STATE, desc.target
        elif sources is not None and isinstance(getattr(desc, "idx", None), int) and desc.idx < len(sources):
            name, shape = sources[desc.idx]
            val = fake_value(node)
            if name is not None and shape is not None and isinstance(val, torch.Tensor) and len(shape) == val.dim():
                source = _readable_source(name)
                if _PARAM_OR_BUFFER_SOURCE.search(name):
                    kind = InputKind.MODEL_STATE
        if node in written:
            kind = InputKind.PER_CALL
        found[node] = GraphInput(node, kind, source)
    for node in graph.find_nodes(op="get_attr"):
        found[node] = GraphInput(node, InputKind.MODEL_STATE if node not in written else InputKind.PER_CALL,
                                 str(node.target))
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
    """A call of ``target`` on equal inputs gives equal results on every rank (not the ``empty``
    family: uninitialized memory is whatever each rank's allocator hands out)."""
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags or "empty" in target._opname:
            return False
        return target.namespace in ("aten", "prims") or target in _PURE_FP4FUSE_OPS
    return getattr(target, "__module__", None) == operator.getitem.__module__  # getitem, size arithmetic


class _Shown:
    """An argument shown by a fixed text in a literal description."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


_TENSOR, _DEVICE = _Shown("<t>"), _Shown("<device>")


def _describe_literal(value: Any) -> Any:
    """``value`` as it enters a literal description: nodes and devices by a placeholder (every
    rank names its own device), everything else by its exact ``repr`` (floats round-trip)."""
    if isinstance(value, fx.Node):
        return _TENSOR
    if isinstance(value, torch.device):
        return _DEVICE
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.dtype, torch.layout,
                          torch.memory_format)):
        return _Shown(str(value))
    return value


def literal_arguments(node: fx.Node) -> str | None:
    """``op(arguments)`` with the Python values that ``node``'s arguments compiled into this
    rank's graph -- a float (``torch.full((1,), scale)`` of ``NVFP4Quantizer(global_scale=...)``,
    a multiplier, an epsilon), an int, a size, a dtype -- or None if it has none. Tensor arguments
    show as ``<t>``; devices as ``<device>`` (every rank names its own)."""
    leaves = [leaf for leaf in pytree.tree_leaves((node.args, node.kwargs))
              if not isinstance(leaf, (fx.Node, torch.device))]
    if not leaves:
        return None
    args = pytree.tree_map(_describe_literal, tuple(node.args))
    kwargs = pytree.tree_map(_describe_literal, dict(node.kwargs))
    text = ", ".join([*(repr(a) for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
    return f"{getattr(node.target, '__name__', node.target)}({text})"


@dataclasses.dataclass(frozen=True)
class Uniformity:
    """The outcome of :func:`prove_rank_uniform`, or of several (:meth:`RankUniformity.prove`):
    the graph inputs the proof rests on and the literal arguments of the ops it walked
    (``(node name, literal_arguments)``), or why there is none (``reason`` set)."""

    relies_on: tuple[GraphInput, ...] = ()
    constants: tuple[tuple[str, str], ...] = ()
    reason: str | None = None

    def with_literals_of(self, nodes: Sequence[fx.Node]) -> Uniformity:
        """This proof, also relying on the literal arguments of ``nodes`` (collectives and waits
        aside): a rewrite's own constants, e.g. the epsilon of a norm it computes on each shard."""
        constants = dict(self.constants)
        for node in nodes:
            if node.op == "call_function" and decode_collective(node) is None and not is_call(node, c10d.wait_tensor):
                text = literal_arguments(node)
                if text is not None:
                    constants[node.name] = text
        return dataclasses.replace(self, constants=tuple(sorted(constants.items())))


def prove_rank_uniform(node: fx.Node, tp_group: str, inputs: Mapping[fx.Node, GraphInput],
                       mode: RankCheck, literals: dict[fx.Node, str | None] | None = None) -> Uniformity:
    """Whether ``node`` is the same on every rank of ``tp_group`` (module docstring), and on which
    graph inputs and literal arguments that rests (to be verified at run time; none with
    ``RankCheck.OFF``). ``literals``: :func:`literal_arguments` of nodes seen before (filled in)."""
    literals = {} if literals is None else literals
    relies: dict[fx.Node, GraphInput] = {}
    constants: dict[str, str] = {}
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
        # an op of uniform inputs is uniform only if its other arguments are the same on every rank too:
        # a float Dynamo compiled into each rank's graph (torch.full((1,), scale)) may not be
        if mode is not RankCheck.OFF and n not in literals:
            literals[n] = literal_arguments(n)
        text = literals.get(n)
        if text is not None:
            constants[n.name] = text
        stack.extend(n.all_input_nodes)
    return Uniformity(relies_on=tuple(sorted(relies.values(), key=lambda g: g.node)),
                      constants=tuple(sorted(constants.items())))


# --------------------------------------------------------------------------- per pass, per graph


@dataclasses.dataclass(frozen=True)
class RankCheckSite:
    """One inserted ``check_rank_uniform``: its group and the labels of what it verifies (model
    state on the first call, per-call inputs on every call), and ``constants``: the literal
    arguments the rewrites rely on (``node: op(arguments)``), compared as one digest with the model
    state. Plain strings: a pass keeps these after its graph is gone (and Inductor deep-copies
    passes with its config)."""

    group_name: str
    model_state: tuple[str, ...]
    per_call: tuple[str, ...]
    constants: tuple[str, ...] = ()

    @property
    def labels(self) -> list[str]:
        return [*self.model_state, *self.per_call]


@dataclasses.dataclass
class _Relied:
    """What the rewrites over one group rely on, so far."""

    inputs: dict[fx.Node, GraphInput] = dataclasses.field(default_factory=dict)
    constants: dict[str, str] = dataclasses.field(default_factory=dict)


class RankUniformity:
    """The rank-uniformity bookkeeping of one pass (module docstring).

    Per graph: :meth:`begin`, then any number of :meth:`prove` (pure) and :meth:`rely_on` (for
    the proofs of rewrites that fire), then :meth:`insert_checks` and :meth:`end`.
    """

    def __init__(self, mode: RankCheck) -> None:
        self.mode = mode
        self._inputs: dict[fx.Node, GraphInput] = {}
        self._relied: dict[str, _Relied] = {}
        self._literals: dict[fx.Node, str | None] = {}

    def begin(self, graph: fx.Graph) -> None:
        self._inputs = graph_inputs(graph)
        self._relied = {}
        self._literals = {}

    def end(self) -> None:
        """Drop the graph's nodes (nothing of a graph outlives its pass call)."""
        self._inputs = {}
        self._relied = {}
        self._literals = {}

    def prove(self, tp_group: str, values: Sequence[tuple[str, fx.Node]]) -> tuple[str | None, Uniformity]:
        """``(reason, Uniformity())`` if one of ``values`` (``(role, node)`` pairs) may differ
        across the ranks of ``tp_group``; else ``(None, what the proofs rest on)``: graph inputs and
        literal arguments, for :meth:`rely_on`."""
        relies: list[GraphInput] = []
        constants: dict[str, str] = {}
        for role, node in values:
            outcome = prove_rank_uniform(node, tp_group, self._inputs, self.mode, self._literals)
            if outcome.reason is not None:
                return f"the {role} {node.name} may differ across ranks: {outcome.reason}", Uniformity()
            relies.extend(outcome.relies_on)
            constants.update(outcome.constants)
        return None, Uniformity(relies_on=tuple(relies), constants=tuple(sorted(constants.items())))

    def rely_on(self, tp_group: str, proof: Uniformity) -> None:
        """Record that a rewrite over ``tp_group`` fired on the promise that what ``proof`` rests
        on -- graph inputs, literal arguments -- is the same on every rank."""
        if self.mode is RankCheck.OFF or not (proof.relies_on or proof.constants):
            return
        relied = self._relied.setdefault(tp_group, _Relied())
        relied.inputs.update((g.node, g) for g in proof.relies_on)
        relied.constants.update(proof.constants)

    def insert_checks(self, graph: fx.Graph) -> list[RankCheckSite]:
        """One ``fp4fuse::check_rank_uniform`` per group with relied-on inputs or constants, after
        the last graph input it reads (placeholders first, so before every collective of the graph).

        The constants are compared as one tensor, ``full([1], digest)``, appended to the model
        state: the digest of every relied-on literal argument as this rank's graph holds it (a
        float Dynamo compiled in, which another rank may have compiled differently). It is
        verified with the model state, on the first call; where the proofs rely on no model state
        it is the check's first model-state tensor, a new one each call, so every call verifies."""
        sites = []
        placeholders = graph.find_nodes(op="placeholder")
        for group_name, relied in self._relied.items():
            ordered = sorted(relied.inputs.values(), key=lambda g: g.node)
            state = tuple(g for g in ordered if g.kind is InputKind.MODEL_STATE)
            per_call = tuple(g for g in ordered if g.kind is InputKind.PER_CALL)
            anchor = max([*placeholders, *(g.node for g in ordered)])
            labels = [g.label for g in (*state, *per_call)]
            state_nodes = [g.node for g in state]
            constants = tuple(f"{name}: {text}" for name, text in sorted(relied.constants.items()))
            if constants:
                with graph.inserting_after(anchor):
                    anchor = _constants_digest(graph, relied.constants.values(), ordered)
                state_nodes.append(anchor)
                labels.insert(len(state), _constants_label(relied.constants))
            with graph.inserting_after(anchor):
                node = insert_call(graph, rank_check_op.check_rank_uniform, (
                    state_nodes, [g.node for g in per_call],
                    rank_check_op.NAME_SEPARATOR.join(labels), group_name, _check_id(group_name, state, per_call)))
            node.meta["val"] = None
            sites.append(RankCheckSite(group_name, tuple(g.label for g in state), tuple(g.label for g in per_call),
                                       constants))
        return sites


def _constants_digest(graph: fx.Graph, texts: Any, inputs: Sequence[GraphInput]) -> fx.Node:
    """``full([1], d, dtype=int64)`` on the device of the check's tensors: ``d`` < 2**31 from a
    SHA-256 of the sorted literal descriptions (node names left out: equal literals, equal digests)."""
    digest = hashlib.sha256("\n".join(sorted(texts)).encode()).digest()
    value = int.from_bytes(digest[:4], "little") & 0x7FFF_FFFF
    vals = [fake_value(n) for n in (*(g.node for g in inputs), *graph.find_nodes(op="placeholder"))]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    kwargs = {"dtype": torch.int64, "device": device, "pin_memory": False}
    node = graph.call_function(torch.ops.aten.full.default, ([1], value), kwargs)
    fake_mode = torch._guards.detect_fake_mode(tensors)
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = torch.ops.aten.full.default([1], value, **kwargs)
    return node


def _constants_label(constants: Mapping[str, str], shown: int = 3) -> str:
    """How an error names the constants: the count, and the first few (ops without tensor
    arguments first: a constant such as ``full([1], 448.0)`` is the likely one to differ)."""
    ordered = sorted(constants.items(), key=lambda item: (repr(_TENSOR) in item[1], item[0]))
    listed = "; ".join(f"{name}: {text}" for name, text in ordered[:shown])
    more = f"; {len(ordered) - shown} more" if len(ordered) > shown else ""
    return f"the constants compiled into this rank's graph that the rewrites rely on ({listed}{more})"


def _check_id(group_name: str, state: tuple[GraphInput, ...], per_call: tuple[GraphInput, ...]) -> str:
    """The same string on every rank for the same graph: group, and each input's label, shape, dtype
    (no literal values: ranks whose constants differ must still agree on when to verify)."""
    hasher = hashlib.sha256(group_name.encode())
    for g in (*state, *per_call):
        val = fake_value(g.node)
        hasher.update(f"|{g.kind.value}:{g.label}:{getattr(val, 'shape', None)}:{getattr(val, 'dtype', None)}".encode())
    return hasher.hexdigest()[:24]
