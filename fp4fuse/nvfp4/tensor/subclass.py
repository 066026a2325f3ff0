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
keeps its order). Views share ``amax`` with their base; ``view.copy_(src)`` therefore refuses a
``src`` with another amax unless no other value of the base changes (see ``aten_ops._copy_``).

Autograd. NVFP4 weights are frozen: ``requires_grad=True`` is refused. ``F.linear(x, weight, b)``
runs ``fp4fuse.nvfp4.tensor.linear.frozen_weight_linear``: gradients reach ``x`` and ``b``.
Other matmuls (``t``, ``mm``, ``addmm``) dequantize the NVFP4 operands to their ``orig_dtype``; a
module that wants the NVFP4 GEMM calls ``torch.ops.fp4fuse.mm_fp4`` with ``qdata`` / ``scale`` /
:meth:`NVFP4Tensor.global_scale` itself. Any other aten op raises ``NotImplementedError`` naming the
op and the argument types.

Serialization. ``torch.save`` writes the payload bit for bit; importing fp4fuse registers the
class with ``torch.serialization.add_safe_globals``, so ``torch.load(..., weights_only=True)``
(and ``dcp.load``, which uses it) restores it.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.nvfp4.quantizer import group_amax, quantize_weight
from fp4fuse.nvfp4.tensor.linear import frozen_weight_linear
from fp4fuse.nvfp4.tensor.op_table import OPS, contiguous_strides
from fp4fuse.nvfp4.tensor.restore import CheckpointRestore, restore_of

__all__ = ["NVFP4Tensor"]

logger = logging.getLogger(__name__)

# Logical elements per payload byte: qdata 2, scale 16; amax is one fp32.
_QDATA_PER_ELEMENT, _SCALE_PER_ELEMENT = 2, nvfp4.BLOCK_SIZE
_AMAX_BYTES = 4


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
    # Set only on the views DCP loads into (__get_tensor_shard__) and on their views: their copy_
    # follows the load's rules (fp4fuse.nvfp4.tensor.restore). Not state of the tensor's value.
    _restore: CheckpointRestore | None = None

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
        if not isinstance(orig_dtype, torch.dtype) or not orig_dtype.is_floating_point or orig_dtype.itemsize < 2:
            raise TypeError(f"NVFP4Tensor: orig_dtype (the dtype it dequantizes to) must be a floating dtype of "
                            f"16 bits or more, got {orig_dtype}")
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

    def _view(self, **changes: torch.Tensor) -> NVFP4Tensor:
        """:meth:`_replace` for views (``changes`` are views of this tensor's inner tensors): a
        view of a DCP restore view is one too."""
        view = self._replace(**changes)
        if self._restore is not None:
            view._restore = self._restore
        return view

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
        """The encode-convention global scale ``448 * 6 / amax``: fp32 ``[1]``. An amax below 0
        (only a corrupt state dict or constructor argument can hold one: an amax is a max of
        magnitudes) gives NaN, as a non-finite one does, so the tensor decodes to NaN instead of
        to values of the wrong sign; checked on the device, without a host sync."""
        amax = torch.where(self.amax < 0, torch.full_like(self.amax, float("nan")), self.amax)
        return nvfp4.global_scale_from_amax(amax)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``q * s / gs`` as a plain tensor of the logical shape in ``dtype`` (default orig_dtype)."""
        if self.numel() == 0:
            return torch.empty(self.shape, dtype=dtype or self.orig_dtype, device=self.device)
        kh = self.qdata.shape[-1]
        q = self.qdata.reshape(-1, kh)
        s = self.scale.reshape(-1, kh * 2 // nvfp4.BLOCK_SIZE)
        out = nvfp4.dequantize_reference(q, s, self.global_scale(), dtype or self.orig_dtype)
        return out.reshape(self.shape)

    # -- FSDP2 all-gather extension ------------------------------------------------------------
    #
    # FSDP2 shards dim 0 like torch.chunk (P = ceil(N / W) rows per rank, the last ranks fewer or
    # none) and concatenates every all-gather input on dim 0 across ranks.
    #
    # Even rows (N = W * P): the payload is gathered as it is (three uint8 inputs), and the
    # unsharded tensor aliases the gathered buffers, no copy on either side:
    #
    #           logical [N, K]    qdata [N, K/2]    scale [N, K/16]    amax + flag (8 bytes)
    #   rank 0  rows 0 .. P-1     rows 0 .. P-1     rows 0 .. P-1      bytes 0 .. 7
    #   rank 1  rows P .. 2P-1    rows P .. 2P-1    rows P .. 2P-1     bytes 8 .. 15
    #
    # Uneven rows: FSDP2 requires every input to have the padded logical shape [P, K], so each
    # rank sends one uint8 [P, K] buffer and the unsharded payload is cut out of the gathered
    # buffers (one copy each way; 9/16 of the buffer is payload). A 1-rank mesh uses it too: there
    # FSDP2 (torch 2.13, wait_for_unshard) copies only the first all-gather input.
    #
    #   rank r (n_r rows): [ qdata n_r*K/2 | scale n_r*K/16 | zeros | flag 1 byte | amax 4 bytes ]
    #
    # One amax decodes every row of the unsharded tensor, so the shards' amaxes must agree. The
    # flag says whether a shard's values depend on its amax (some block scale is nonzero; an empty
    # or all-zero shard is 0 under any amax, and an empty shard's amax is never loaded by
    # dcp.load). The unsharded amax is that of the first flagged shard (rank 0's if none) when every
    # flagged shard holds the same amax, else NaN: shards quantized with different amaxes (e.g.
    # each rank copy_'d its own from_hp into its local shard) decode to NaN, never to rows scaled
    # by another rank's amax. Decided on the device, without a host sync (the funcol all-gather,
    # which may sync, raises ValueError instead). Scales travel as uint8 (gloo has no float8).

    def fsdp_pre_all_gather(self, mesh: Any, orig_size: torch.Size, contiguous_orig_stride: Any,
                            module: torch.nn.Module, mp_policy: Any
                            ) -> tuple[tuple[torch.Tensor, ...], tuple[Any, ...]]:
        """All-gather inputs (even rows: ``(qdata, scale, amax + flag)`` as uint8; uneven: one packed
        uint8 buffer of the padded shard shape) and metadata ``(packing,)``: None, or what unpacking
        needs."""
        world = mesh.size()
        rows = orig_size[0]
        flag = _depends_on_amax(self)
        if rows % world == 0 and world > 1:
            scale_u8 = self.scale.contiguous().view(torch.uint8)
            summary = torch.cat([self.amax.reshape(1).view(torch.int32), flag.to(torch.int32)])
            return (self.qdata.contiguous(), scale_u8, summary.view(torch.uint8)), (None,)
        packed = torch.zeros((-(-rows // world), *orig_size[1:]), dtype=torch.uint8, device=self.device)
        flat, n_q = packed.view(-1), self.numel() // _QDATA_PER_ELEMENT
        flat[:n_q].copy_(self.qdata.reshape(-1))
        n_s = self.numel() // _SCALE_PER_ELEMENT
        flat[n_q:n_q + n_s].copy_(self.scale.reshape(-1).view(torch.uint8))
        flat[-_AMAX_BYTES - 1:-_AMAX_BYTES].copy_(flag.to(torch.uint8))
        flat[-_AMAX_BYTES:].copy_(self.amax.reshape(1).view(torch.uint8))
        return (packed,), ((tuple(orig_size), world),)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...],
                             metadata: tuple[Any, ...], param_dtype: torch.dtype, *,
                             out: NVFP4Tensor | None = None
                             ) -> tuple[NVFP4Tensor, tuple[torch.Tensor, ...]] | None:
        """The unsharded NVFP4Tensor, of logical dtype ``param_dtype`` (FSDP2's mixed-precision
        ``param_dtype``, else the shard's orig_dtype: the dtype it dequantizes to).

        With ``out`` (later iterations) FSDP2 has re-allocated the storage of the inner tensors
        returned the first time: even rows alias the new gather outputs (only the amax is decided
        again, in place), uneven rows are unpacked into them again."""
        (packing,) = metadata
        if packing is None:
            qdata, scale_u8, summaries = all_gather_outputs
            per_rank = summaries.view(torch.int32).view(-1, 2)
            agreed = _agreed_amax(per_rank[:, 0], per_rank[:, 1] != 0)
            # the unsharded amax is rank 0's slot of the gathered summaries, overwritten in place
            amax = summaries[:_AMAX_BYTES].view(torch.float32)
            amax.copy_(agreed)
            if out is not None:
                return None
            inner: tuple[torch.Tensor, ...] = (qdata, scale_u8, summaries)
        else:
            orig_size, _ = packing
            if out is None:
                qdata = torch.empty((*orig_size[:-1], orig_size[-1] // _QDATA_PER_ELEMENT),
                                    dtype=torch.uint8, device=all_gather_outputs[0].device)
                scale_u8 = torch.empty((*orig_size[:-1], orig_size[-1] // _SCALE_PER_ELEMENT),
                                       dtype=torch.uint8, device=qdata.device)
                amax = torch.empty(1, dtype=torch.float32, device=qdata.device)
            else:
                qdata, scale_u8, amax = out.qdata, out.scale.view(torch.uint8), out.amax
            _unpack_gathered(all_gather_outputs[0], packing, qdata, scale_u8, amax)
            if out is not None:
                return None
            inner = (qdata, scale_u8, amax)
        full = NVFP4Tensor(qdata, scale_u8.view(torch.float8_e4m3fn), amax, param_dtype, self.amax_group)
        return full, inner

    # -- DCP (torch.distributed.checkpoint) ----------------------------------------------------

    def __get_tensor_shard__(self, index: Any) -> NVFP4Tensor:
        """The tensor ``dcp.save`` reads a chunk from and ``dcp.load`` copies chunks into (DCP
        calls it on a plain entry and, through ``DTensor.__get_tensor_shard__``, on the local
        shard of a DTensor entry; ``index`` names the chunk).

        The chunks DCP stores are this tensor's row ranges: NVFP4Tensors, payload bit for bit,
        under the logical shape and dtype in the checkpoint's metadata, so DCP's own planner
        reshards them. The returned view aliases this tensor; loading through it follows
        ``fp4fuse.nvfp4.tensor.restore`` (the chunks set the one amax consistently)."""
        view = self._replace()
        view._restore = restore_of(self)
        return view

    # -- dispatch ------------------------------------------------------------------------------

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.requires_grad_ or func == torch.Tensor.requires_grad.__set__:
            _refuse_requires_grad(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            if func is F.linear:
                x, weight, bias = _linear_args(*args, **kwargs)
                if isinstance(weight, NVFP4Tensor):
                    return frozen_weight_linear(x, weight, bias)
            return func(*args, **kwargs)

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


def _linear_args(input: Any, weight: Any, bias: Any = None) -> tuple[Any, Any, Any]:
    """``F.linear``'s arguments by name, however they were passed."""
    return input, weight, bias


def _refuse_requires_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``t.requires_grad_(flag)`` / ``t.requires_grad = flag``: only False is allowed."""
    flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    if flag:
        raise RuntimeError(
            "NVFP4Tensor: requires_grad=True is not supported: NVFP4 weights are frozen (no "
            "gradient is computed for them). Wrap them as nn.Parameter(t, requires_grad=False) and "
            "train adapters beside them (F.linear(x, t) backpropagates to x)")


def _unpack_gathered(gathered: torch.Tensor, packing: tuple[tuple[int, ...], int],
                     qdata: torch.Tensor, scale_u8: torch.Tensor, amax: torch.Tensor) -> None:
    """Cut every rank's payload out of the gathered packed buffers (layout above) into the
    contiguous unsharded ``qdata`` / ``scale_u8``; ``amax``: :func:`_agreed_amax` of the ranks'."""
    orig_size, world = packing
    rows, row_numel = orig_size[0], math.prod(orig_size[1:])
    padded_rows = -(-rows // world)
    per_rank = gathered.view(world, -1)
    q_out, s_out = qdata.view(-1), scale_u8.view(-1)
    for rank in range(world):
        numel = max(0, min(padded_rows, rows - rank * padded_rows)) * row_numel
        n_q, n_s = numel // _QDATA_PER_ELEMENT, numel // _SCALE_PER_ELEMENT
        start = rank * padded_rows * row_numel
        q_out[start // _QDATA_PER_ELEMENT:][:n_q].copy_(per_rank[rank, :n_q])
        s_out[start // _SCALE_PER_ELEMENT:][:n_s].copy_(per_rank[rank, n_q:n_q + n_s])
    bits = per_rank[:, -_AMAX_BYTES:].contiguous().view(torch.int32).view(world)
    amax.copy_(_agreed_amax(bits, per_rank[:, -_AMAX_BYTES - 1] != 0))


def _depends_on_amax(t: NVFP4Tensor) -> torch.Tensor:
    """bool ``[1]``: some block scale of ``t`` is nonzero, so its values depend on its amax (a
    block with scale ±0 is 0 under any amax)."""
    return ((t.scale.view(torch.uint8) & 0x7F) != 0).any().reshape(1)


def _agreed_amax(bits: torch.Tensor, depends: torch.Tensor) -> torch.Tensor:
    """fp32 ``[1]``: the one amax of gathered shards (int32 amax ``bits`` and ``depends`` flags,
    one per rank): the first depending shard's (rank 0's if none), or NaN when depending shards
    disagree, so that the tensor decodes to NaN instead of rows under another shard's amax."""
    first = depends.to(torch.int32).argmax()  # the first True; 0 if none
    ref = bits[first]
    agree = ((bits == ref) | ~depends).all()
    nan = torch.full_like(ref, 0x7FC00000)  # fp32 quiet NaN, as int32 bits
    return torch.where(agree, ref, nan).reshape(1).view(torch.float32)


def _rebuild(fields: dict[str, Any]) -> NVFP4Tensor:
    return NVFP4Tensor(**{**fields, "scale": fields["scale"].view(torch.float8_e4m3fn)})


# torch.load(weights_only=True), which dcp.load uses for every chunk, rebuilds only allow-listed
# globals: the class and the rebuild function its __reduce_ex__ names.
torch.serialization.add_safe_globals([NVFP4Tensor, _rebuild])
