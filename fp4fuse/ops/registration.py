"""How fp4fuse's compute ops register their CUDA kernels: on the dispatcher's CUDA key directly.

``torch.library.custom_op(...).register_kernel("cuda")`` wraps the kernel in Python layers that run
on every call: a check that no output aliases an input, a switch for ``torch.library.disable_kernel``
and a Dynamo-disabling frame. An eager decode step calls these ops dozens of times and is
host-bound (benchmarks/bench_host.py; results in benchmarks/results/), so the kernels of the
local compute ops (quantization, GEMM, norms) are registered as plain dispatcher kernels instead,
as ``fp4fuse::check_rank_uniform`` is (fp4fuse.ops.rank_check). Everything else stays
``custom_op``'s: the schema, the fake implementation, the CPU reference (its default kernel) and
the autograd wrapper, which refuses to backpropagate through ops that have no gradient formula.
Every kernel registered here returns new tensors only.

    @cuda_kernel(mm_fp4)
    def _(a, b, a_scale, b_scale, alpha, out_dtype): ...
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["cuda_kernel", "refuse_gradients"]

_CUDA = torch.library.Library("fp4fuse", "IMPL", "CUDA")


def cuda_kernel(op: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register the function as ``op``'s (a ``torch.library.custom_op`` of the
    ``fp4fuse`` namespace) kernel for CUDA tensors."""
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _CUDA.impl(op._name, fn)
        return fn

    return register


def refuse_gradients(op: str, **tensors: torch.Tensor) -> None:
    """RuntimeError naming the first of ``tensors`` that requires a gradient while autograd records.

    For ops defined on the dispatcher directly (``Library.define``, no ``custom_op`` autograd
    layer) that have no gradient formula: without an autograd kernel the dispatcher's fallback would
    only warn on a backward through them and return no gradient, so their kernels call this first.
    Every floating input counts (an fp8 tensor can require a gradient too)."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t.requires_grad:
            raise RuntimeError(f"{op} has no gradient formula, and {name} requires a gradient: the op runs in "
                               "graphs fp4fuse rewrote after autograd; run it under torch.no_grad()")
