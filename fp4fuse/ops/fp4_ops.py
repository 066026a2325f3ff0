"""``fp4fuse::scaled_fp4_quant`` and ``fp4fuse::mm_fp4``: registration, fake impls, dispatch.

Contracts (docs/design.md):

* ``scaled_fp4_quant(x, global_scale) -> (q, s)``: x ``[M, K]`` bf16/fp16/fp32, global_scale fp32
  one element (encode convention ``448*6/amax``) -> q uint8 ``[M, K/2]``, s e4m3 ``[M, K/16]``.
* ``mm_fp4(a, b, a_scale, b_scale, alpha, out_dtype) -> out``: a ``[M, K/2]``, b ``[N, K/2]``
  (weight, row-major), linear scales; ``out = alpha * (q_a*s_a) @ (q_b*s_b)^T`` ``[M, N]``.
  Empty operands are valid: M = 0 or N = 0 gives the empty ``[M, N]``, K = 0 gives ``alpha * 0``.
* A global scale outside ``(0, inf)`` poisons the quantized tensor (NaN block scales, zero
  codes): see fp4fuse/nvfp4/format.py. It is not checked on the host (that would sync).

CPU (and any device without a faster backend) runs the pure-torch reference in fp4fuse.nvfp4.format;
CUDA runs what ``fp4fuse.ops.kernel_table`` names for the device's backend.

``fp4fuse::_mm_fp4_hopper`` is internal: the Gluon GEMM's launch in a lowered graph (the docstring of
``_mm_fp4_hopper_no_kernel``).
"""
from __future__ import annotations

import functools

import torch

from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.ops import validation
from fp4fuse.ops.backend import Backend, backend_for, call_on_device
from fp4fuse.ops.kernel_table import kernel_for
from fp4fuse.ops.registration import cuda_kernel, refuse_gradients


@torch.library.custom_op("fp4fuse::scaled_fp4_quant", mutates_args=())
def scaled_fp4_quant(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    validation.check_quant_inputs(x, global_scale)
    return nvfp4.quantize_reference(x, global_scale)


def empty_fp4_like(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized ``(q uint8 [M, K/2], s e4m3 [M, K/16])`` for quantizing ``x [M, K]``: the
    outputs of every op that returns an NVFP4 tensor (their fake implementations)."""
    m, k = x.shape
    q = x.new_empty((m, k // 2), dtype=torch.uint8)
    s = x.new_empty((m, k // nvfp4.BLOCK_SIZE), dtype=torch.float8_e4m3fn)
    return q, s


@scaled_fp4_quant.register_fake
def _(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    validation.check_quant_inputs(x, global_scale)
    return empty_fp4_like(x)


@cuda_kernel(scaled_fp4_quant)
def _(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    validation.check_quant_inputs(x, global_scale)
    backend = Backend.REFERENCE if x.numel() == 0 else backend_for(x)  # empty: no kernel launch
    return call_on_device(x.device, kernel_for("scaled_fp4_quant", backend), x, global_scale)


@torch.library.custom_op("fp4fuse::mm_fp4", mutates_args=())
def mm_fp4(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    validation.check_mm_inputs(a, b, a_scale, b_scale, alpha, out_dtype)
    return nvfp4.mm_fp4_reference(a, b, a_scale, b_scale, alpha, out_dtype)


@mm_fp4.register_fake
def _(a, b, a_scale, b_scale, alpha, out_dtype):
    validation.check_mm_inputs(a, b, a_scale, b_scale, alpha, out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@cuda_kernel(mm_fp4)
def _(a, b, a_scale, b_scale, alpha, out_dtype):
    validation.check_mm_inputs(a, b, a_scale, b_scale, alpha, out_dtype)
    # M, N or K is 0: no work, whatever the backend
    backend = Backend.REFERENCE if a.numel() == 0 or b.numel() == 0 else backend_for(a)
    return call_on_device(a.device, kernel_for("mm_fp4", backend), a, b, a_scale, b_scale, alpha, out_dtype)


#: ``fp4fuse::_mm_fp4_hopper`` is defined on the dispatcher directly (as ``fp4fuse::check_rank_uniform``
#: is), not through ``torch.library.custom_op``: a compiled graph calls it once per GEMM without
#: CUDA graphs, and ``custom_op``'s autograd layer would add three Python frames to each call.
#: Without an autograd kernel the dispatcher's autograd fallback would only warn on a backward
#: through it (and return no gradient), so the CUDA kernel refuses inputs that require one.
_lib = torch.library.Library("fp4fuse", "FRAGMENT")
_lib.define("_mm_fp4_hopper(Tensor a, Tensor a_scale, Tensor xlo, Tensor xhi, Tensor b, Tensor b_scale, "
            "Tensor alpha, Tensor alpha_b, bool alpha_from_scales, bool div_rn, ScalarType out_dtype) -> Tensor")


def _mm_fp4_hopper_no_kernel(a, a_scale, xlo, xhi, b, b_scale, alpha, alpha_b, alpha_from_scales, div_rn, out_dtype):
    """Internal (not part of the op contract): the Hopper Gluon GEMM's launch in a graph lowered by
    fp4fuse (``fp4fuse.passes.lowering``), where ``mm_fp4``'s activation decode ``xlo, xhi`` is a
    traced Triton launch and this op launches the Gluon kernel, whose TMA descriptors Inductor
    cannot build (``fp4fuse.kernels.triton.mm.mm_fp4_hopper_decoded``). CUDA only."""
    raise NotImplementedError("fp4fuse::_mm_fp4_hopper runs on CUDA only (the Hopper Gluon GEMM's launch)")


_lib.impl("_mm_fp4_hopper", _mm_fp4_hopper_no_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("fp4fuse::_mm_fp4_hopper", lib=_lib)
def _(a, a_scale, xlo, xhi, b, b_scale, alpha, alpha_b, alpha_from_scales, div_rn, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _mm_fp4_hopper_cuda(a, a_scale, xlo, xhi, b, b_scale, alpha, alpha_b, alpha_from_scales, div_rn, out_dtype):
    refuse_gradients("fp4fuse::_mm_fp4_hopper", a_scale=a_scale, xlo=xlo, xhi=xhi, b_scale=b_scale, alpha=alpha,
                     alpha_b=alpha_b)
    return _hopper_decoded()(a, a_scale, xlo, xhi, b, b_scale, alpha, alpha_b, alpha_from_scales, div_rn, out_dtype)


_lib.impl("_mm_fp4_hopper", _mm_fp4_hopper_cuda, "CUDA")


@functools.cache
def _hopper_decoded():
    from fp4fuse.kernels.triton.mm import mm_fp4_hopper_decoded  # imports Triton: first call only

    return mm_fp4_hopper_decoded
