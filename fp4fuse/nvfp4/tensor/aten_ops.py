"""The aten overrides of :class:`fp4fuse.nvfp4.tensor.subclass.NVFP4Tensor` (the ops FSDP2, DTensor
and DCP use).

Each handler takes ``(func, args, kwargs)`` as ``__torch_dispatch__`` received them. Row ranges and
contiguous reshapes stay NVFP4Tensor views (inner tensors are views, ``amax`` is shared); a dtype
change or a matmul dequantizes to a plain tensor. A logical view that would split a 16-element block
or reorder the payload raises ``NotImplementedError`` saying why. Where torch defines the shapes
(``split``, ``split_with_sizes``), the handler asks torch on a meta tensor of the logical shape, so
sizes and errors are torch's own.

Functional collectives (``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor``, what
``DTensor.full_tensor()`` / ``redistribute(Replicate())`` issue) gather the raw payload: the
result is an NVFP4Tensor, bit for bit the concatenation of the shards.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives  # noqa: F401  (defines c10d._wrap_tensor_autograd)
from torch.utils._pytree import tree_map

from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.nvfp4.tensor.op_table import contiguous_strides, implements
from fp4fuse.nvfp4.tensor.restore import payload_outside
from fp4fuse.nvfp4.tensor.subclass import NVFP4Tensor

__all__: list[str] = []

logger = logging.getLogger(__name__)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_BLOCK = nvfp4.BLOCK_SIZE


def _inner_shapes(shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """qdata and scale shapes of an NVFP4Tensor of logical ``shape`` (last dim % 16 == 0)."""
    if len(shape) == 0 or shape[-1] % _BLOCK != 0:
        raise NotImplementedError(
            f"NVFP4Tensor: logical shape {tuple(shape)} cannot be represented: the last dim must be "
            f"a multiple of {_BLOCK} so that every 16-element block keeps its one scale")
    lead = tuple(shape[:-1])
    return (*lead, shape[-1] // 2), (*lead, shape[-1] // _BLOCK)


def _reshape(t: NVFP4Tensor, shape: Sequence[int]) -> NVFP4Tensor:
    """A view of ``t`` with a new contiguous logical shape (same element order). The shape (a -1
    resolved, its errors) is torch's own, as for a contiguous tensor of ``t``'s shape."""
    shape = tuple(torch.empty(t.shape, device="meta").view(list(shape)).shape)
    q_shape, s_shape = _inner_shapes(shape)
    if not (t.qdata.is_contiguous() and t.scale.is_contiguous()):
        raise NotImplementedError("NVFP4Tensor: reshaping needs contiguous qdata and scale")
    return t._view(qdata=t.qdata.view(q_shape), scale=t.scale.view(s_shape))


def _rows(t: NVFP4Tensor, start: int, end: int) -> NVFP4Tensor:
    """Rows ``[start, end)`` on dim 0 as a view (amax shared with ``t``)."""
    if t.dim() == 1:
        if start % _BLOCK or end % _BLOCK:
            raise NotImplementedError(f"NVFP4Tensor: a 1-D slice [{start}:{end}] must start and end "
                                      f"on {_BLOCK}-element block boundaries")
        return t._view(qdata=t.qdata[start // 2:end // 2], scale=t.scale[start // _BLOCK:end // _BLOCK])
    return t._view(qdata=t.qdata[start:end], scale=t.scale[start:end])


def _check_dim0(t: NVFP4Tensor, dim: int, what: str) -> None:
    if dim % max(t.dim(), 1) != 0:
        raise NotImplementedError(f"NVFP4Tensor: {what} supports dim 0 only (rows), got dim {dim} "
                                  f"of shape {tuple(t.shape)}")


@implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    t = args[0]
    return t._view(**{name: func(getattr(t, name)) for name in t.tensor_data_names})


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
    if stride != contiguous_strides(size) or offset % _BLOCK or offset < 0:
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


def _row_pieces(t: NVFP4Tensor, sizes: Sequence[int], dim: int, what: str) -> list[NVFP4Tensor]:
    """Consecutive row views of ``t`` of ``sizes`` rows (``what`` names the op for errors)."""
    _check_dim0(t, dim, what)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [_rows(t, s, s + n) for s, n in zip(starts, sizes)]


@implements(aten.split.Tensor)
def _split(func, args, kwargs):
    t, split_size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    meta = torch.empty(t.shape, device="meta").split(split_size, dim)
    return _row_pieces(t, [p.shape[dim] for p in meta], dim, "split")


@implements(aten.split_with_sizes.default)
def _split_with_sizes(func, args, kwargs):
    t, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    meta = torch.empty(t.shape, device="meta").split_with_sizes(sizes, dim)
    return _row_pieces(t, [p.shape[dim] for p in meta], dim, "split_with_sizes")


@implements(aten.constant_pad_nd.default)
def _constant_pad_nd(func, args, kwargs):
    """Zero rows appended on dim 0 (DTensor pads uneven shards this way before gathering them):
    zero codes are 0 under any amax, so the padded tensor keeps the shard's amax."""
    t, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    # pad lists (before, after) pairs from the last dim backwards: dim 0's "after" is pad[2*ndim-1].
    rows_after = pad[2 * t.dim() - 1] if len(pad) == 2 * t.dim() else 0
    others = [p for i, p in enumerate(pad) if i != 2 * t.dim() - 1]
    if value != 0 or rows_after < 0 or any(others):
        raise NotImplementedError(
            f"NVFP4Tensor: constant_pad_nd(pad={pad}, value={value}) is supported only as zero rows "
            f"appended on dim 0")
    padded = _new_like(t, (t.shape[0] + rows_after, *t.shape[1:]), None, None, fill=True)
    _rows(padded, 0, t.shape[0]).copy_(t)
    return padded


def _new_like(t: NVFP4Tensor, shape: Sequence[int], dtype: torch.dtype | None, device: Any,
              fill: bool) -> torch.Tensor:
    """An NVFP4Tensor of ``shape`` with a zero payload and ``t``'s amax; a plain tensor (zeros if
    ``fill``) when another dtype is asked for.

    ``new_empty`` / ``empty_like`` zero the payload too: any content is allowed, and zeros are 0
    under every amax, so copying rows into the result (FSDP2's padding, DCP's load) is exact."""
    device = torch.device(device) if device is not None else t.device
    if dtype is not None and dtype != t.dtype:
        make = torch.zeros if fill else torch.empty
        return make(tuple(shape), dtype=dtype, device=device)
    q_shape, s_shape = _inner_shapes(shape)
    # A meta tensor's amax cannot be read (to_empty from meta): its zero payload fits any amax.
    amax = (torch.zeros_like(t.amax, device=device) if t.amax.is_meta and device.type != "meta"
            else t.amax.to(device=device, copy=True))
    return t._replace(qdata=torch.zeros(q_shape, dtype=torch.uint8, device=device),
                      scale=torch.zeros(s_shape, dtype=torch.float8_e4m3fn, device=device),
                      amax=amax)


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


def _amax_may_change(dst: NVFP4Tensor, src: NVFP4Tensor) -> bool:
    """Setting ``dst``'s shared amax to ``src``'s changes no value outside ``dst``: ``dst`` spans
    its whole payload, or the rest holds ±0 codes (0 under any finite amax) and both are finite."""
    outside = payload_outside(dst.qdata)
    if outside is None:
        return False
    if all(part.numel() == 0 for part in outside):
        return True
    finite = bool(torch.isfinite(src.amax).all() and torch.isfinite(dst.amax).all())
    return finite and not any(((part & 0x77) != 0).any() for part in outside)


def _copy_payload(dst: NVFP4Tensor, src: NVFP4Tensor, non_blocking: bool) -> None:
    """``dst.copy_(src)`` between NVFP4Tensors: codes and scales, and the amax where that is exact
    (same amax, or :func:`_amax_may_change`); otherwise ValueError."""
    same = torch.equal(src.amax.view(torch.int32).to(dst.device), dst.amax.view(torch.int32))
    if not same:
        if not _amax_may_change(dst, src):
            raise ValueError(
                f"NVFP4Tensor.copy_: the source's amax {src.amax.item()!r} differs from the "
                f"destination's {dst.amax.item()!r}, and the destination (shape {tuple(dst.shape)}) is a "
                f"view sharing its amax with other rows that hold nonzero codes: changing the amax "
                f"would rescale them. Copy into the whole tensor, or quantize the source with the "
                f"destination's amax")
        dst.amax.copy_(src.amax, non_blocking)
    dst.qdata.copy_(src.qdata, non_blocking)
    dst.scale.copy_(src.scale, non_blocking)


@implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    if isinstance(dst, NVFP4Tensor) and isinstance(src, NVFP4Tensor):
        if dst.shape != src.shape:
            raise RuntimeError(f"NVFP4Tensor.copy_: shape {tuple(src.shape)} into {tuple(dst.shape)}")
        if dst._restore is not None:
            dst._restore.copy_(dst, src, non_blocking)
        else:
            _copy_payload(dst, src, non_blocking)
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


# -- functional collectives ------------------------------------------------------------------------

def _holds_nonzero_codes(t: NVFP4Tensor) -> torch.Tensor:
    """int32 ``[1]``: 1 if some code of ``t`` is not ±0 (its values depend on its amax), else 0."""
    return ((t.qdata & 0x77) != 0).any().reshape(1).to(torch.int32)


@implements(c10d.all_gather_into_tensor.default)
def _all_gather_into_tensor(func, args, kwargs):
    """Gather the shards' payload on dim 0 (qdata, scale as uint8), asynchronously like the op.

    The shards' amaxes are gathered (with whether each shard holds nonzero codes) and compared at
    once, 8 bytes per rank: shards whose values depend on different amaxes cannot form one
    NVFP4Tensor (ValueError, not a silent mix). A shard of ±0 codes only (empty, or padding that
    DTensor added) is 0 under any amax; its amax, which dcp.load never sets, is ignored."""
    t, group_size, group_name = args
    mine = torch.cat([t.amax.view(torch.int32), _holds_nonzero_codes(t)])
    gathered = c10d.wait_tensor(func(mine, group_size, group_name)).view(group_size, 2)
    amaxes, nonzero = gathered[:, 0], gathered[:, 1].bool()
    deciding = amaxes[nonzero] if bool(nonzero.any()) else amaxes[:1]  # all zero: rank 0's, on every rank
    if not torch.equal(deciding, deciding[:1].expand_as(deciding)):
        raise ValueError(f"all_gather_into_tensor of an NVFP4Tensor: its {group_size} shards carry "
                         f"different amax values {deciding.view(torch.float32).tolist()}; they cannot "
                         f"form one NVFP4Tensor")
    amax = deciding[:1].view(torch.float32).clone()
    qdata = func(t.qdata.contiguous(), group_size, group_name)
    scale = func(t.scale.contiguous().view(torch.uint8), group_size, group_name)
    return t._replace(qdata=qdata, scale=scale.view(torch.float8_e4m3fn), amax=amax)


@implements(c10d.wait_tensor.default)
def _wait_tensor(func, args, kwargs):
    t = args[0]
    for name in ("qdata", "scale"):
        c10d.wait_tensor(getattr(t, name))
    return t


@implements(c10d._wrap_tensor_autograd.default)
def _wrap_tensor_autograd(func, args, kwargs):
    """Eager funcol wraps a collective's result in an AsyncCollectiveTensor that waits on first
    use; an NVFP4 payload is used as a whole, so it is waited for here instead."""
    return _wait_tensor(c10d.wait_tensor.default, args, kwargs)._replace()
