"""The compute side of the overlapped collective GEMMs: the per-shard GEMM the symmetric-memory
pipelines (``fp4fuse.distributed.symm_mem.pipelines``) drive, and the rank-order sum of the
reduce-scatter's partials.
"""
from __future__ import annotations

import enum
import logging

import torch

from fp4fuse.distributed.symm_mem.pipelines import PreparedBlock
from fp4fuse.ops.backend import Backend, backend_for

__all__ = ["GemmMode", "RowBlockGemm", "sum_in_rank_order"]

logger = logging.getLogger(__name__)


class GemmMode(enum.Enum):
    """How :class:`RowBlockGemm` writes a row block's ``mm_fp4`` into an output view."""
    DEQUANT_CUBLAS = "exact bf16 dequantize + cuBLAS into out="
    DECODE = "one-launch decode GEMM with the whole GEMM's configuration, then copy"
    HOPPER = "Hopper Gluon GEMM into out="
    TILED = "tiled Triton kernel with the whole GEMM's configuration, then copy"
    COPY = "mm_fp4 then copy"


def _triton_mm_module():
    try:
        from fp4fuse.kernels.triton import mm as triton_mm
    except ImportError:
        return None
    return triton_mm


class RowBlockGemm:
    """``mm_fp4`` of row blocks of ``a`` against one weight, each written into an output view.

    ``fp4fuse::mm_fp4`` returns a fresh tensor; copying each block's output into place would cost
    a full extra pass over ``[M, N]`` (7% of a large GEMM), so this picks, once per op call:

    * ``HOPPER``: the Hopper Gluon GEMM (``triton_mm.hopper_gemm`` for the whole GEMM's
      ``total_rows``, so with its split-K count), written straight into the view; each output
      element's sums do not depend on the other rows, so bitwise equal to the unfused graph;
    * ``DEQUANT_CUBLAS``: the Triton backend's own large-M bf16 path, reproduced through its public
      functions so it can write into the view: ``torch.mm(dequant(a), dequant(b).T, out=view)`` then
      the in-place alpha scale -- the same kernels and arithmetic as ``triton_mm.mm_fp4_dequant_mm``, so
      bit-identical, with ``b`` dequantized once per call instead of once per block;
    * ``DECODE``: up to ``DECODE_MAX_M`` total rows, the one-launch decode GEMM with the
      configuration ``mm_fp4`` would pick for the whole GEMM (each row's sums do not depend on the
      other rows, so bitwise equal to the unfused graph);
    * ``TILED``: the Triton backend's tiled kernel, launched with the configuration (tile shape,
      split-K) that ``mm_fp4`` would pick for the whole ``total_rows``-row GEMM, so every output
      element is accumulated in the same order as in the unfused graph (bitwise equal to it);
    * ``COPY``: anything else (reference backend, whose kernel is row-independent).

    The path (Hopper, dequantize + cuBLAS or tiled) is chosen from ``total_rows`` too, as the unfused
    ``mm_fp4`` over all rows would choose it. cuBLAS picks its own kernels by shape, so on the
    DEQUANT_CUBLAS path a block may round differently from the whole GEMM in the last bit.

    A block runs in two steps: :meth:`prepare` (DEQUANT_CUBLAS: the decode kernels, which are short
    and non-persistent) and :meth:`run` (the GEMM). ``may_hold_all_sms``: the GEMM kernel may be
    persistent (cuBLAS, any launcher we do not know), i.e. keep every multiprocessor until it ends,
    so a signal kernel queued on another stream meanwhile would not start before it finishes; the
    pipelines then make the caller's stream wait for the signal before such a GEMM. fp4fuse's
    tiled Triton kernel retires its programs tile by tile and needs no such wait.

    Numerics equal ``mm_fp4`` on the same row block (tests pin it). Inputs validated by the op.
    """

    def __init__(self, b: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype,
                 block_rows: int, total_rows: int | None = None) -> None:
        """``block_rows``: rows of each block; ``total_rows``: rows of the whole GEMM the blocks
        make up (default ``block_rows``), whose kernel choices the blocks reproduce."""
        self.b, self.b_scale, self.alpha, self.out_dtype = b, b_scale, alpha, out_dtype
        self.out_features = b.shape[0]
        total_rows = block_rows if total_rows is None else total_rows
        self._b_dequant: torch.Tensor | None = None
        backend = backend_for(b)
        triton_mm = _triton_mm_module() if backend is Backend.TRITON else None
        n, k = b.shape[0], b.shape[1] * 2
        hopper = triton_mm.hopper_gemm(total_rows, b, b_scale, out_dtype) if triton_mm is not None else None
        if hopper is not None:
            self.mode = GemmMode.HOPPER
            self._hopper = hopper
        elif triton_mm is not None and out_dtype == torch.bfloat16 and total_rows >= triton_mm.DEQUANT_MIN_M:
            self.mode = GemmMode.DEQUANT_CUBLAS
            self._dequantize = triton_mm.dequantize_fp4_triton
            self._scale_by_alpha = triton_mm.scale_by_alpha_
        elif triton_mm is not None and total_rows <= triton_mm.DECODE_MAX_M:
            self.mode = GemmMode.DECODE
            self._decode_gemm = triton_mm.mm_fp4_decode
            self._config = triton_mm.decode_config_for(total_rows, n, k, triton_mm.num_sms(b.device))
        elif triton_mm is not None:
            self.mode = GemmMode.TILED
            self._tiled = triton_mm.mm_fp4_tiled
            self._config = triton_mm.mm_config_for(total_rows, n, k, b.device)
        else:
            self.mode = GemmMode.COPY
        # fp4fuse's Triton and Gluon GEMMs retire their programs tile by tile; anything else may be persistent.
        self.may_hold_all_sms = self.mode not in (GemmMode.TILED, GemmMode.DECODE, GemmMode.HOPPER)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("fp4fuse: %d-row blocks of %d rows, N=%d, %s: %s", block_rows, total_rows, b.shape[0],
                         out_dtype, self.mode.value)

    @property
    def decodes_operands(self) -> bool:
        """True on the DEQUANT_CUBLAS path: the GEMM proper multiplies bf16 decodes of both operands."""
        return self.mode is GemmMode.DEQUANT_CUBLAS

    def decoded_weight(self) -> torch.Tensor:
        """bf16 decode of ``b`` (DEQUANT_CUBLAS only), made once per call on the current stream."""
        if self._b_dequant is None:
            self._b_dequant = self._dequantize(self.b, self.b_scale)
        return self._b_dequant

    def decode_rows(self, a: torch.Tensor, a_scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 decode of a row block (DEQUANT_CUBLAS only) on the current stream, into ``out`` if
        given (a contiguous row range of a larger buffer). ``a`` may be a peer's mapped memory."""
        return self._dequantize(a, a_scale, out=out)

    def prepare(self, a: torch.Tensor, a_scale: torch.Tensor) -> PreparedBlock:
        """Work before the GEMM proper, on the current stream (short, non-persistent kernels)."""
        if not self.decodes_operands:
            return PreparedBlock(a, a_scale)
        self.decoded_weight()
        return PreparedBlock(a, a_scale, self.decode_rows(a, a_scale))

    def run_decoded(self, out: torch.Tensor, a_dequant: torch.Tensor) -> None:
        """DEQUANT_CUBLAS: ``out[:] = alpha * (a_dequant @ decode(b)^T)`` as ``triton_mm.mm_fp4_dequant_mm``
        computes it (cuBLAS into ``out``, then the in-place alpha scale)."""
        torch.mm(a_dequant, self.decoded_weight().t(), out=out)
        self._scale_by_alpha(out, self.alpha)

    def run(self, out: torch.Tensor, block: PreparedBlock) -> None:
        """``out[:] = mm_fp4(block.a, b, block.a_scale, b_scale, alpha, out_dtype)`` on the current
        stream; ``out`` a contiguous ``[rows, N]`` view."""
        if self.mode is GemmMode.DEQUANT_CUBLAS:
            self.run_decoded(out, block.a_dequant)
        elif self.mode is GemmMode.HOPPER:
            self._hopper(block.a, self.b, block.a_scale, self.b_scale, self.alpha, self.out_dtype, out=out)
        elif self.mode is GemmMode.DECODE:
            out.copy_(self._decode_gemm(block.a, self.b, block.a_scale, self.b_scale, self.alpha, self.out_dtype,
                                        config=self._config))
        elif self.mode is GemmMode.TILED:
            out.copy_(self._tiled(block.a, self.b, block.a_scale, self.b_scale, self.alpha, self.out_dtype,
                                  self._config))
        else:
            out.copy_(torch.ops.fp4fuse.mm_fp4(block.a, self.b, block.a_scale, self.b_scale, self.alpha,
                                               self.out_dtype))

    def __call__(self, out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor) -> None:
        self.run(out, self.prepare(a, a_scale))


def sum_in_rank_order(partials: torch.Tensor) -> torch.Tensor:
    """``partials[0] + partials[1] + ...`` (``[W, m, N]``) accumulated in fp32 in that order and
    rounded once to the partials' dtype: the same bits on every run and for every reduction kernel
    choice (``torch.sum`` over dim 0 does not promise an order)."""
    if partials.shape[0] == 2:  # one elementwise kernel: bf16/fp16 operands are added in fp32, rounded once
        return torch.add(partials[0], partials[1])
    if partials.is_cuda and backend_for(partials) is Backend.TRITON:
        from fp4fuse.kernels.triton.reduce import sum_partials_in_order
        return sum_partials_in_order(partials)  # one pass; the loop below makes W + 1 over fp32
    acc = partials[0].to(torch.float32, copy=True)
    for p in partials[1:]:
        acc += p
    return acc.to(partials.dtype)
