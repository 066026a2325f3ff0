"""``KernelLoweringPass``: fp4fuse's op calls become, inside the compiled graph, the kernels they run.

Inductor calls a custom op from its generated code through the op's Python kernel (dispatcher
entry, validation, backend choice, launcher): tens of microseconds of host time per call, which at
decode sizes is longer than the kernels themselves. This pass replaces each call by the launches
its CUDA kernel would make -- traced from the same function (``fp4fuse.ops.kernel_table``), so the
graph computes what the eager op computes, bit for bit -- as ``triton_kernel_wrapper_functional``
nodes, which Inductor's generated code launches directly (``torch.library.wrap_triton``)::

    before:  out = fp4fuse.mm_fp4(a, b, sa, sb, alpha, bf16)                     # Python per call
    after:   a16 = <dequant kernel>(a, sa); b16 = <dequant kernel>(b, sb)        # M >= DEQUANT_MIN_M
             out = mm(a16, b16.T); out = <alpha kernel>(out, alpha)

             shard = fp4fuse.shard_rows(x, group)        ->  shard = x[r*M/W : (r+1)*M/W]

An ``mm_fp4`` the Hopper Gluon GEMM computes (``fp4fuse.kernels.triton.mm_hopper``) becomes the
activation's decode launch and one call of the internal op ``fp4fuse::_mm_fp4_hopper``, which
builds the Gluon kernel's TMA descriptors (Inductor cannot) and launches it: the public op's
dispatch, validation and kernel choice leave the per-call path, and alpha is folded as below.

An ``mm_fp4`` whose alpha is computed in the graph as ``reciprocal(x * y)`` from two one-element
fp32 tensors -- how an NVFP4 linear forms it from its activation and weight global scales --
gets ``x`` and ``y`` instead, and its epilogue computes the same product and reciprocal with the
division Inductor would have generated (``fp4fuse.kernels.triton.alpha``): one kernel fewer per
linear, bit for bit.

A ``scaled_fp4_quant`` whose global scale is the dynamic scale of fp4fuse's quantizer, computed in
the graph from partial maxima of ``|x|`` (``fp4fuse.passes.dynamic_scale``), gets those maxima
instead, up to ``quant.MAX_MAXIMA`` of them: its launch computes the scale with the graph's
operations and division and writes it for the scale's other readers (the GEMM's alpha), and
Inductor's kernel for the scale goes, bit for bit::

    before:  gs = where(isfinite(v), where(v == 0, 1, reciprocal(v) * 2688), nan)    # Inductor's kernel
             q, s = fp4fuse.scaled_fp4_quant(x, gs)                                   # v from amax(T)
    after:   q, s, gs = <quantization launch>(x, T)

Calls on one input are lowered together, at the first one's place, through the op's sibling
kernel (``kernel_table.sibling_kernel_for``), each output with the bits of its own launch:

* ``scaled_fp4_quant`` calls of one input with different global scales (a checkpoint's static
  activation scales: each of a decoder layer's q/k/v or gate/up projections has its own) become
  one launch (``quant.scaled_fp4_quant_group_triton``);
* ``mm_fp4`` calls on one activation -- one quantization shared by the common-subexpression pass
  (dynamic scales), or quantizations of one input (static scales) -- become, up to 256 rows, one
  launch of up to three GEMMs, each with its own activation, configuration and split
  (``mm_decode.mm_fp4_decode_products``).

An input computed after the first call of its group is moved before it where it is a side-effect
free computation (``base.hoist_before``); otherwise its call is lowered on its own, with the reason.

The decode GEMMs' split-K counters are zeroed once per graph: every such launch needs them zero
and leaves them zero, so after lowering one zeroed buffer is threaded from launch to launch in
graph order (``_share_split_k_counters``), where each launch used to allocate and zero its own.

Argument checks ran when the graph was traced (the ops' fake implementations validate like the
ops do), so nothing is re-checked per call. A call is lowered only where its tensors are on CUDA
and the device's backend is Triton; elsewhere (CPU, the reference backend, flashinfer) it stays an
op call. The launchers pick tile shapes and split counts from the sizes. A dynamic row count (a
batch marked dynamic) is traced symbolically: every choice the launcher makes on it is a
comparison with a range (``mm_fp4``: decode tiles up to 16, 32, 64, 128, 256 rows, dequantize +
cuBLAS above), decided by the size hint and guarded, so the graph serves the counts of that range,
with the grid and allocations symbolic, and a count outside it recompiles (at most one graph per
range). Any other dynamic size, or a count without a hint, keeps the op call, with the reason. So
does a bf16 ``mm_fp4`` above ``DECODE_MAX_M`` rows under Inductor's GEMM autotuning
(``max_autotune`` with a backend besides ATen): its dequantize + cuBLAS path would leave an
``aten.mm`` in the graph, which autotuning could compile into a template with other bits.
``shard_rows`` becomes a slice at this rank's offset: the rank is baked into the graph,
so the pass reads process groups and ``FusionPass.uuid()`` carries this process's rank.

It runs last in the pipeline: the fusion passes match fp4fuse's op calls, which this pass removes.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from fp4fuse.distributed.groups import group_rank_of, group_size_of
from fp4fuse.ops import kernel_table
from fp4fuse.ops.backend import Backend, backend_for
from fp4fuse.passes.base import GraphPass
from fp4fuse.passes import dynamic_scale
from fp4fuse.passes.dynamic_scale import scale_of_maxima
from fp4fuse.patterns import base
from fp4fuse.patterns.base import AliasedWrites, erase_if_unused, fake_value, hoist_before, insert_call, insert_traced

__all__ = ["KernelLoweringPass"]

logger = logging.getLogger(__name__)

aten = torch.ops.aten
_SHARD_ROWS = torch.ops.fp4fuse.shard_rows.default
_MM_FP4 = torch.ops.fp4fuse.mm_fp4.default
_QUANT = torch.ops.fp4fuse.scaled_fp4_quant.default
#: Ops lowered in groups through their sibling kernels, in this order.
_SIBLING_ORDER = ("scaled_fp4_quant", "mm_fp4")
_ALPHA_ARG = 4  # mm_fp4(a, b, a_scale, b_scale, alpha, out_dtype)
_LOWERABLE = {getattr(torch.ops.fp4fuse, name).default: name for name in kernel_table.LOWERABLE_OPS}
# The launchers traced into graphs: their configuration choices decide the graph (Inductor hashes
# the kernels' own source). Located without importing triton, which a CPU install lacks.
# mm_hopper's rule decides which mm_fp4 calls launch the Gluon GEMM through fp4fuse::_mm_fp4_hopper.
_KERNEL_MODULES = ("fp4fuse.kernels.triton.alpha", "fp4fuse.kernels.triton.decode", "fp4fuse.kernels.triton.mm",
                   "fp4fuse.kernels.triton.mm_decode", "fp4fuse.kernels.triton.mm_hopper",
                   "fp4fuse.kernels.triton.quant", "fp4fuse.kernels.triton.norm", "fp4fuse.kernels.triton.norm_quant")


def _ordered_args(node: fx.Node) -> list[Any]:
    """The call's arguments in schema order (positional, keyword or default)."""
    schema = node.target._schema  # type: ignore[union-attr]
    args = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            args.append(node.args[i])
        elif arg.name in node.kwargs:
            args.append(node.kwargs[arg.name])
        else:
            args.append(arg.default_value)
    return args


def _dynamic_size_reason(operands: list[Any]) -> str | None:
    """Why a call on ``operands`` cannot be traced for every size its graph runs at, or None.

    Only a dynamic row count is lowered: dim 0 of the first operand (the activation: ``a``, ``x``,
    or a scale's maxima) and the same count in dim 0 of the others (``a_scale``, a residual). The
    launchers choose tiles and split counts by comparing it with their ranges
    (``fp4fuse.kernels.triton.mm_decode.config_rows``), and each comparison of a symbolic count is
    decided by its size hint and guarded, so the compiled graph runs only at counts that make the
    traced choices (others recompile). A count without a hint (data-dependent) cannot be guarded;
    other dynamic sizes -- a weight's row count N in dim 0 of ``b`` included (a function compiled
    for several weights) -- would change the tile shapes and configurations, which the launchers
    choose for a concrete N (``mm_decode.decode_config_for``)."""
    first = next((op for op in operands if isinstance(op, torch.Tensor)), None)
    rows = first.shape[0] if first is not None and first.dim() > 0 else None
    for operand in operands:
        if not isinstance(operand, torch.Tensor):
            continue
        for dim, size in enumerate(operand.shape):
            if isinstance(size, int):
                continue
            if dim != 0:
                return (f"dynamic size {size} in dim {dim} of a {list(operand.shape)} operand: only a dynamic "
                        "row count (dim 0) is lowered; the op keeps choosing its launch per call")
            if not (isinstance(rows, torch.SymInt) and statically_known_true(size == rows)):
                return (f"dynamic size {size} in dim 0 of a {list(operand.shape)} operand is not the activation's "
                        f"row count ({rows}; a weight's rows marked dynamic, e.g. by automatic dynamic shapes "
                        "when one compiled function serves several weights): only a dynamic row count is lowered; "
                        "the op keeps choosing its launch per call (torch._dynamo.mark_static on the weight lowers it)")
            if free_unbacked_symbols(size):
                return (f"dynamic row count {size} has no size hint (data-dependent): the launch configuration "
                        "cannot be guarded, so the op keeps choosing it per call")
    return None


def _alpha_factors(alpha: Any, device: torch.device) -> tuple[fx.Node, fx.Node] | None:
    """``(x, y)`` where ``alpha`` is ``reciprocal(x * y)`` of two one-element fp32 tensors on
    ``device`` (then the product and reciprocal are the kernel's, exactly), else None."""
    if not base.is_call(alpha, aten.reciprocal.default):
        return None
    product = alpha.args[0]
    if not base.is_call(product, aten.mul.Tensor) or len(product.args) != 2 or product.kwargs:
        return None
    factors = product.args
    for factor in factors:
        val = fake_value(factor) if isinstance(factor, fx.Node) else None
        if not (isinstance(val, torch.Tensor) and val.dtype == torch.float32 and val.numel() == 1
                and val.device == device):
            return None
    return factors[0], factors[1]


def _upper_bound(size: int | torch.SymInt) -> int | None:
    """``size`` itself, or the largest value its symbolic expression can take under the guards
    recorded so far (the lowering's row-range guards bound a decode launch's tile count); None when
    unbounded."""
    if isinstance(size, int):
        return size
    upper = size.node.shape_env.bound_sympy(size.node.expr).upper
    return int(upper) if upper.is_finite else None


def _gemm_backends() -> str:
    from torch._inductor import config

    return str(config.max_autotune_gemm_backends)


def _autotunes_gemms() -> bool:
    """Whether Inductor may compile a graph's ``aten.mm`` as something other than the cuBLAS call
    eager makes: ``max_autotune`` / ``max_autotune_gemm`` with a backend besides ATen."""
    from torch._inductor import config

    backends = {b.strip().upper() for b in _gemm_backends().split(",")}
    return bool(config.max_autotune or config.max_autotune_gemm) and backends != {"ATEN"}


def _autotune_reason(node: fx.Node, call: _Call) -> str | None:
    """Why an ``mm_fp4`` call stays an op call under GEMM autotuning, or None. Above
    ``DECODE_MAX_M`` rows a bf16 product may take dequantize + cuBLAS (``mm.mm_fp4_dequant_mm``),
    whose traced ``aten.mm`` Inductor would then autotune into a template with other bits than the
    eager op's cuBLAS product. At or below, the launchers' row-range guards keep the graph off that
    path, so the row count's size hint decides."""
    if call.op != "mm_fp4" or call.args[5] != torch.bfloat16 or not _autotunes_gemms():
        return None
    from fp4fuse.kernels.triton.mm_decode import DECODE_MAX_M  # the backend is Triton here

    hint = base.size_hint(fake_value(node.args[0]).shape[0])
    if hint is not None and hint <= DECODE_MAX_M:
        return None
    return (f"Inductor autotunes GEMMs (max_autotune with backends {_gemm_backends()}): above {DECODE_MAX_M} "
            "rows the lowered dequantize + cuBLAS product would be an aten.mm Inductor may replace by a "
            "template with other bits than the op's; the op call stays (max_autotune_gemm_backends='ATEN' "
            "lowers it)")


def _inductor_divides_rn() -> bool:
    """Whether Inductor's generated Triton divides fp32 with IEEE rounding (``div_rn``) rather than
    Triton's ``/``: ``eager_numerics.division_rounding`` where this torch has it."""
    from torch._inductor import config

    return bool(getattr(getattr(config, "eager_numerics", None), "division_rounding", False))


@dataclasses.dataclass
class _Call:
    """A call to lower: ``op``'s arguments in schema order (``args``), the positions of graph
    values among them (``slots``), and ``factors``: the two global scales an ``mm_fp4``'s alpha
    (``folded``) is the reciprocal product of (its ``args`` entry then None), or None."""

    op: str
    backend: Backend
    args: list[Any]
    slots: list[int]
    factors: tuple[fx.Node, fx.Node] | None
    folded: fx.Node | None
    div_rn: bool

    @property
    def inputs(self) -> list[fx.Node]:
        """The graph values the launches read, in ``launch_args``'s order."""
        return [self.args[i] for i in self.slots] + list(self.factors or ())

    def launch_args(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The launcher's arguments, given the tensors of ``inputs`` (traced values)."""
        full = list(self.args)
        for i, t in zip(self.slots, tensors):
            full[i] = t
        if self.factors is not None:
            from fp4fuse.kernels.triton.alpha import GlobalScales  # imports triton: lowering only

            full[_ALPHA_ARG] = GlobalScales(*tensors[len(self.slots):], div_rn=self.div_rn)
        return full


def _quantized_input(a: Any, a_scale: Any) -> fx.Node | None:
    """The input ``x`` where ``a`` / ``a_scale`` are outputs 0 / 1 of one ``scaled_fp4_quant(x, gs)``
    call, else None."""
    if not (base.is_call(a, operator.getitem) and base.is_call(a_scale, operator.getitem)):
        return None
    quant = a.args[0]
    if a_scale.args[0] is not quant or (a.args[1], a_scale.args[1]) != (0, 1) or not base.is_call(quant, _QUANT):
        return None
    return base.get_arg(quant, 0, "x")


def _on_cuda(node: fx.Node) -> bool:
    val = fake_value(node.args[0]) if node.args else None
    return isinstance(val, torch.Tensor) and val.device.type == "cuda"


class KernelLoweringPass(GraphPass):
    """Replace fp4fuse op calls on CUDA by their Triton launches (module docstring)."""

    name = "lowering"
    reads_process_groups = True
    source_modules = (kernel_table, base, dynamic_scale)

    def source_files(self) -> list[str]:
        files = super().source_files()
        for module in _KERNEL_MODULES:
            spec = importlib.util.find_spec(module)
            if spec is not None and spec.origin is not None and spec.origin not in files:
                files.append(spec.origin)
        return files

    def __call__(self, graph: fx.Graph) -> int:
        self.recorder.reset()
        lowerable: dict[fx.Node, _Call] = {}
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is _SHARD_ROWS:
                self._lower_shard_rows(node)
            elif node.target in _LOWERABLE:
                call = self._prepare(node, _LOWERABLE[node.target])
                if call is not None:
                    lowerable[node] = call
        keys = {node: key for node, call in lowerable.items() if (key := self._sibling_key(call)) is not None}
        grouped: set[fx.Node] = set()
        # each lowering replaces its node's outputs (a quantization's are a GEMM's operands), so a
        # call's arguments are read again when it is lowered; quantizations go first, so that a
        # group of them puts every quantized activation before the GEMMs that read them
        for op in _SIBLING_ORDER:
            for members, calls in self._sibling_groups({n: k for n, k in keys.items() if k[0] == op}):
                if self._lower_siblings(members, calls):
                    grouped.update(members)
        for node, call in lowerable.items():
            if node not in grouped:
                self._lower_call(node, self._prepare(node, call.op, record=False))
        if lowerable:
            self._share_split_k_counters(graph)
        return self.finish()

    def _prepare(self, node: fx.Node, op: str, record: bool = True) -> _Call | None:
        """What lowering ``node`` takes, or None (with a skip record, where ``record``, that a user
        can act on)."""
        if not _on_cuda(node):
            return None  # CPU graphs keep the op (its reference kernel); not worth a skip record
        backend = backend_for(fake_value(node.args[0]))
        if backend is not Backend.TRITON:
            if record:
                self.recorder.skipped(op, node, f"the device's fp4fuse backend is {backend.value}, not triton")
            return None
        args = _ordered_args(node)
        alpha = args[_ALPHA_ARG] if node.target is _MM_FP4 else None
        factors = _alpha_factors(alpha, fake_value(node.args[0]).device) if alpha is not None else None
        if factors is not None:
            args[_ALPHA_ARG] = None  # the launch gets GlobalScales of the two factors
        call = _Call(op, backend, args, [i for i, a in enumerate(args) if isinstance(a, fx.Node)], factors,
                     alpha if factors is not None else None, _inductor_divides_rn())
        reason = _dynamic_size_reason([fake_value(n) for n in call.inputs]) or _autotune_reason(node, call)
        if reason is not None:
            if record:
                self.recorder.skipped(op, node, reason)
            return None
        return call

    def _lower_call(self, node: fx.Node, call: _Call) -> None:
        if call.op == "scaled_fp4_quant" and self._lower_quant_of_maxima(node, call):
            return
        impl = kernel_table.kernel_for(call.op, call.backend)
        with node.graph.inserting_before(node):
            outputs = self._traced_or_skipped(call.op, node, lambda *tensors: impl(*call.launch_args(tensors)),
                                              call.inputs, "the op call stays")
        if outputs is None:
            return
        self._replace(node, outputs)
        self._record(call)

    def _lower_quant_of_maxima(self, node: fx.Node, call: _Call) -> bool:
        """A ``scaled_fp4_quant(x, gs)`` whose ``gs`` is the dynamic global scale of partial maxima
        ``T`` of ``|x|`` (``dynamic_scale.scale_of_maxima``) with at most ``quant.MAX_MAXIMA``
        elements (a decode-sized activation's row maxima; a symbolic count is guarded): one launch
        computes gs from ``T`` and quantizes (``quant.scaled_fp4_quant_of_maxima_triton``), the
        scale's other readers (the GEMM's alpha) read the gs it writes, and the scale's nodes --
        Inductor's kernel for them -- go. False, with nothing changed, for any other call."""
        from fp4fuse.kernels.triton.quant import MAX_MAXIMA, scaled_fp4_quant_of_maxima_triton

        x, gs = call.args
        match = scale_of_maxima(gs) if isinstance(gs, fx.Node) else None
        if match is None or _dynamic_size_reason([fake_value(match.maxima)]) is not None:
            return False
        if not fake_value(match.maxima).numel() <= MAX_MAXIMA:
            return False
        point = min([node, *gs.users])
        if not (isinstance(x, fx.Node) and x < point):
            return False
        div_rn = call.div_rn
        with node.graph.inserting_before(point):
            outputs = self._traced_or_skipped(
                "global_scale_of_maxima", node, lambda xt, t: scaled_fp4_quant_of_maxima_triton(xt, t, div_rn),
                [x, match.maxima], "the scale keeps its own kernel")
        if outputs is None:
            return False
        q, s, scale = outputs
        gs.replace_all_uses_with(scale)
        self._replace(node, [q, s])
        erase_if_unused(match.nodes)
        self.recorder.matched(call.op)
        self.recorder.matched("global_scale_of_maxima")
        return True

    def _traced_or_skipped(self, key: str, node: fx.Node, fn: Any, inputs: list[fx.Node],
                           consequence: str) -> list[fx.Node] | None:
        """``insert_traced(fn, inputs)`` at the graph's insertion point; None, with the skip recorded
        under ``key`` at ``node`` (the reason and ``consequence``), where a launch of the trace would
        write one tensor through two arguments (``base.refuse_aliased_writes``: nothing inserted)."""
        try:
            return insert_traced(node.graph, fn, inputs)
        except AliasedWrites as exc:
            self.recorder.skipped(key, node, f"{exc}; {consequence}")
            return None

    def _record(self, call: _Call) -> None:
        """Count a lowered call; erase its alpha's product and reciprocal if it folded them and
        nothing else reads them."""
        self.recorder.matched(call.op)
        if call.folded is not None:
            erase_if_unused([call.folded, call.folded.args[0]])
            self.recorder.matched("alpha_from_global_scales")

    @staticmethod
    def _sibling_key(call: _Call) -> tuple | None:
        """What ``call`` must share with another call to be lowered with it through the op's sibling
        kernel (``kernel_table.sibling_kernel_for``), or None where the op has none: a
        quantization's input; a GEMM's output dtype and activation -- the quantized input where
        ``a`` and ``a_scale`` come from one ``scaled_fp4_quant`` call (so the q/k/v GEMMs of one
        input group whether their quantization was shared or each has its own static scale), else
        ``(a, a_scale)`` themselves."""
        if kernel_table.sibling_kernel_for(call.op, call.backend) is None:
            return None
        if call.op == "scaled_fp4_quant":
            return call.op, call.backend, call.args[0]
        a, _, a_scale, _, _, out_dtype = call.args
        source = _quantized_input(a, a_scale)
        return call.op, call.backend, out_dtype, ("quantized", source) if source is not None else (a, a_scale)

    def _sibling_groups(self, keys: dict[fx.Node, tuple]) -> list[tuple[list[fx.Node], list[_Call]]]:
        """Calls to lower together, with their (re-read) arguments: those of one key
        (``_sibling_key``), in graph order, whose inputs exist where the first of them runs (where
        their launch goes) or can be moved there (``_inputs_before``)."""
        by_key: dict[tuple, list[fx.Node]] = {}
        for node, key in keys.items():
            by_key.setdefault(key, []).append(node)
        groups = []
        for members in by_key.values():
            if len(members) < 2:
                continue
            members.sort()  # graph order
            calls = {m: self._prepare(m, keys[m][0], record=False) for m in members}
            ready = [m for m in members if self._inputs_before(m, calls[m].inputs, members)]
            if len(ready) >= 2:
                groups.append((ready, [calls[m] for m in ready]))
        return groups

    def _inputs_before(self, member: fx.Node, inputs: list[fx.Node], members: list[fx.Node]) -> bool:
        """Whether every input of ``member`` exists before the first of ``members`` (where their
        launch goes), after moving there those computed later that can move
        (``base.hoist_before``: side-effect free computations, never a member); records why not."""
        first = members[0]
        for node in inputs:
            if node < first:
                continue
            reason = hoist_before(node, first, keep_out=members)
            if reason is not None:
                op = _LOWERABLE[member.target]
                self.recorder.skipped(f"{op}_siblings", member, (
                    f"{reason}; {first.name} is the first {op} call it would share a launch with, so it is "
                    "lowered on its own"))
                return False
        return True

    def _lower_siblings(self, members: list[fx.Node], calls: list[_Call]) -> bool:
        """One traced call of the op's sibling kernel for ``members`` (at the first one's place);
        an input several members read is one input of the trace (the kernel sees one tensor).
        False (with the reason recorded; each member is then lowered on its own) where a launch of
        the trace would write one tensor through two arguments (``base.refuse_aliased_writes``)."""
        impl = kernel_table.sibling_kernel_for(calls[0].op, calls[0].backend)
        inputs = list(dict.fromkeys(n for call in calls for n in call.inputs))
        index = {n: i for i, n in enumerate(inputs)}

        def launches(*tensors: torch.Tensor) -> Any:
            return impl([call.launch_args([tensors[index[n]] for n in call.inputs]) for call in calls])

        graph = members[0].graph
        with graph.inserting_before(members[0]):
            outputs = self._traced_or_skipped(f"{calls[0].op}_siblings", members[0], launches, inputs,
                                              "each call is lowered on its own")
        if outputs is None:
            return False
        for node, call in zip(members, calls):
            count = len(pytree.tree_leaves(fake_value(node)))
            self._replace(node, outputs[:count])
            outputs = outputs[count:]
            self._record(call)
        self.recorder.matched(f"{calls[0].op}_siblings")
        return True

    def _share_split_k_counters(self, graph: fx.Graph) -> None:
        """One zero fill of split-K counters for the whole graph instead of one per GEMM launch.

        Each decode GEMM launch with more than one K split allocates its counters zeroed
        (``mm_decode.empty_decode_workspace``: a fill per launch). Those kernels leave them zero
        when they finish (``mm_decode.leaves_counters_zero``) and the graph runs its launches in
        order on one stream, so one buffer, zeroed once, serves them all: it is threaded from launch
        to launch (each reads the previous launch's ``count_ptr`` output), which Inductor's
        reinplacing turns into in-place use of one allocation. Sized for the largest launch; a
        launch whose count has no finite upper bound (a row count without a range) keeps its own
        fill."""
        from fp4fuse.kernels.triton.mm_decode import leaves_counters_zero  # imports triton: lowering only

        by_device: dict[Any, list[tuple[fx.Node, fx.Node, int]]] = {}
        for node in graph.find_nodes(op="call_function", target=triton_kernel_wrapper_functional):
            fill = node.kwargs["kwargs"].get("count_ptr")
            if not (leaves_counters_zero(kernel_side_table.get_kernel(node.kwargs["kernel_idx"]))
                    and base.is_call(fill, aten.full.default) and fill.args[1] == 0 and len(fill.users) == 1):
                continue
            bound = _upper_bound(fake_value(fill).shape[0])
            if bound is not None:
                by_device.setdefault(fake_value(fill).device, []).append((node, fill, bound))
        for sites in by_device.values():  # one chain per device: a graph may span several GPUs
            self._thread_counters(graph, sites)

    def _thread_counters(self, graph: fx.Graph, sites: list[tuple[fx.Node, fx.Node, int]]) -> None:
        """``_share_split_k_counters`` for the launches of one device, in graph order:
        ``(launch, its own fill, the fill's size bound)``."""
        if len(sites) < 2:
            return
        first_fill = sites[0][1]
        size = max(bound for *_, bound in sites)
        with graph.inserting_before(first_fill):
            counters = graph.call_function(aten.full.default, ([size], 0), dict(first_fill.kwargs))
        with fake_value(first_fill).fake_mode:  # a factory call: no input carries the fake mode
            counters.meta["val"] = aten.full.default([size], 0, **first_fill.kwargs)
        for i, (node, fill, _) in enumerate(sites):
            node.kwargs = {**node.kwargs, "kwargs": {**node.kwargs["kwargs"], "count_ptr": counters}}
            # the launch's count_ptr output is a new tensor (the functional wrapper's clone, which
            # Inductor's reinplacing removes): a fake of its own, or it would alias the input
            node.meta["val"] = {**node.meta["val"], "count_ptr": fake_value(counters).clone()}
            graph.erase_node(fill)
            if i + 1 < len(sites):
                with graph.inserting_after(node):
                    counters = insert_call(graph, operator.getitem, (node, "count_ptr"))
                self.recorder.matched("split_k_counters_shared")

    @staticmethod
    def _replace(node: fx.Node, outputs: list[fx.Node]) -> None:
        """Point ``node``'s readers at the traced outputs (a tuple-returning op is read through
        ``getitem``) and erase it."""
        if len(outputs) == 1 and not isinstance(fake_value(node), (tuple, list)):
            node.replace_all_uses_with(outputs[0])
        else:
            for user in list(node.users):
                user.replace_all_uses_with(outputs[user.args[1]])
                node.graph.erase_node(user)
        erase_if_unused([node])

    def _lower_shard_rows(self, node: fx.Node) -> None:
        x, group_name = node.args[0], node.args[1]
        try:
            world, rank = group_size_of(group_name), group_rank_of(group_name)
        except (RuntimeError, ValueError, KeyError) as exc:
            self.recorder.skipped("shard_rows", node, f"group {group_name!r} does not resolve here: {exc}")
            return
        rows = fake_value(node).shape[0]
        with node.graph.inserting_before(node):
            shard = insert_call(node.graph, aten.slice.Tensor, (x, 0, rank * rows, (rank + 1) * rows))
        node.replace_all_uses_with(shard)
        erase_if_unused([node])
        self.recorder.matched("shard_rows")
        del world  # the fake implementation already required rows * world == x.shape[0]
