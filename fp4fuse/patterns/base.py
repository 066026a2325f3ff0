"""Pattern-matcher utilities shared by fp4fuse's passes.

* ``MatchRecorder``: per-pattern match counts (keys ``"pass.pattern"``) and skip reasons, each
  skip logged at DEBUG on the owning pass's logger.
* Node helpers: ``fake_value``, ``is_call``, ``get_arg``; ``QuantCall`` (one ``scaled_fp4_quant``).
* ``FunctionalCollective`` / ``decode_collective`` / ``find_collectives``: the functional
  collectives of a post-grad graph (``_c10d_functional.*`` + ``wait_tensor``), decoded.
* ``token_count_reason``: the shared "token count divisible / at least min_tokens" check, for
  static and symbolic sizes (a symbolic size passes only if the shape env already proves it).
* ``insert_call``: add a call node with its fake ``meta["val"]`` computed.
* ``GraphRewrite``: a rewrite family written as find -> check (reason) -> rewrite on small typed
  match objects (``micro_pipeline_tp`` style), for fusions that need reasons or variants.
* ``aot_trace`` / ``insert_traced``: trace torch code the way post-grad graphs are made, and
  inline it into a graph.
* ``ReplacementPattern`` + ``registration_mode``: ``register_replacement`` patterns (vLLM style)
  whose group name is a constructor argument (a pass registers a group's patterns when it first
  sees the group in a graph) -- never read from global distributed state when a pattern is built.
"""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import enum
import inspect
import logging
import operator
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional
from torch._inductor import pattern_matcher as pm
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.post_grad import remove_noop_ops, view_to_reshape
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from fp4fuse.config import FusionConfig

__all__ = [
    "AliasedWrites", "CollectiveKind", "FunctionalCollective", "GraphRewrite", "MatchRecorder", "QuantCall", "VIEW_OPS",
    "ReplacementPattern", "Skip", "annotated_args", "aot_trace", "decode_collective", "erase_if_unused", "insert_traced",
    "dropped_keyword_argument", "fake_value", "find_collectives", "get_arg", "hoist_before", "insert_call", "is_call",
    "is_schema_default", "is_size_computation", "refuse_aliased_writes", "registration_mode", "replacement_point",
    "shapes_known_equal", "size_hint", "threshold_reason", "token_count_reason",
]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


# --------------------------------------------------------------------------- match bookkeeping


@dataclasses.dataclass(frozen=True)
class Skip:
    """A match that was found and left alone: the pattern key, the anchor node's name, why."""

    key: str
    node: str
    reason: str


class MatchRecorder:
    """Counts and skip reasons of one pass, reset at the start of each call.

    ``reset()`` installs fresh containers, so a ``counts`` dict handed out earlier stays a
    snapshot of its call.
    """

    def __init__(self, pass_name: str, logger: logging.Logger) -> None:
        self.pass_name = pass_name
        self.logger = logger
        self.counts: dict[str, int] = {}
        self.skips: list[Skip] = []

    def key(self, pattern: str) -> str:
        return f"{self.pass_name}.{pattern}"

    def reset(self) -> None:
        self.counts = {}
        self.skips = []

    def matched(self, pattern: str, n: int = 1) -> None:
        key = self.key(pattern)
        self.counts[key] = self.counts.get(key, 0) + n

    def skipped(self, pattern: str, node: fx.Node | None, reason: str) -> None:
        skip = Skip(self.key(pattern), node.name if node is not None else "?", reason)
        self.skips.append(skip)
        self.logger.debug("fp4fuse: skipped %s at node %s: %s", skip.key, skip.node, reason)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


# --------------------------------------------------------------------------- node helpers


def fake_value(node: Any) -> Any:
    """The fake value Inductor / make_fx recorded for ``node`` (None for non-nodes or no meta)."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def size_hint(size: int | torch.SymInt) -> int | None:
    """``size`` itself, or the value of its symbolic expression at the example inputs the graph is
    compiled for (None where the tracer kept none: an unbacked size)."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    return int(hint) if hint is not None else None


def annotated_args(node: fx.Node, write: bool) -> list[Any]:
    """The arguments ``node``'s schema annotates with an alias set (``Tensor(a)``; only written
    ones, ``Tensor(a!)``, if ``write``), lists and tuples flattened (``Tensor(a!)[]``)."""
    found = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is not None and (arg.alias_info.is_write or not write):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            found.extend(value if isinstance(value, (list, tuple)) else [value])
    return found


def shapes_known_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two shapes are provably equal where their sizes may be SymInts (graphs compiled with
    dynamic shapes): an equality the shape environment cannot prove without a new guard counts as
    unequal. SymInts are unhashable, so shapes are compared with this, never in a set or dict."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def is_call(node: Any, *targets: Any) -> bool:
    """``node`` is a call_function to one of ``targets`` (an OpOverload, or a packet for any overload)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    overload_packet = getattr(node.target, "overloadpacket", None)
    return any(node.target is t or (overload_packet is not None and overload_packet is t) for t in targets)


_MISSING = object()


def get_arg(node: fx.Node, index: int, name: str, default: Any = _MISSING) -> Any:
    """Argument ``index`` / keyword ``name`` of a call node."""
    if len(node.args) > index:
        return node.args[index]
    if name in node.kwargs:
        return node.kwargs[name]
    if default is _MISSING:
        raise KeyError(f"{node.format_node()} has no argument {index} / {name!r}")
    return default


@dataclasses.dataclass(frozen=True)
class QuantCall:
    """One ``scaled_fp4_quant(x, global_scale)`` call; ``outputs`` are its readers (``getitem``)."""

    quant: fx.Node
    outputs: tuple[fx.Node, ...]
    global_scale: fx.Node

    @classmethod
    def of(cls, quant: fx.Node) -> "QuantCall":
        return cls(quant, tuple(quant.users), get_arg(quant, 1, "global_scale"))


# --------------------------------------------------------------------------- collectives


class CollectiveKind(enum.Enum):
    ALL_GATHER = "all_gather_into_tensor"
    REDUCE_SCATTER = "reduce_scatter_tensor"
    ALL_REDUCE = "all_reduce"


@dataclasses.dataclass(frozen=True)
class FunctionalCollective:
    """One ``_c10d_functional`` collective (always along dim 0) and its ``wait_tensor``.

    ``group_size`` is None for all_reduce (its schema has no size argument). ``wait`` is None
    when the collective is not consumed by exactly one ``wait_tensor``.
    """

    kind: CollectiveKind
    node: fx.Node
    input: fx.Node
    group_name: str
    group_size: int | None
    reduce_op: str | None
    wait: fx.Node | None


def decode_collective(node: Any) -> FunctionalCollective | None:
    """Decode ``node`` if it is a functional all_gather / reduce_scatter / all_reduce call."""
    if is_call(node, c10d.all_gather_into_tensor):
        kind, op = CollectiveKind.ALL_GATHER, None
        size, name = get_arg(node, 1, "group_size"), get_arg(node, 2, "group_name")
    elif is_call(node, c10d.reduce_scatter_tensor):
        kind, op = CollectiveKind.REDUCE_SCATTER, get_arg(node, 1, "reduce_op")
        size, name = get_arg(node, 2, "group_size"), get_arg(node, 3, "group_name")
    elif is_call(node, c10d.all_reduce):
        kind, op = CollectiveKind.ALL_REDUCE, get_arg(node, 1, "reduce_op")
        size, name = None, get_arg(node, 2, "group_name")
    else:
        return None
    inp = get_arg(node, 0, "input")
    if not isinstance(inp, fx.Node) or not isinstance(name, str):
        return None
    users = list(node.users)
    wait = users[0] if len(users) == 1 and is_call(users[0], c10d.wait_tensor) else None
    return FunctionalCollective(kind, node, inp, name, size, op, wait)


def find_collectives(graph: fx.Graph, kind: CollectiveKind | None = None) -> list[FunctionalCollective]:
    """Every functional collective of ``graph`` (of one ``kind`` if given), in graph order."""
    found = (decode_collective(n) for n in graph.nodes)
    return [c for c in found if c is not None and (kind is None or c.kind is kind)]


# --------------------------------------------------------------------------- size checks


def threshold_reason(rows: Any, min_tokens: int) -> str | None:
    """Why a rewrite over ``rows`` tokens must not fire because they are fewer than ``min_tokens``,
    or None.

    A static count is compared. A symbolic count already bounded by a guard or constraint follows
    it; otherwise its size hint decides, and a guard on the side chosen (``rows >= min_tokens`` or
    ``rows < min_tokens``; ``torch._check`` on a backed size installs one) makes the compiled graph
    serve only sizes of that decision: other sizes recompile into the other graph (vLLM's compile
    ranges). A count without a hint is left alone."""
    if min_tokens <= 0 or statically_known_true(rows >= min_tokens):
        return None
    if isinstance(rows, int) or statically_known_true(rows < min_tokens):
        return f"token count {rows} is below min_tokens={min_tokens}"
    node = rows.node
    if not node.has_hint():
        return f"dynamic token count {rows} has no size hint (unbacked); cannot guard it against min_tokens"
    hint = int(node.hint)
    if hint >= min_tokens:
        torch._check(rows >= min_tokens)
        return None
    torch._check(rows < min_tokens)
    return f"dynamic token count {rows} (hint {hint}) is below min_tokens={min_tokens} (guarded)"


def token_count_reason(rows: Any, group_size: int, min_tokens: int, *, require_divisible: bool) -> str | None:
    """Why a collective over ``rows`` tokens must not be fused, or None if it may be.

    ``rows`` is an int or a SymInt. Divisibility by the group size must be proven by the shape
    environment (``statically_known_true``: a guard or a constraint, e.g. the one the
    sequence-parallel rewrite installed); ``min_tokens`` is decided by :func:`threshold_reason`.
    """
    if require_divisible and not statically_known_true(rows % group_size == 0):
        dynamic, proof = ("", "") if isinstance(rows, int) else ("dynamic ", " (not proven by any guard or constraint)")
        return f"{dynamic}token count {rows} is not divisible by the group size {group_size}{proof}"
    return threshold_reason(rows, min_tokens)


# --------------------------------------------------------------------------- graph editing


def _propagate_fake(target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    vals = fx.map_arg((args, kwargs), fake_value)
    if target is operator.getitem:
        return None if vals[0][0] is None else vals[0][0][vals[0][1]]
    leaves = [v for v in pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    fake_mode = torch._guards.detect_fake_mode(leaves)
    if fake_mode is None:
        return None
    with fake_mode:
        return target(*vals[0], **vals[1])


def insert_call(graph: fx.Graph, target: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any] | None = None) -> fx.Node:
    """``graph.call_function`` at the current insertion point, with ``meta["val"]`` filled in
    by running ``target`` on the arguments' fake values (skipped if they carry none)."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    val = _propagate_fake(target, args, kwargs)
    if val is not None:
        node.meta["val"] = val
    return node


#: Ops that only view their input (packets: every overload, ``view.dtype`` included).
VIEW_OPS = (aten.view, aten.reshape, aten._unsafe_view)


def is_size_computation(node: Any) -> bool:
    """``node`` computes a symbolic size, side-effect free: ``aten.sym_size`` / ``sym_stride`` /
    ``sym_numel`` of a tensor, or Python arithmetic whose recorded value is a SymInt (how a graph
    with dynamic shapes computes the sizes of its views)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if is_call(node, aten.sym_size, aten.sym_stride, aten.sym_numel):
        return True
    return getattr(node.target, "__module__", None) in ("_operator", "operator") and isinstance(
        fake_value(node), torch.SymInt)


def erase_if_unused(nodes: Iterable[fx.Node]) -> int:
    """Erase the given nodes that no longer have users, last first, and then, in turn, the size
    computations (:func:`is_size_computation`) and views that only erased nodes read (side-effect
    free); returns how many nodes went. A dead size read or view left behind would count as an
    extra reader of the tensor it reads (and a fusion that needs a sole reader would refuse)."""
    candidates, erased = set(nodes), 0
    while dead := sorted((n for n in candidates if not n.users), reverse=True):
        for node in dead:
            inputs = node.all_input_nodes
            node.graph.erase_node(node)
            erased += 1
            candidates.discard(node)
            candidates.update(n for n in inputs if is_size_computation(n) or is_call(n, *VIEW_OPS))
    return erased


def replacement_point(match: pm.Match) -> fx.Node:
    """Where ``register_replacement`` inserts a match's replacement: before the match's earliest output node."""
    return min(n for n in match.output_nodes() if isinstance(n, fx.Node))  # fx nodes order by graph position


def hoist_before(node: fx.Node, point: fx.Node, keep_out: Iterable[fx.Node] = ()) -> str | None:
    """Move ``node`` and the ancestors it needs that come after ``point`` to just before ``point``
    (their order kept), so that a replacement inserted there may read ``node``. Only a side-effect
    free, unseeded computation moves (such as a norm weight's ``1 + weight`` that a model computes
    next to its use), never a node of ``keep_out`` (the match's own); returns why not, or None."""
    keep_out = set(keep_out)
    needed: list[fx.Node] = []
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen or n < point:
            continue
        seen.add(n)
        seeded = isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
        if n.op != "call_function" or n in keep_out or n.is_impure() or seeded or n is point:
            return f"{node.name} is computed after the rewrite's insertion point from {n.name}, which cannot move"
        needed.append(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(needed):
        point.prepend(n)
    return None


# --------------------------------------------------------------------------- find -> check -> rewrite

MatchT = TypeVar("MatchT")


class GraphRewrite(abc.ABC, Generic[MatchT]):
    """A family of rewrites over typed matches.

    ``find`` is pure (it reads the graph and returns matches); ``check`` returns the reason a
    match must be left alone, or None; ``rewrite`` inserts the fused node(s), erases what died and
    returns the pattern name to count the rewrite under (a family may have variants). Matches of
    one ``find`` must not overlap, so rewriting one never invalidates another.
    """

    name: ClassVar[str]

    def __init__(self, config: FusionConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def find(self, graph: fx.Graph) -> list[MatchT]:
        """Every candidate in ``graph``, including ones ``check`` will reject."""

    @abc.abstractmethod
    def anchor(self, match: MatchT) -> fx.Node:
        """The node a skip is reported at."""

    @abc.abstractmethod
    def check(self, match: MatchT) -> str | None:
        """Why ``match`` must not be rewritten, or None."""

    @abc.abstractmethod
    def rewrite(self, match: MatchT) -> str:
        """Rewrite ``match``; return the pattern name it counts under."""

    def count(self, match: MatchT) -> int:
        """How many rewrites ``match`` counts as (one, unless a match rewrites several sites)."""
        return 1

    def apply(self, graph: fx.Graph, recorder: MatchRecorder) -> int:
        done = 0
        for match in self.find(graph):
            reason = self.check(match)
            if reason is not None:
                recorder.skipped(self.name, self.anchor(match), reason)
                continue
            n = self.count(match)
            recorder.matched(self.rewrite(match), n)
            done += n
        return done


# --------------------------------------------------------------------------- tracing


def aot_trace(fn: Callable[..., Any], args: Sequence[Any], **_: Any) -> fx.GraphModule:
    """Trace ``fn`` the way Inductor's post-grad graphs are made: AOT autograd (functionalized,
    Inductor decompositions), then ``view_to_reshape`` and no-op removal.

    ``pm.fwd_only`` traces without functionalization, which leaves in-place ops that a post-grad
    graph never has (``F.rms_norm`` decomposes to ``mean(...).add_(eps)``); such a pattern never
    matches. Accepts and ignores register_replacement's extra keywords (``get_decomp_fn``)."""
    captured: list[fx.GraphModule] = []

    def capture(gm: fx.GraphModule, _inputs: Any) -> Any:
        captured.append(gm)
        return make_boxed_func(gm)

    # aot_function also runs what it traced: inside the inputs' fake mode, factory ops stay fake.
    fake_mode = torch._guards.detect_fake_mode(list(args))
    with torch._guards.tracing(None), torch.no_grad(), fake_mode or contextlib.nullcontext():
        aot_function(fn, fw_compiler=capture, decompositions=select_decomp_table())(*args)
    gm = captured[0]
    view_to_reshape(gm)
    remove_noop_ops(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


class AliasedWrites(ValueError):
    """A traced Triton launch writes one tensor through two of its arguments (``insert_traced``)."""


def _storage_of(node: Any) -> Any:
    """What identifies the memory ``node`` (a traced launch's argument) holds: its fake value's
    storage where it has one, else the node itself."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return torch.multiprocessing.reductions.StorageWeakRef(val.untyped_storage())
    return node


def refuse_aliased_writes(graph: fx.Graph) -> None:
    """Raise :class:`AliasedWrites` where a Triton launch of ``graph`` (``triton_kernel_wrapper_functional``)
    writes one tensor, or views of one storage, through two arguments. Functionalization gives every
    written argument a copy of its own and the graph reads one of them afterwards, which the kernel
    may never have written: a wrong result, silently. (torch's analysis of which arguments a kernel
    writes counts a pointer passed into a helper function as written, whether or not it is.)"""
    for node in graph.find_nodes(op="call_function", target=triton_kernel_wrapper_functional):
        kwargs = node.kwargs["kwargs"]
        written: dict[Any, str] = {}
        for name in node.kwargs["tensors_to_clone"]:
            key = _storage_of(kwargs[name])
            if key in written:
                kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
                kernel_name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
                raise AliasedWrites(
                    f"{kernel_name} would write one tensor through both {written[key]} and {name} (torch "
                    "gives each written argument its own copy, so the graph could read one the kernel "
                    "never wrote)")
            written[key] = name


def insert_traced(graph: fx.Graph, fn: Callable[..., Any], inputs: Sequence[fx.Node]) -> list[fx.Node]:
    """Trace ``fn`` on the fake values of ``inputs`` (:func:`aot_trace`: decomposed, lowerable
    ops only) and insert its nodes at ``graph``'s insertion point, each with its fake value
    (computed in the inputs' fake mode, factory ops included); returns the nodes of ``fn``'s
    outputs (a flat list). Raises :class:`AliasedWrites` (:func:`refuse_aliased_writes`), before
    inserting anything, where a Triton launch of the trace writes one tensor through two arguments."""
    vals = [fake_value(n) for n in inputs]
    fake_mode = torch._guards.detect_fake_mode(vals)
    traced = aot_trace(fn, vals)
    refuse_aliased_writes(traced.graph)
    env: dict[fx.Node, fx.Node] = dict(zip(traced.graph.find_nodes(op="placeholder"), inputs))
    outputs: list[fx.Node] = []
    for node in traced.graph.nodes:
        if node.op == "call_function":
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            new = graph.call_function(node.target, args, kwargs)
            with fake_mode:
                new.meta["val"] = node.target(*fx.map_arg(args, fake_value), **fx.map_arg(kwargs, fake_value))
            env[node] = new
        elif node.op == "output":
            outputs = list(pytree.tree_leaves(fx.map_arg(node.args[0], env.__getitem__)))
        elif node.op != "placeholder":
            raise NotImplementedError(f"insert_traced: cannot inline a {node.op} node ({node.format_node()})")
    return outputs


# --------------------------------------------------------------------------- register_replacement


@contextlib.contextmanager
def registration_mode() -> Iterator[FakeTensorMode]:
    """Context for building and registering ``register_replacement`` patterns: a fresh fake mode
    (example inputs cost no memory and need no device), outside any active tracing context."""
    with torch._guards.tracing(None), unset_fake_temporarily(), FakeTensorMode() as mode:
        yield mode


#: Warnings torch raises while fp4fuse traces a pattern or a replacement that are about eager
#: kernels, not about the traced graph. ``F.rms_norm`` with an input and a weight of different
#: dtypes (a bf16 model with fp32 norm weights) warns "Mismatch dtype between input and weight ...
#: Cannot dispatch to fused implementation": eager torch then runs the unfused norm. A traced
#: pattern dispatches no kernel (Inductor generates the norm's code), so the warning says nothing
#: about the user's model -- and the user's own ``F.rms_norm`` call still warns where it is made.
_EAGER_KERNEL_NOTES = ("Mismatch dtype between input and weight",)


@contextlib.contextmanager
def _without_eager_kernel_notes() -> Iterator[None]:
    with warnings.catch_warnings():
        for message in _EAGER_KERNEL_NOTES:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


def _with_signature(method: Callable[..., Any], names: list[str]) -> Callable[..., Any]:
    """A plain function of positional parameters ``names`` calling ``method`` (register_replacement
    reads the argument names from the signature and does not accept every bound method), traced
    by the pattern matcher at registration and at every match without the warnings of
    ``_EAGER_KERNEL_NOTES``."""

    def fn(*args: Any) -> Any:
        with _without_eager_kernel_notes():
            return method(*args)

    fn.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    fn.__name__ = getattr(method, "__name__", "fn")
    return fn


def dropped_keyword_argument(match: pm.Match) -> str | None:
    """Why ``match`` must not be replaced because a matched node passes a keyword argument that
    its pattern node does not, or None.

    Inductor's pattern matcher ignores keyword arguments a node has beyond its pattern node's
    (``_TargetArgsExpr._match`` keeps only the pattern's keys), so a pattern ``add(a, b)`` matches
    ``add(a, b, alpha=2)`` and its replacement, traced without ``alpha``, computes ``a + b``. A
    keyword argument equal to its schema default changes nothing and is allowed; any other is a
    reason to skip. Where this torch's matcher does not expose which pattern node matched which
    graph node (private API, torch 2.11 to 2.13 do), every non-default keyword is one."""
    matched = set(match.nodes)
    pairs = _pattern_node_pairs(match)
    for expr, node in (pairs.items() if pairs is not None else [(None, node) for node in match.nodes]):
        if not isinstance(node, fx.Node) or node not in matched or node.op != "call_function":
            continue
        pattern_keys = expr.kwargs if expr is not None else {}
        for key, value in node.kwargs.items():
            if key in pattern_keys or is_schema_default(node.target, key, value):
                continue
            return (f"{node.name} ({getattr(node.target, '__name__', node.target)}) passes {key}={value!r}, which the "
                    "pattern does not: its replacement would drop it")
    return None


def _pattern_node_pairs(match: pm.Match) -> dict[Any, Any] | None:
    """``{pattern node: graph node}`` of ``match`` for its call patterns (``_TargetArgsExpr``, whose
    ``kwargs`` are the pattern's), or None where this torch's matcher does not expose them."""
    expr_type = getattr(pm, "_TargetArgsExpr", None)
    pairs = getattr(getattr(match, "ctx", None), "pattern_to_node", None)
    if expr_type is None or pairs is None:
        return None
    return {expr: node for expr, node in pairs.items() if isinstance(expr, expr_type)}


def is_schema_default(target: Any, key: str, value: Any) -> bool:
    """``key=value`` is the default of ``target``'s argument ``key`` (False where unknown)."""
    schema = getattr(target, "_schema", None)
    for argument in getattr(schema, "arguments", ()):
        if argument.name == key:
            if not argument.has_default_value():
                return False
            if isinstance(value, fx.Node):
                return False
            try:
                return bool(value == argument.default_value)
            except (TypeError, RuntimeError):
                return False
    return False


class ReplacementPattern(abc.ABC):
    """One ``pm.register_replacement`` pattern: example inputs, search graph, replacement graph.

    A pattern takes its group name (and any size) as constructor arguments; it never reads
    global distributed state. ``check`` returns the reason to skip a structural match (logged
    and recorded) or None to fire. Patterns are traced with :func:`aot_trace` (the form of a
    post-grad graph); a float argument named in :meth:`scalar_workaround` is a wildcard.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def example_inputs(self) -> list[Any]:
        """Tiny example tensors, created inside ``registration_mode()`` (so they are fake)."""

    @abc.abstractmethod
    def pattern(self, *args: Any) -> Any:
        """The subgraph to find, written as eager torch code."""

    @abc.abstractmethod
    def replacement(self, *args: Any) -> Any:
        """What replaces it; same arguments, same outputs."""

    def arg_names(self) -> list[str]:
        """The names of the pattern's arguments (default: :meth:`pattern`'s parameters)."""
        return list(inspect.signature(self.pattern).parameters)

    def scalar_workaround(self) -> dict[str, float]:
        """Float arguments matched as wildcards: name -> the example value traced in their place."""
        return {}

    def check(self, match: pm.Match) -> str | None:
        return None

    def anchor(self, match: pm.Match) -> fx.Node | None:
        """The node a skip is reported at (default: the match's first output)."""
        return next((n for n in match.output_nodes() if n is not None), None)

    def recording_check(self, recorder: MatchRecorder) -> Callable[[pm.Match], bool]:
        """The ``extra_check`` for ``register_replacement``: :func:`dropped_keyword_argument`,
        then :meth:`check`, with every match and every skip (and its reason) recorded under this
        pattern's name."""
        def extra_check(match: pm.Match) -> bool:
            reason = dropped_keyword_argument(match) or self.check(match)
            if reason is not None:
                recorder.skipped(self.name, self.anchor(match), reason)
                return False
            recorder.matched(self.name)
            return True
        return extra_check

    def register(self, pm_pass: pm.PatternMatcherPass, recorder: MatchRecorder) -> None:
        names = self.arg_names()
        with registration_mode():
            pm.register_replacement(
                _with_signature(self.pattern, names), _with_signature(self.replacement, names),
                self.example_inputs(), aot_trace, pm_pass, extra_check=self.recording_check(recorder),
                scalar_workaround=self.scalar_workaround(), skip_duplicates=True,
            )
