"""NVFP4 quantize and GEMM through flashinfer's FP4 kernels (Blackwell, SM100+ only).

NEVER RUN: written against flashinfer 0.7.2's documented API; no Blackwell GPU was available to
the authors, so neither function has executed and the CPU/Hopper test suites cannot reach them.

* ``scaled_fp4_quant_flashinfer``: ``flashinfer.fp4_quantize(x, gs, sf_vec_size=16,
  is_sf_swizzled_layout=True)`` returns 128x4-swizzled uint8 scales; they are unswizzled per call
  into fp4fuse's linear ``float8_e4m3fn [M, K/16]``. flashinfer scales elements by a reciprocal of
  the block scale, so a rare value on an e2m1 rounding boundary may get the neighbouring code
  compared with :func:`fp4fuse.nvfp4.format.quantize_reference` (format.py documents the same effect for
  torchao/TransformerEngine).
* ``mm_fp4_flashinfer``: swizzles both linear scale matrices per call (fp4fuse keeps scales linear
  so that they gather along M for any shard size, docs/design.md) and calls
  ``flashinfer.mm_fp4(a, b.T, a_sf, b_sf.T, alpha, out_dtype, backend=MM_BACKEND)``.
  flashinfer's mm_fp4 produces bf16/fp16 only; fp32 output runs fp4fuse's Triton GEMM instead.
"""
from __future__ import annotations

import logging

import torch

from fp4fuse.nvfp4.format import BLOCK_SIZE, poison_unless_valid_global_scale, swizzle_scales, unswizzle_scales

logger = logging.getLogger(__name__)

__all__ = ["MM_BACKEND", "mm_fp4_flashinfer", "scaled_fp4_quant_flashinfer"]

# flashinfer's mm_fp4 backends: "cutlass", "cudnn", "trtllm", "auto".
MM_BACKEND = "cutlass"


def scaled_fp4_quant_flashinfer(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q uint8 [M, K/2], s float8_e4m3fn [M, K/16])`` (linear scales). A global
    scale outside ``(0, inf)`` poisons the result as the contract says, whatever flashinfer makes of
    it (``poison_unless_valid_global_scale``: two elementwise kernels)."""
    import flashinfer

    m, k = x.shape
    q, sf = flashinfer.fp4_quantize(
        x, global_scale.reshape(1).float(), sf_vec_size=BLOCK_SIZE, is_sf_swizzled_layout=True)
    s = unswizzle_scales(sf.view(torch.uint8), m, k // BLOCK_SIZE).view(torch.float8_e4m3fn)
    return poison_unless_valid_global_scale(q.view(torch.uint8).reshape(m, k // 2), s, global_scale)


def mm_fp4_flashinfer(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``alpha * (q_a * s_a) @ (q_b * s_b)^T`` as ``[M, N]`` (a ``[M, K/2]``, b ``[N, K/2]``)."""
    if out_dtype == torch.float32:
        from fp4fuse.kernels.triton.mm import mm_fp4_triton
        return mm_fp4_triton(a, b, a_scale, b_scale, alpha, out_dtype)
    import flashinfer

    a_sf = swizzle_scales(a_scale.view(torch.uint8)).view(torch.float8_e4m3fn)
    b_sf = swizzle_scales(b_scale.view(torch.uint8)).view(torch.float8_e4m3fn)
    return flashinfer.mm_fp4(
        a, b.T, a_sf, b_sf.T, alpha.reshape(1).float(), out_dtype, backend=MM_BACKEND)
