"""How fp4fuse's launchers launch a Triton kernel: directly in eager code, through
``torch.library.wrap_triton`` while a dispatcher-based tracer (make_fx / AOT autograd, as in
``fp4fuse.passes.lowering``) records the call.

``wrap_triton`` is what makes a launch traceable: under a tracer it becomes a
``triton_kernel_wrapper_*`` node that Inductor's generated code launches itself. Outside one it still
dispatches the launch through that higher-order op's eager implementation, which costs hundreds of
microseconds of host time per launch; a plain ``kernel[grid](...)`` costs tens.

    traceable(_quant_kernel)[grid](x, ..., BLOCKS=128, num_warps=4)
"""
from __future__ import annotations

from typing import Any

from torch.library import wrap_triton
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["traceable"]


def traceable(kernel: Any) -> Any:
    """``kernel`` itself, or ``wrap_triton(kernel)`` when a dispatch mode (a tracer) is active."""
    return wrap_triton(kernel) if _get_current_dispatch_mode() is not None else kernel
