"""Which function computes each fp4fuse op on each backend.

One table for the two callers that must agree: the ops' CUDA kernels (eager calls) and
FusionPass's kernel lowering (``fp4fuse.passes.lowering``), which traces the same function into a
compiled graph so Inductor's generated code launches the Triton kernels itself. Both therefore run
the same launches with the same configurations, and a lowered graph computes what the eager op
computes, bit for bit.

    impl = kernel_for("mm_fp4", Backend.TRITON)
    out = impl(a, b, a_scale, b_scale, alpha, out_dtype)      # the op's own argument order

Triton and flashinfer are optional dependencies (a CPU install has neither), so their modules are
imported when a kernel is first looked up, not when fp4fuse is imported.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from fp4fuse.ops.backend import Backend

__all__ = ["LOWERABLE_OPS", "kernel_for", "sibling_kernel_for"]

# (op name, backend) -> (module, function); each function takes the op's arguments in order.
_KERNELS: dict[tuple[str, Backend], tuple[str, str]] = {
    ("scaled_fp4_quant", Backend.REFERENCE): ("fp4fuse.nvfp4.format", "quantize_reference"),
    ("scaled_fp4_quant", Backend.TRITON): ("fp4fuse.kernels.triton.quant", "scaled_fp4_quant_triton"),
    ("scaled_fp4_quant", Backend.FLASHINFER): ("fp4fuse.kernels.flashinfer", "scaled_fp4_quant_flashinfer"),
    ("mm_fp4", Backend.REFERENCE): ("fp4fuse.nvfp4.format", "mm_fp4_reference"),
    ("mm_fp4", Backend.TRITON): ("fp4fuse.kernels.triton.mm", "mm_fp4_triton"),
    ("mm_fp4", Backend.FLASHINFER): ("fp4fuse.kernels.flashinfer", "mm_fp4_flashinfer"),
    ("rms_norm", Backend.REFERENCE): ("fp4fuse.nvfp4.norms", "rms_norm_reference"),
    ("rms_norm", Backend.TRITON): ("fp4fuse.kernels.triton.norm", "rms_norm_triton"),
    ("fused_add_rms_norm", Backend.REFERENCE): ("fp4fuse.nvfp4.norms", "fused_add_rms_norm_reference"),
    ("fused_add_rms_norm", Backend.TRITON): ("fp4fuse.kernels.triton.norm", "fused_add_rms_norm_triton"),
    ("rms_norm_fp4_quant", Backend.REFERENCE): ("fp4fuse.nvfp4.norms", "rms_norm_fp4_quant_reference"),
    ("rms_norm_fp4_quant", Backend.TRITON): ("fp4fuse.kernels.triton.norm_quant", "rms_norm_fp4_quant_triton"),
    ("fused_add_rms_norm_fp4_quant", Backend.REFERENCE):
        ("fp4fuse.nvfp4.norms", "fused_add_rms_norm_fp4_quant_reference"),
    ("fused_add_rms_norm_fp4_quant", Backend.TRITON):
        ("fp4fuse.kernels.triton.norm_quant", "fused_add_rms_norm_fp4_quant_triton"),
}

#: Ops whose Triton implementation can be traced into a compiled graph (plain Triton launches and
#: torch ops on their arguments, no host synchronisation).
LOWERABLE_OPS: frozenset[str] = frozenset(op for op, backend in _KERNELS if backend is Backend.TRITON)


# (op name, backend) -> (module, function) computing several calls of the op, bit for bit the calls,
# in fewer launches where they share an operand or a shape: ``fn([args, ...]) -> [outputs, ...]``,
# each ``args`` the op's arguments in order (``mm_fp4``: products of activations of one shape, one
# output dtype; ``scaled_fp4_quant``: quantizations of one input with their own global scales).
_SIBLING_KERNELS: dict[tuple[str, Backend], tuple[str, str]] = {
    ("mm_fp4", Backend.TRITON): ("fp4fuse.kernels.triton.mm", "mm_fp4_calls_triton"),
    ("scaled_fp4_quant", Backend.TRITON): ("fp4fuse.kernels.triton.quant", "scaled_fp4_quant_calls_triton"),
}

# A backend with no kernel of its own for an op uses this one's (flashinfer has no norms).
_FALLBACK = {Backend.FLASHINFER: Backend.TRITON}


def _resolve(entry: tuple[str, str]) -> Callable[..., Any]:
    """A table entry ``(module, function)`` -> the function (imported on first use)."""
    module, name = entry
    return getattr(importlib.import_module(module), name)


@functools.cache
def kernel_for(op: str, backend: Backend) -> Callable[..., Any]:
    """The function computing ``fp4fuse::<op>`` on ``backend`` (looked up once per pair: every
    eager op call asks)."""
    entry = _KERNELS.get((op, backend)) or _KERNELS.get((op, _FALLBACK.get(backend)))
    if entry is None:
        raise KeyError(f"fp4fuse: no {backend.value} kernel registered for op {op!r}")
    return _resolve(entry)


@functools.cache
def sibling_kernel_for(op: str, backend: Backend) -> Callable[..., Any] | None:
    """The function computing several ``fp4fuse::<op>`` calls at once on ``backend``
    (``_SIBLING_KERNELS``), or None where there is none."""
    entry = _SIBLING_KERNELS.get((op, backend))
    return None if entry is None else _resolve(entry)
