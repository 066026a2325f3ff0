"""From how many tokens each rewrite is applied: ``FusionConfig.min_tokens``, or (``None``, the
default) the crossovers measured where a rewrite can pay.

* On CUDA the collective GEMMs fire from the thresholds their ops overlap from
  (``fp4fuse.distributed.symm_mem.policy.overlap_min_rows``: measured crossovers of
  ``benchmarks/bench_collective_gemm.py``; the same function the ops read at run time, so a fused
  call is an overlapped call), and sequence parallelism from :data:`SP_MIN_TOKENS_CUDA` tokens,
  the end-to-end crossover of ``benchmarks/bench_e2e.py`` at TP=2
  (``benchmarks/results/2026-11-27-sp-shared-quant-2xh100.md``).
* Elsewhere (CPU, gloo) nothing overlaps and no crossover exists to measure: every size fuses, which
  keeps the rewrites exercised (the CPU tests, the demo).

A static token count is compared at compile time; a dynamic one is decided by its size hint with a
guard on the side chosen (``fp4fuse.patterns.base.threshold_reason``).
"""
from __future__ import annotations

import torch

from fp4fuse.distributed.symm_mem import policy
from fp4fuse.distributed.symm_mem.policy import CollectiveGemmKind

__all__ = ["SP_MIN_TOKENS_CUDA", "async_tp_min_rows", "sp_min_tokens"]

#: Sequence parallelism's threshold on CUDA (total rows of the activation). Four collectives replace
#: one all-reduce, so small token counts, where collectives are latency-bound, cannot gain; on HF
#: Llama-3-8B shapes at TP=2 (2x H100) the rewrite lost at 2048 tokens and gained from 4096.
SP_MIN_TOKENS_CUDA = 4096


def sp_min_tokens(min_tokens: int | None, device: torch.device) -> int:
    """The sequence-parallel rewrites' threshold for activations on ``device``."""
    if min_tokens is not None:
        return min_tokens
    return SP_MIN_TOKENS_CUDA if device.type == "cuda" else 0


def async_tp_min_rows(min_tokens: int | None, kind: CollectiveGemmKind, world: int, device: torch.device) -> int:
    """The collective GEMM rewrite's threshold (total rows) for ``kind`` over ``world`` ranks."""
    if min_tokens is not None:
        return min_tokens
    return policy.overlap_min_rows(kind, world) if device.type == "cuda" else 0
