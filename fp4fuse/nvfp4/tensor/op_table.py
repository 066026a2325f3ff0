"""The aten override table of :class:`~fp4fuse.nvfp4.tensor.subclass.NVFP4Tensor`.

``OPS`` maps an aten overload to ``handler(func, args, kwargs)``; :func:`implements` fills it
(``fp4fuse.nvfp4.tensor.aten_ops`` registers every handler when the package is imported) and
``NVFP4Tensor.__torch_dispatch__`` reads it. Kept apart from both so neither imports the other.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OPS", "contiguous_strides", "implements"]

Handler = Callable[..., Any]
OPS: dict[torch._ops.OpOverload, Handler] = {}


def implements(*ops: torch._ops.OpOverload) -> Callable[[Handler], Handler]:
    """Register ``fn(func, args, kwargs)`` as the NVFP4Tensor override of each aten op in ``ops``."""
    def register(fn: Handler) -> Handler:
        for op in ops:
            OPS[op] = fn
        return fn
    return register


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (a zero-size dim counts as 1, as torch does)."""
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))
