"""The aten overrides of :class:`fp4fuse.nvfp4.tensor.subclass.NVFP4Tensor` (the ops FSDP2 and DCP use).

Each handler takes ``(func, args, kwargs)`` as ``__torch_dispatch__`` received them. Row ranges and
contiguous reshapes stay NVFP4Tensor views (inner tensors are views, ``amax`` is shared); a dtype
change or a matmul dequantizes to a plain tensor. A logical view that would split a 16-element block
or reorder the payload raises ``NotImplementedError`` saying why.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.nvfp4.tensor.op_table import contiguous_strides, implements
from fp4fuse.nvfp4.tensor.subclass import NVFP4Tensor

__all__: list[str] = []

logger = logging.getLogger(__name__)

aten = torch.ops.aten
_BLOCK = nvfp4.BLOCK_SIZE


def _inner_shapes(shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """qdata and scale shapes of an NVFP4Tensor of logical ``shape`` (last dim % 16 == 0)."""
    if len(shape) == 0 or shape[-1] % _BLOCK != 0:
        raise NotImplementedError(
            f"NVFP4Tensor: logical shape {tuple(shape)} cannot be represented: the last dim must be "
            f"a multiple of {_BLOCK} so that every 16-element block keeps its one scale")
    lead = tuple(shape[:-1])
    return (*lead, shape[-1] // 2), (*lead, shape[-1] // _BLOCK)


def _resolve_shape(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    shape = [int(s) for s in shape]
    if shape.count(-1) == 1:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        shape[shape.index(-1)] = numel // known if known else 0
    return tuple(shape)


def _reshape(t: NVFP4Tensor, shape: Sequence[int]) -> NVFP4Tensor:
    """A view of ``t`` with a new contiguous logical shape (same element order)."""
    shape = _resolve_shape(shape, t.numel())
    if torch.Size(shape).numel() != t.numel():
        raise RuntimeError(f"NVFP4Tensor: shape {shape} is invalid for {t.numel()} elements")
    q_shape, s_shape = _inner_shapes(shape)
    if not (t.qdata.is_contiguous() and t.scale.is_contiguous()):
        raise NotImplementedError("NVFP4Tensor: reshaping needs contiguous qdata and scale")
    return t._replace(qdata=t.qdata.view(q_shape), scale=t.scale.view(s_shape))


def _rows(t: NVFP4Tensor, start: int, end: int) -> NVFP4Tensor:
    """Rows ``[start, end)`` on dim 0 as a view (amax shared with ``t``)."""
    if t.dim() == 1:
        if start % _BLOCK or end % _BLOCK:
            raise NotImplementedError(f"NVFP4Tensor: a 1-D slice [{start}:{end}] must start and end "
                                      f"on {_BLOCK}-element block boundaries")
        return t._replace(qdata=t.qdata[start // 2:end // 2], scale=t.scale[start // _BLOCK:end // _BLOCK])
    return t._replace(qdata=t.qdata[start:end], scale=t.scale[start:end])


def _check_dim0(t: NVFP4Tensor, dim: int, what: str) -> None:
    if dim % max(t.dim(), 1) != 0:
        raise NotImplementedError(f"NVFP4Tensor: {what} supports dim 0 only (rows), got dim {dim} "
                                  f"of shape {tuple(t.shape)}")


@implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    return args[0]._map_data(func)


@implements(aten.clone.default)
def _clone(func, args, kwargs):
    return args[0]._map_data(lambda x: x.clone())


@implements(aten.view.default)
def _view(func, args, kwargs):
    return _reshape(args[0], args[1])


@implements(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    t, size, stride = args[0], tuple(args[1]), tuple(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset") or 0
    if stride != contiguous_strides(size) or offset % _BLOCK:
        raise NotImplementedError(
            f"NVFP4Tensor: as_strided(size={size}, stride={stride}, storage_offset={offset}) is not a "
            f"contiguous block-aligned window; only identity/narrow-like calls are supported")
    flat = _reshape(t, (-1,))
    end = offset + torch.Size(size).numel()
    if end > t.numel():
        raise RuntimeError(f"NVFP4Tensor: as_strided window [{offset}, {end}) exceeds {t.numel()} elements")
    return _reshape(_rows(flat, offset, end), size)


@implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    t = args[0]
    dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
    _check_dim0(t, dim, "slice")
    if step != 1:
        raise NotImplementedError(f"NVFP4Tensor: slice with step {step} is not supported")
    start, end, _ = slice(start, end).indices(t.shape[0])
    return _rows(t, start, max(start, end))


@implements(aten.split.Tensor)
def _split(func, args, kwargs):
    t, split_size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    _check_dim0(t, dim, "split")
    n = t.shape[0]
    return [_rows(t, s, min(s + split_size, n)) for s in range(0, n, split_size)] or [_rows(t, 0, 0)]


@implements(aten.split_with_sizes.default)
def _split_with_sizes(func, args, kwargs):
    t, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    _check_dim0(t, dim, "split_with_sizes")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [_rows(t, s, s + n) for s, n in zip(starts, sizes)]


def _new_like(t: NVFP4Tensor, shape: Sequence[int], dtype: torch.dtype | None, device: Any,
              fill: bool) -> torch.Tensor:
    """An NVFP4Tensor of ``shape`` (zeros if ``fill``), amax copied from ``t``; a plain tensor
    when another dtype is asked for."""
    device = device or t.device
    if dtype is not None and dtype != t.dtype:
        make = torch.zeros if fill else torch.empty
        return make(tuple(shape), dtype=dtype, device=device)
    q_shape, s_shape = _inner_shapes(shape)
    make = torch.zeros if fill else torch.empty
    return t._replace(qdata=make(q_shape, dtype=torch.uint8, device=device),
                      scale=make(s_shape, dtype=torch.float8_e4m3fn, device=device),
                      amax=t.amax.to(device=device, copy=True))


@implements(aten.new_zeros.default)
def _new_zeros(func, args, kwargs):
    return _new_like(args[0], args[1], kwargs.get("dtype"), kwargs.get("device"), fill=True)


@implements(aten.new_empty.default)
def _new_empty(func, args, kwargs):
    return _new_like(args[0], args[1], kwargs.get("dtype"), kwargs.get("device"), fill=False)


@implements(aten.empty_like.default)
def _empty_like(func, args, kwargs):
    return _new_like(args[0], args[0].shape, kwargs.get("dtype"), kwargs.get("device"), fill=False)


@implements(aten.zeros_like.default)
def _zeros_like(func, args, kwargs):
    return _new_like(args[0], args[0].shape, kwargs.get("dtype"), kwargs.get("device"), fill=True)


@implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    if isinstance(dst, NVFP4Tensor) and isinstance(src, NVFP4Tensor):
        if dst.shape != src.shape:
            raise RuntimeError(f"NVFP4Tensor.copy_: shape {tuple(src.shape)} into {tuple(dst.shape)}")
        for name in dst.tensor_data_names:
            getattr(dst, name).copy_(getattr(src, name), non_blocking)
        return dst
    if isinstance(src, NVFP4Tensor):
        return dst.copy_(src.dequantize(), non_blocking)
    raise NotImplementedError(
        f"NVFP4Tensor.copy_ from a plain {type(src).__name__} would requantize; build a new tensor "
        f"with NVFP4Tensor.from_hp instead")


@implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    t = args[0]
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != t.dtype:
        return t.dequantize().to(dtype=dtype, device=kwargs.get("device") or t.device)
    device = kwargs.get("device") or t.device
    pin = bool(kwargs.get("pin_memory"))
    non_blocking = bool(kwargs.get("non_blocking"))

    def move(x: torch.Tensor) -> torch.Tensor:
        y = x.to(device=device, non_blocking=non_blocking, copy=True)
        return y.pin_memory() if pin else y
    return t._map_data(move)


@implements(aten._pin_memory.default)
def _pin_memory(func, args, kwargs):
    return args[0]._map_data(lambda x: x.pin_memory())


@implements(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    t = args[0]
    return all(getattr(t, n).is_pinned() for n in t.tensor_data_names)


@implements(aten.record_stream.default)
def _record_stream(func, args, kwargs):
    t, stream = args[0], args[1]
    for name in t.tensor_data_names:
        getattr(t, name).record_stream(stream)


@implements(aten.is_same_size.default)
def _is_same_size(func, args, kwargs):
    return args[0].shape == args[1].shape


def _plain(x: Any) -> Any:
    return x.dequantize() if isinstance(x, NVFP4Tensor) else x


def _dequantize_args(func, args, kwargs):
    """Run ``func`` on plain tensors: NVFP4 operands are dequantized to their orig_dtype."""
    return func(*tree_map(_plain, args), **tree_map(_plain, kwargs))


implements(aten.t.default, aten.mm.default, aten.addmm.default)(_dequantize_args)
