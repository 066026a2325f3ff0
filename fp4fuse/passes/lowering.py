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

An ``mm_fp4`` whose alpha is computed in the graph as ``reciprocal(x * y)`` from two one-element
fp32 tensors -- how an NVFP4 linear forms it from its activation and weight global scales --
gets ``x`` and ``y`` instead, and its epilogue computes the same product and reciprocal with the
division Inductor would have generated (``fp4fuse.kernels.triton.alpha``): one kernel fewer per
linear, bit for bit.

Argument checks ran when the graph was traced (the ops' fake implementations validate like the
ops do), so nothing is re-checked per call. A call is lowered only where its tensors are on CUDA
and the device's backend is Triton; elsewhere (CPU, the reference backend, flashinfer) it stays an
op call. The launchers pick tile shapes and split counts from the sizes. A dynamic row count (a
batch marked dynamic) is traced symbolically: every choice the launcher makes on it is a
comparison with a range (``mm_fp4``: decode tiles up to 16, 32, 64, 128, 256 rows, dequantize +
cuBLAS above), decided by the size hint and guarded, so the graph serves the counts of that range,
with the grid and allocations symbolic, and a count outside it recompiles (at most one graph per
range). Any other dynamic size, or a count without a hint, keeps the op call, with the reason.
``shard_rows`` becomes a slice at this rank's offset: the rank is baked into the graph,
so the pass reads process groups and ``FusionPass.uuid()`` carries this process's rank.

It runs last in the pipeline: the fusion passes match fp4fuse's op calls, which this pass removes.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fp4fuse.distributed.groups import group_rank_of, group_size_of
from fp4fuse.ops import kernel_table
from fp4fuse.ops.backend import Backend, backend_for
from fp4fuse.passes.base import GraphPass
from fp4fuse.patterns import base
from fp4fuse.patterns.base import erase_if_unused, fake_value, insert_call, insert_traced

__all__ = ["KernelLoweringPass"]

logger = logging.getLogger(__name__)

aten = torch.ops.aten
_SHARD_ROWS = torch.ops.fp4fuse.shard_rows.default
_MM_FP4 = torch.ops.fp4fuse.mm_fp4.default
_ALPHA_ARG = 4  # mm_fp4(a, b, a_scale, b_scale, alpha, out_dtype)
_LOWERABLE = {getattr(torch.ops.fp4fuse, name).default: name for name in kernel_table.LOWERABLE_OPS}
# The launchers traced into graphs: their configuration choices decide the graph (Inductor hashes
# the kernels' own source). Located without importing triton, which a CPU install lacks.
_KERNEL_MODULES = ("fp4fuse.kernels.triton.alpha", "fp4fuse.kernels.triton.mm", "fp4fuse.kernels.triton.mm_decode",
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

    Only a dynamic row count (dim 0) is lowered: the launchers choose tiles and split counts by
    comparing it with their ranges (``fp4fuse.kernels.triton.mm_decode.config_rows``), and each
    comparison of a symbolic count is decided by its size hint and guarded, so the compiled graph
    runs only at counts that make the traced choices (others recompile). A count without a hint
    (data-dependent) cannot be guarded; other dynamic sizes would change the tile shapes."""
    for operand in operands:
        if not isinstance(operand, torch.Tensor):
            continue
        for dim, size in enumerate(operand.shape):
            if isinstance(size, int):
                continue
            if dim != 0:
                return (f"dynamic size {size} in dim {dim} of a {list(operand.shape)} operand: only a dynamic "
                        "row count (dim 0) is lowered; the op keeps choosing its launch per call")
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


def _inductor_divides_rn() -> bool:
    """Whether Inductor's generated Triton divides fp32 with IEEE rounding (``div_rn``) rather than
    Triton's ``/``: ``eager_numerics.division_rounding`` where this torch has it."""
    from torch._inductor import config

    return bool(getattr(getattr(config, "eager_numerics", None), "division_rounding", False))


def _on_cuda(node: fx.Node) -> bool:
    val = fake_value(node.args[0]) if node.args else None
    return isinstance(val, torch.Tensor) and val.device.type == "cuda"


class KernelLoweringPass(GraphPass):
    """Replace fp4fuse op calls on CUDA by their Triton launches (module docstring)."""

    name = "lowering"
    reads_process_groups = True
    source_modules = (kernel_table, base)

    def source_files(self) -> list[str]:
        files = super().source_files()
        for module in _KERNEL_MODULES:
            spec = importlib.util.find_spec(module)
            if spec is not None and spec.origin is not None and spec.origin not in files:
                files.append(spec.origin)
        return files

    def __call__(self, graph: fx.Graph) -> int:
        self.recorder.reset()
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is _SHARD_ROWS:
                self._lower_shard_rows(node)
            elif node.target in _LOWERABLE:
                self._lower_op(node, _LOWERABLE[node.target])
        return self.finish()

    def _lower_op(self, node: fx.Node, op: str) -> None:
        if not _on_cuda(node):
            return  # CPU graphs keep the op (its reference kernel); not worth a skip record
        backend = backend_for(fake_value(node.args[0]))
        if backend is not Backend.TRITON:
            self.recorder.skipped(op, node, f"the device's fp4fuse backend is {backend.value}, not triton")
            return
        args = _ordered_args(node)
        alpha = args[_ALPHA_ARG] if node.target is _MM_FP4 else None
        factors = _alpha_factors(alpha, fake_value(node.args[0]).device) if alpha is not None else None
        if factors is not None:
            args[_ALPHA_ARG] = None  # the launch gets GlobalScales of the two factors
        slots = [i for i, a in enumerate(args) if isinstance(a, fx.Node)]
        inputs = [args[i] for i in slots] + list(factors or ())
        reason = _dynamic_size_reason([fake_value(n) for n in inputs])
        if reason is not None:
            self.recorder.skipped(op, node, reason)
            return
        impl = kernel_table.kernel_for(op, backend)
        div_rn = _inductor_divides_rn()

        def launches(*tensors: torch.Tensor) -> Any:
            full = list(args)
            for i, t in zip(slots, tensors):
                full[i] = t
            if factors is not None:
                from fp4fuse.kernels.triton.alpha import GlobalScales  # imports triton: lowering only

                full[_ALPHA_ARG] = GlobalScales(*tensors[len(slots):], div_rn=div_rn)
            return impl(*full)

        with node.graph.inserting_before(node):
            outputs = insert_traced(node.graph, launches, inputs)
        self._replace(node, outputs)
        self.recorder.matched(op)
        if factors is not None:
            erase_if_unused([alpha, alpha.args[0]])
            self.recorder.matched("alpha_from_global_scales")

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
