"""From how many tokens each rewrite is applied: ``FusionConfig.min_tokens``, or (``None``, the
default) the crossovers measured where a rewrite can pay.

* On CUDA the collective GEMMs fire from the thresholds their ops overlap from
  (``fp4fuse.distributed.symm_mem.policy.overlap_min_rows``: measured crossovers of
  ``benchmarks/bench_collective_gemm.py``; the same function the ops read at run time, so a fused
  call is an overlapped call), and sequence parallelism from :data:`SP_MIN_TOKENS_CUDA` tokens,
  the end-to-end crossover of ``benchmarks/bench_e2e.py`` at TP=2
  (``benchmarks/results/2026-11-27-sp-shared-quant-2xh100.md``); a norm output that NVFP4
  quantizations with global scales of their own read (:func:`sp_unshared_min_tokens`) from where
  the GEMM + reduce-scatter before the norm fires, and never without the collective GEMMs; a norm
  output before the last that neither a quantization nor a matmul reads
  (:func:`sp_unquantized_min_tokens`) never.
* Elsewhere (CPU, gloo) nothing overlaps and no crossover exists to measure: every size fuses, which
  keeps the rewrites exercised (the CPU tests, the demo).

A static token count is compared at compile time; a dynamic one is decided by its size hint with a
guard on the side chosen (``fp4fuse.patterns.base.threshold_reason``).
"""
from __future__ import annotations

import dataclasses

import torch

from fp4fuse.distributed.symm_mem import policy
from fp4fuse.distributed.symm_mem.policy import CollectiveGemmKind

__all__ = ["SPThresholds", "SP_MIN_TOKENS_CUDA", "async_tp_min_rows", "sp_min_tokens", "sp_thresholds",
           "sp_unquantized_min_tokens", "sp_unshared_min_tokens"]

#: Sequence parallelism's threshold on CUDA (total rows of the activation). Four collectives replace
#: one all-reduce, so small token counts, where collectives are latency-bound, cannot gain; on HF
#: Llama-3-8B shapes at TP=2 (2x H100) the rewrite lost at 2048 tokens and gained from 4096.
SP_MIN_TOKENS_CUDA = 4096


def sp_min_tokens(min_tokens: int | None, device: torch.device) -> int:
    """The sequence-parallel rewrites' threshold for activations on ``device``."""
    if min_tokens is not None:
        return min_tokens
    return SP_MIN_TOKENS_CUDA if device.type == "cuda" else 0


def sp_unshared_min_tokens(min_tokens: int | None, async_tp: bool, world: int, device: torch.device) -> int | None:
    """Sequence parallelism's threshold for a norm output read by NVFP4 quantizations with global
    scales of their own (a checkpoint's static ``input_scale`` per projection, held per module):
    after the rewrite each of them quantizes and gathers the output on its own, where readers whose
    scales are computed alike share one quantization and one gather. None: never.

    ``min_tokens`` when set. Elsewhere than CUDA 0, as :func:`sp_min_tokens`. On CUDA, with the
    collective GEMMs (``async_tp``), the larger of :data:`SP_MIN_TOKENS_CUDA` and the GEMM +
    reduce-scatter's threshold over ``world`` ranks; without them, never. Measured with static
    scales on HF Llama-3-8B shapes (``benchmarks/results/2026-11-27-static-scale-sp-2xh200.md``):
    the rewrite alone lost at every size (2048-8192 tokens at TP=2, 4096-8192 at TP=4), and with the
    collective GEMMs it gained only where the GEMM + reduce-scatter fired (TP=2 from 4096 tokens,
    TP=4 at 8192; at TP=4 and 4096 tokens, below that threshold, it lost)."""
    if min_tokens is None and device.type == "cuda" and not async_tp:
        return None
    return max(sp_min_tokens(min_tokens, device),
               async_tp_min_rows(min_tokens, CollectiveGemmKind.MATMUL_REDUCE_SCATTER, world, device))


def sp_unquantized_min_tokens(min_tokens: int | None, device: torch.device) -> int | None:
    """Sequence parallelism's threshold for a norm output, at the first or a middle norm, that no
    NVFP4 quantization and no matmul reads (a post-norm whose output feeds the residual add:
    Gemma 2 / 3's sandwich norms, OLMo 2). None: never.

    ``min_tokens`` when set; elsewhere than CUDA 0, as :func:`sp_min_tokens`; on CUDA never. After
    the rewrite such an output is gathered in its own dtype (no quantization before the gather)
    and no collective GEMM can overlap that gather: only the GEMM + reduce-scatter before the norm
    overlaps. Measured on HF Gemma 2 and OLMo 2 shapes at TP=2 (2x H100) at 4096 and 8192 tokens,
    the graph with the rewrite was slower than the one without it at both sizes
    (``benchmarks/results/2026-11-27-hf-families-gpu-2xh100.md``)."""
    if min_tokens is not None:
        return min_tokens
    return None if device.type == "cuda" else 0


@dataclasses.dataclass(frozen=True)
class SPThresholds:
    """The token counts from which a sequence-parallel match is rewritten, by what reads its norm
    output (None: never): ``min_tokens`` for every match, ``unshared`` where NVFP4 quantizations
    with global scales of their own read it (:func:`sp_unshared_min_tokens`), ``unquantized`` at
    a first or middle norm that no quantization and no matmul reads (:func:`sp_unquantized_min_tokens`)."""

    min_tokens: int = 0
    unshared: int | None = 0
    unquantized: int | None = 0


def sp_thresholds(min_tokens: int | None, async_tp: bool, world: int, device: torch.device) -> SPThresholds:
    """:class:`SPThresholds` for activations on ``device`` over ``world`` ranks."""
    return SPThresholds(sp_min_tokens(min_tokens, device), sp_unshared_min_tokens(min_tokens, async_tp, world, device),
                        sp_unquantized_min_tokens(min_tokens, device))


def async_tp_min_rows(min_tokens: int | None, kind: CollectiveGemmKind, world: int, device: torch.device) -> int:
    """The collective GEMM rewrite's threshold (total rows) for ``kind`` over ``world`` ranks."""
    if min_tokens is not None:
        return min_tokens
    return policy.overlap_min_rows(kind, world) if device.type == "cuda" else 0
