"""``NVFP4Tensor``: an NVFP4 weight as a ``torch.Tensor`` subclass, for FSDP2 and DCP.

The outer (logical) tensor has the weight's shape ``[N, K]`` and its original high-precision
dtype (e.g. bf16); it owns no storage. The payload lives in inner tensors (the format of docs/design.md):

* ``qdata``: uint8 ``[N, K/2]``, two e2m1 codes per byte (element ``2j`` in the low nibble);
* ``scale``: float8_e4m3fn ``[N, K/16]``, linear (unswizzled) block scales;
* ``amax``: fp32 ``[1]``, the per-tensor amax; the global scale is
  ``format.global_scale_from_amax(amax)`` (encode convention ``448 * 6 / amax``).

Attributes: ``orig_dtype`` (the logical dtype) and ``amax_group`` (an ``int`` ID from
``fp4fuse.register_amax_group`` naming the ranks whose shards share one amax, or None; never a
ProcessGroup, so the tensor pickles and deep-copies).

Views. Only views that keep whole 16-element blocks and the row-major order of the payload are
representable: row ranges (``slice``/``split``/``narrow`` on dim 0), ``view``/``as_strided`` to a
contiguous shape whose last dim is a multiple of 16 (``view(-1)`` included: the flattened payload
keeps its order). Views share ``amax`` with their base, so ``base[a:b].copy_(src)`` updates the base.

Matmuls (``t``, ``mm``, ``addmm``; ``F.linear`` and ``matmul`` decompose to these before
dispatch) dequantize the NVFP4 operands to their ``orig_dtype`` and run the plain op; a module
that wants the NVFP4 GEMM calls ``torch.ops.fp4fuse.mm_fp4`` with ``qdata`` / ``scale`` / :meth:`NVFP4Tensor.global_scale` itself.
Any other aten op raises ``NotImplementedError`` naming the op and the argument types.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.nvfp4.quantizer import group_amax, quantize_weight
from fp4fuse.nvfp4.tensor.op_table import OPS, contiguous_strides

__all__ = ["NVFP4Tensor"]

logger = logging.getLogger(__name__)


class NVFP4Tensor(torch.Tensor):
    """An NVFP4-quantized tensor of logical shape ``[..., K]`` and dtype ``orig_dtype``.

    ``K`` (the last dim) is a multiple of 16. Build one with :meth:`from_hp`; read it back with
    :meth:`dequantize`. See the module docstring for the inner tensors and supported ops.
    """

    tensor_data_names: tuple[str, ...] = ("qdata", "scale", "amax")
    tensor_attribute_names: tuple[str, ...] = ("orig_dtype", "amax_group")

    qdata: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    orig_dtype: torch.dtype
    amax_group: int | None

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                orig_dtype: torch.dtype, amax_group: int | None = None) -> NVFP4Tensor:
        if qdata.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
            raise TypeError(f"NVFP4Tensor: qdata must be uint8 and scale float8_e4m3fn, got "
                            f"{qdata.dtype} and {scale.dtype}")
        if qdata.dim() < 1 or qdata.shape[-1] % (nvfp4.BLOCK_SIZE // 2) != 0:
            raise ValueError(f"NVFP4Tensor: qdata shape {tuple(qdata.shape)} does not hold whole "
                             f"16-element blocks in its last dim")
        shape = (*qdata.shape[:-1], qdata.shape[-1] * 2)
        expected_scale = (*qdata.shape[:-1], shape[-1] // nvfp4.BLOCK_SIZE)
        if tuple(scale.shape) != expected_scale:
            raise ValueError(f"NVFP4Tensor: scale shape {tuple(scale.shape)} does not match qdata "
                             f"{tuple(qdata.shape)}; expected {expected_scale}")
        if amax.dtype != torch.float32 or amax.numel() != 1:
            raise ValueError(f"NVFP4Tensor: amax must be one fp32 element, got {amax.dtype} "
                             f"{tuple(amax.shape)}")
        if amax_group is not None and (isinstance(amax_group, bool) or not isinstance(amax_group, int)):
            raise TypeError(f"NVFP4Tensor: amax_group must be an int ID or None, got "
                            f"{type(amax_group).__name__}")
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=contiguous_strides(shape), dtype=orig_dtype, device=qdata.device,
            requires_grad=False)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                 orig_dtype: torch.dtype, amax_group: int | None = None) -> None:
        self.qdata = qdata
        self.scale = scale
        self.amax = amax
        self.orig_dtype = orig_dtype
        self.amax_group = amax_group

    # -- derived from tensor_data_names / tensor_attribute_names --------------------------------

    def _fields(self) -> dict[str, Any]:
        names = self.tensor_data_names + self.tensor_attribute_names
        return {name: getattr(self, name) for name in names}

    def _replace(self, **changes: Any) -> NVFP4Tensor:
        """A new NVFP4Tensor with ``changes`` applied to this one's inner tensors / attributes."""
        unknown = set(changes) - set(self.tensor_data_names + self.tensor_attribute_names)
        if unknown:
            raise TypeError(f"NVFP4Tensor._replace: unknown fields {sorted(unknown)}")
        return NVFP4Tensor(**{**self._fields(), **changes})

    def _map_data(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> NVFP4Tensor:
        return self._replace(**{name: fn(getattr(self, name)) for name in self.tensor_data_names})

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return list(self.tensor_data_names), {n: getattr(self, n) for n in self.tensor_attribute_names}

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                             outer_size: Any, outer_stride: Any) -> NVFP4Tensor:
        return cls(**inner_tensors, **meta)

    def __reduce_ex__(self, protocol: int) -> tuple[Any, tuple[Any, ...]]:
        # Plain pickle cannot restore float8 storages (torch 2.13), so scale travels as uint8.
        fields = self._fields()
        fields["scale"] = self.scale.view(torch.uint8)
        return _rebuild, (fields,)

    def __repr__(self) -> str:
        parts = [f"shape={tuple(self.shape)}"]
        parts += [f"{n}={getattr(self, n).dtype}{list(getattr(self, n).shape)}"
                  for n in self.tensor_data_names]
        parts += [f"{n}={getattr(self, n)}" for n in self.tensor_attribute_names]
        return f"NVFP4Tensor({', '.join(parts)}, device={self.device})"

    # -- construction and conversion -----------------------------------------------------------

    @classmethod
    def from_hp(cls, w: torch.Tensor, amax_group: int | None = None) -> NVFP4Tensor:
        """Quantize a high-precision ``w [..., K]`` (K a multiple of 16) to NVFP4.

        ``amax`` is ``max |w|`` (NaN counts as +inf, so the global scale becomes NaN); with
        ``amax_group`` it is all-reduced (MAX) over that registered group through
        ``_c10d_functional.all_reduce``, so every shard of one weight gets the same global scale.
        Every rank of the group must call this collectively."""
        if w.dim() < 1 or w.shape[-1] % nvfp4.BLOCK_SIZE != 0:
            raise ValueError(f"NVFP4Tensor.from_hp: the last dim must be a multiple of "
                             f"{nvfp4.BLOCK_SIZE}, got shape {tuple(w.shape)}")
        amax = group_amax(w, amax_group)
        q, s, _ = quantize_weight(w, amax)
        return cls(q, s, amax, w.dtype, amax_group)

    def global_scale(self) -> torch.Tensor:
        """The encode-convention global scale ``448 * 6 / amax``: fp32 ``[1]``."""
        return nvfp4.global_scale_from_amax(self.amax)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``q * s / gs`` as a plain tensor of the logical shape in ``dtype`` (default orig_dtype)."""
        kh = self.qdata.shape[-1]
        q = self.qdata.reshape(-1, kh)
        s = self.scale.reshape(-1, kh * 2 // nvfp4.BLOCK_SIZE)
        out = nvfp4.dequantize_reference(q, s, self.global_scale(), dtype or self.orig_dtype)
        return out.reshape(self.shape)

    # -- FSDP2 all-gather extension ------------------------------------------------------------
    #
    # FSDP2 shards dim 0 (rows); every all-gather input is concatenated on dim 0 across ranks:
    #
    #        logical [N, K]          qdata uint8 [N, K/2]     scale (as uint8) [N, K/16]
    #   rank0  rows 0 .. N/W-1   ->  rows 0 .. N/W-1          rows 0 .. N/W-1
    #   rank1  rows N/W .. 2N/W-1 -> rows N/W .. 2N/W-1       rows N/W .. 2N/W-1
    #   amax fp32[1]: identical on every rank (from_hp reduced it over amax_group) -> metadata.
    #
    # Scales travel as uint8 (gloo has no float8 collectives); the all-gathered buffers become
    # the unsharded tensor's qdata / scale without a copy.

    def fsdp_pre_all_gather(self, mesh: Any, orig_size: torch.Size, contiguous_orig_stride: Any,
                            module: torch.nn.Module, mp_policy: Any
                            ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[Any, ...]]:
        """All-gather inputs ``(qdata, scale.view(uint8))`` and metadata ``(amax, orig_dtype,
        amax_group)``. Needs a 2-D weight whose rows divide evenly over ``mesh``; FSDP2's
        mixed-precision ``param_dtype`` does not apply (the unsharded tensor keeps orig_dtype)."""
        if self.dim() != 2 or len(orig_size) != 2:
            raise NotImplementedError(f"NVFP4Tensor under FSDP2 supports 2-D weights, got shard "
                                      f"{tuple(self.shape)} of {tuple(orig_size)}")
        if orig_size[0] % mesh.size() != 0:
            # Raised on every rank (not only the padded ones), so no rank waits in the all-gather.
            raise NotImplementedError(
                f"NVFP4Tensor under FSDP2 needs even row sharding: {orig_size[0]} rows over "
                f"{mesh.size()} ranks (FSDP2 would pad the logical shard, which the packed payload "
                f"cannot express)")
        metadata = (self.amax.clone(), self.orig_dtype, self.amax_group)
        return (self.qdata.contiguous(), self.scale.contiguous().view(torch.uint8)), metadata

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: tuple[Any, ...],
                             param_dtype: torch.dtype, *, out: NVFP4Tensor | None = None
                             ) -> tuple[NVFP4Tensor, tuple[torch.Tensor, ...]] | None:
        """Wrap the gathered ``(qdata [N, K/2], scale_u8 [N, K/16])`` as the unsharded tensor.

        With ``out`` (later iterations) FSDP2 has re-allocated the storage of the inner tensors
        returned the first time, which alias the gather outputs: only amax is refreshed."""
        qdata, scale_u8 = all_gather_outputs
        amax, orig_dtype, amax_group = metadata
        if out is not None:
            out.amax.copy_(amax)
            return None
        full = NVFP4Tensor(qdata, scale_u8.view(torch.float8_e4m3fn), amax.clone(), orig_dtype,
                            amax_group)
        return full, (qdata, scale_u8)

    # -- dispatch ------------------------------------------------------------------------------

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        handler = OPS.get(func)
        if handler is None:
            arg_types = [type(a).__name__ for a in args] + [f"{k}={type(v).__name__}"
                                                           for k, v in (kwargs or {}).items()]
            raise NotImplementedError(f"NVFP4Tensor: unsupported op {func} with argument types "
                                      f"({', '.join(arg_types)})")
        return handler(func, args, kwargs or {})


def _rebuild(fields: dict[str, Any]) -> NVFP4Tensor:
    return NVFP4Tensor(**{**fields, "scale": fields["scale"].view(torch.float8_e4m3fn)})
