"""W4A4 NVFP4 GEMM for small and middle M (decode steps, small prefill chunks), in Triton.

Contract: ``mm_fp4_decode(a, b, a_scale, b_scale, alpha, out_dtype) -> out [M, N]``, the same as
``mm_fp4``: a uint8 ``[M, K/2]`` (activation), b uint8 ``[N, K/2]`` (weight, row-major), linear e4m3
block scales ``[M, K/16]`` / ``[N, K/16]``, alpha a one-element fp32 device tensor read in the
kernel (never synchronised to the host) or the two global scales it is computed from
(``fp4fuse.kernels.triton.alpha``), ``out = alpha * (q_a * s_a) @ (q_b * s_b)^T`` in
bf16/fp16/fp32. Inputs are validated by the op layer (contiguous, dtypes, ``K % 16 == 0``). Used up to
``DECODE_MAX_M`` rows: one launch up to ``INKERNEL_DECODE_MAX_M`` rows (``MID_INKERNEL_MAX_M`` on small
weights), two above (the activation is pre-decoded once).

Numerics: both operands are decoded in registers to fp16 ``e2m1 * 2**-14 * s`` (exact; the
decoders of ``fp4fuse.kernels.triton.mm``), products are exact in fp32 and the MMAs accumulate in fp32;
the epilogue multiplies by ``2**28`` (exact) and then alpha, and rounds once to ``out_dtype``. With
split-K the fp32 partials are summed in split order before that epilogue. The result is the float64
reference (``fp4fuse.nvfp4.format.mm_fp4_reference``) up to fp32 accumulation and one rounding. A NaN
block scale (e4m3 0x7F/0xFF) makes its 16 values NaN, so every output that reads them is NaN.

Kernel design (``_mm_decode_kernel``):

* Swapped product: a program computes ``acc[BLOCK_N, BLOCK_M] = W_tile @ A_tile^T``, so the weight
  tile is the MMA's A operand and takes its register layout (on Hopper a wgmma with A in registers:
  the weight is decoded straight into MMA fragments and never stored decoded), and the small
  activation tile is the B operand (decoded once per program and step, through shared memory).
  ``tl.dot`` needs 16 rows or more, so M < 16 is padded: rows past M read other rows
  (``decode.readable_rows``) and are not stored.
* One K step reads ``BLOCK_K / 2`` contiguous code bytes of every row (16-byte loads, pipelined by
  Triton into shared memory with ``num_stages`` buffers) and ``BLOCK_K / 16`` scale bytes. Each
  nibble plane (low nibbles = even elements, high = odd) feeds one MMA; inside the step the K order
  is permuted (``_decoded_tile``) so that the 16 code bytes one MMA fragment needs are contiguous
  and share two block scales. The permutation is the same for both operands, so the dot product is
  unchanged. Without it, Triton gathers each fragment from 2-byte shared-memory loads and packs
  them with byte permutes (about 1.5x the instructions per weight element, SASS of Triton 3.6 for
  sm_90).
* Up to ``INKERNEL_DECODE_MAX_M`` rows the activation is decoded in the kernel, per program and step
  (``BLOCK_M x BLOCK_K`` values against ``BLOCK_N x BLOCK_K`` weight values), so a call is a single
  launch. Above, every weight tile's program would decode the whole activation again, so
  ``_predecode_kernel`` writes it once as fp16 planes in the same permuted order (``PREDECODED``:
  the GEMM loads them as the MMA's B operand); the products and their order are unchanged, so the
  result is bitwise the in-kernel decode's. On small weights the fp16 planes, 4x the bytes of the
  codes and read again by every weight tile, cost more than decoding the codes again, and the
  in-kernel decode serves up to ``MID_INKERNEL_MAX_M`` rows (``wide_step_config``).
* Loads of 1 or 2 bytes per thread are not pipelined by Triton (cp.async moves 4, 8 or 16 bytes):
  they stay synchronous in the K loop, and in ``wide_step_config``'s 16-row tile the activation's
  block scales (16 x 16 bytes a 256-element step, 2 per thread) were the kernel's largest stall
  (ncu, M=16, N=K=8192; benchmarks/results/). With ``DecodeConfig.scale_words``, where K/16 is a
  multiple of 4 and the scales are 4-byte aligned, ``A_SCALE_WORDS`` loads them as int32 words of 4
  scales (``_scale_words``), which the pipeliner stages like the codes; the scales, products and
  their order are unchanged. A traced launch (fp4fuse's kernel lowering) cannot read the address
  and keeps the byte loads.
* Split-K inside the launch, deterministic: program ``(tile, split)`` covers K steps
  ``[split * iters_per_split, +iters_per_split)``. With more than one split each program writes
  its fp32 partial tile to ``workspace.partials[tile, split]``, then (after a CTA barrier) one
  thread adds 1 to ``workspace.counters[tile]`` with an acq_rel atomic at GPU scope. The program
  that sees ``split_k - 1`` arrivals before its own is the last one: it reads the partials of all
  splits (L1 bypassed) and adds them in split order 0, 1, ... -- the same bits whatever order the
  programs ran in -- applies ``2**28 * alpha``, writes ``out`` and stores 0 to the counter, so the
  workspace is ready for the next call. No atomics touch ``out``.

Workspace rule: ``workspace=None`` allocates the split-K scratch for the call (``torch.empty``
partials and ``torch.zeros`` counters: one memset). Nothing is cached across calls: CUDA-graph trees
(``triton.cudagraphs``) require every tensor allocated from a graph's memory pool to be a tracked
output or freed, which a module-level cache would violate, and a traced launch (fp4fuse's kernel
lowering) must allocate in the graph anyway. A caller may pass a ``DecodeWorkspace`` from
``empty_decode_workspace`` (counters zero before the first call; every call leaves them zero).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fp4fuse.kernels.triton.alpha import Alpha, alpha_meta, alpha_operands, empty_sum_, load_alpha
from fp4fuse.kernels.triton.decode import (
    DECODE_SCALE_UNDO, decode_codes, decode_scales, num_sms, readable_rows, split_ranges,
)
from fp4fuse.kernels.triton.launch import traceable, tracing
from fp4fuse.nvfp4.format import BLOCK_SIZE

logger = logging.getLogger(__name__)

__all__ = [
    "DecodeConfig",
    "DecodeProduct",
    "DecodeWeight",
    "DecodeWorkspace",
    "DECODE_MAX_M",
    "DECODE_ROW_RANGES",
    "MAX_GROUP",
    "config_rows",
    "decode_config_for",
    "decode_workspace_numel",
    "empty_decode_workspace",
    "filling_split",
    "finish_tile",
    "group_configs",
    "leaves_counters_zero",
    "mm_fp4_decode",
    "mm_fp4_decode_group",
    "mm_fp4_decode_products",
    "narrow_step_config",
    "permuted_planes",
    "predecode_activation",
    "predecode_activations",
    "wide_step_config",
]



@triton.jit
def _scale_words(s_ptr, s_rows, grp0, KG, G: tl.constexpr, EVEN_K: tl.constexpr):
    """Block scales ``[grp0, grp0 + G)`` of each row as uint8 ``[R, G]``, loaded as int32 words of 4
    scales (byte ``j`` of word ``w`` is group ``4 * w + j``, little-endian), so that every thread
    loads at least 4 bytes: Triton's pipeliner then moves the load into its asynchronous shared
    memory stages (cp.async takes 4, 8 or 16 bytes), where 1-2 byte loads stay synchronous in the
    loop. Needs ``s_ptr``, every row offset ``s_rows`` and ``grp0`` to be multiples of 4 bytes."""
    W: tl.constexpr = G // 4
    words = grp0 // 4 + tl.arange(0, W)
    ptrs = s_ptr.to(tl.pointer_type(tl.int32)) + (s_rows // 4)[:, None] + words[None, :]
    if EVEN_K:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=(words < KG // 4)[None, :], other=0)
    b0 = (w & 0xFF).to(tl.uint8)
    b1 = ((w >> 8) & 0xFF).to(tl.uint8)
    b2 = ((w >> 16) & 0xFF).to(tl.uint8)
    b3 = ((w >> 24) & 0xFF).to(tl.uint8)
    # join(join(b0, b2), join(b1, b3))[..., i, j] is b(2i + j): flattened, the bytes in order
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (s_rows.shape[0], G))


@triton.jit
def _decoded_tile(q_ptr, s_ptr, q_rows, s_rows, kb0, KB, KG,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FAST_DECODE: tl.constexpr,
                  SCALE_WORDS: tl.constexpr = False):
    """One K step of ``R = len(q_rows)`` NVFP4 rows -> (low, high) nibble planes, fp16
    ``[R, BLOCK_K / 2]``, each value ``e2m1 * 2**-14 * s`` (exact).

    ``q_rows`` / ``s_rows``: int64 offsets of the rows in the codes / scales; the step covers code
    bytes ``[kb0, kb0 + BLOCK_K / 2)``, masked at ``KB`` bytes (and groups at ``KG``) unless EVEN_K.
    SCALE_WORDS: load the scales 4 to a word (``_scale_words``; the caller checks its alignment rule).
    Column ``k`` of a plane is code byte ``8 * R_ * t + 8 * r + 4 * c + 2 * h + e`` of the step,
    where ``k = 32 * r + 16 * c + 8 * h + 2 * t + e`` (``R_ = BLOCK_K / 64``, t < 4, c, h, e < 2):
    one MMA fragment (columns ``2t, 2t+1, 2t+8, 2t+9`` of each 16) then comes from contiguous bytes.
    Both operands use this order, so their product over K is unchanged."""
    BKB: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 16
    kb = kb0 + tl.arange(0, BKB)
    grp = kb0 // 8 + tl.arange(0, G)
    if EVEN_K:
        codes = tl.load(q_ptr + q_rows[:, None] + kb[None, :])
    else:
        codes = tl.load(q_ptr + q_rows[:, None] + kb[None, :], mask=(kb < KB)[None, :], other=0)
    if SCALE_WORDS:
        scales = _scale_words(s_ptr, s_rows, kb0 // 8, KG, G, EVEN_K).to(tl.float8e4nv, bitcast=True)
    elif EVEN_K:
        scales = tl.load(s_ptr + s_rows[:, None] + grp[None, :])
    else:
        scales = tl.load(s_ptr + s_rows[:, None] + grp[None, :], mask=(grp < KG)[None, :], other=0.0)
    return permuted_planes(codes, scales, BLOCK_K, FAST_DECODE)


@triton.jit
def permuted_planes(codes, scales, BLOCK_K: tl.constexpr, FAST_DECODE: tl.constexpr):
    """``_decoded_tile`` of a step already loaded: code bytes ``[R, BLOCK_K / 2]`` and e4m3 block
    scales ``[R, BLOCK_K / 16]`` -> the (low, high) fp16 planes in the step's permuted order."""
    NR: tl.constexpr = codes.shape[0]
    BKB: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 16
    RR: tl.constexpr = BLOCK_K // 64
    lo, hi = decode_codes(codes, FAST_DECODE)
    s = decode_scales(scales, FAST_DECODE)[:, :, None]
    lo = tl.reshape(tl.reshape(lo, (NR, G, 8)) * s, (NR, 4, RR, 2, 2, 2))
    hi = tl.reshape(tl.reshape(hi, (NR, G, 8)) * s, (NR, 4, RR, 2, 2, 2))
    lo = tl.reshape(tl.permute(lo, (0, 2, 3, 4, 1, 5)), (NR, BKB))
    hi = tl.reshape(tl.permute(hi, (0, 2, 3, 4, 1, 5)), (NR, BKB))
    return lo, hi


@triton.jit
def _store_output(acc, alpha_ptr, alpha_b_ptr, out_ptr, rows_m, cols_n, M, N,
                  ALPHA_FROM_SCALES: tl.constexpr, ALPHA_DIV_RN: tl.constexpr):
    """``out[m, n] = acc[n, m] * 2**28 * alpha`` for ``m < M``, ``n < N``, in out's dtype
    (alpha: ``fp4fuse.kernels.triton.alpha.load_alpha``)."""
    alpha = load_alpha(alpha_ptr, alpha_b_ptr, ALPHA_FROM_SCALES, ALPHA_DIV_RN)
    res = (acc * DECODE_SCALE_UNDO) * alpha
    offs = rows_m[None, :].to(tl.int64) * N + cols_n[:, None]
    mask = (rows_m < M)[None, :] & (cols_n < N)[:, None]
    tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _predecode_kernel(q0_ptr, s0_ptr, lo0_ptr, hi0_ptr, q1_ptr, s1_ptr, lo1_ptr, hi1_ptr,
                      q2_ptr, s2_ptr, lo2_ptr, hi2_ptr, M, KB, KG, KBP,
                      SEGMENTS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      FAST_DECODE: tl.constexpr):
    """Program ``(row block, K step, segment)``: ``_decoded_tile`` of ``ROWS`` rows of the segment's
    activation (``SEGMENTS``: 1 to 3 activations of one shape), stored into its fp16 planes ``lo`` /
    ``hi`` ``[M, KBP]`` (``KBP``: K/2 rounded up to whole steps, so a partial last step keeps its
    permuted columns; the padding holds zeros)."""
    q_ptr, s_ptr, lo_ptr, hi_ptr = q0_ptr, s0_ptr, lo0_ptr, hi0_ptr
    if SEGMENTS > 1:
        segment = tl.program_id(2)
        if segment == 1:
            q_ptr, s_ptr, lo_ptr, hi_ptr = q1_ptr, s1_ptr, lo1_ptr, hi1_ptr
        if SEGMENTS == 3:
            if segment == 2:
                q_ptr, s_ptr, lo_ptr, hi_ptr = q2_ptr, s2_ptr, lo2_ptr, hi2_ptr
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kb0 = tl.program_id(1) * (BLOCK_K // 2)
    src = readable_rows(rows, M).to(tl.int64)
    lo, hi = _decoded_tile(q_ptr, s_ptr, src * KB, src * KG, kb0, KB, KG, BLOCK_K, EVEN_K, FAST_DECODE)
    offs = rows[:, None].to(tl.int64) * KBP + kb0 + tl.arange(0, BLOCK_K // 2)[None, :]
    tl.store(lo_ptr + offs, lo, mask=(rows < M)[:, None])
    tl.store(hi_ptr + offs, hi, mask=(rows < M)[:, None])


@triton.jit(do_not_specialize=["M", "iters_per_split", "n_split"])
def _mm_decode_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, alpha_ptr, alpha_b_ptr, out_ptr, part_ptr, count_ptr,
    M, N, KB, KG, KBP, iters_per_split, n_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, EVEN_K: tl.constexpr, FAST_DECODE: tl.constexpr,
    PREDECODED: tl.constexpr, A_SCALE_WORDS: tl.constexpr = False,
    ALPHA_FROM_SCALES: tl.constexpr = False, ALPHA_DIV_RN: tl.constexpr = False,
):
    """Program ``(tile, split)`` of one product: ``_decode_program``."""
    _decode_program(a_ptr, as_ptr, b_ptr, bs_ptr, alpha_ptr, alpha_b_ptr, out_ptr, part_ptr, count_ptr,
                    tl.program_id(0), tl.program_id(1), M, N, KB, KG, KBP, iters_per_split, n_split,
                    BLOCK_M, BLOCK_N, BLOCK_K, PARTIAL, EVEN_K, FAST_DECODE, PREDECODED, A_SCALE_WORDS,
                    ALPHA_FROM_SCALES, ALPHA_DIV_RN)


@triton.jit(do_not_specialize=["M", "iters0", "split0", "iters1", "split1", "iters2", "split2"])
def _mm_decode_group_kernel(
    part_ptr, count_ptr, M, KB, KG, KBP,
    a0_ptr, as0_ptr, b0_ptr, bs0_ptr, al0_ptr, alb0_ptr, out0_ptr, N0, iters0, split0,
    a1_ptr, as1_ptr, b1_ptr, bs1_ptr, al1_ptr, alb1_ptr, out1_ptr, N1, iters1, split1,
    a2_ptr, as2_ptr, b2_ptr, bs2_ptr, al2_ptr, alb2_ptr, out2_ptr, N2, iters2, split2,
    SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, FAST_DECODE: tl.constexpr, PREDECODED: tl.constexpr, A_SCALE_WORDS: tl.constexpr,
    ALPHA_FROM_SCALES: tl.constexpr, ALPHA_DIV_RN: tl.constexpr,
):
    """``SEGMENTS`` (2 or 3) products of ``M``-row activations (one shared, or one each) with their
    own weights, alphas and outputs in one launch: programs ``[0, tiles0 * split0)`` are segment 0's
    ``(tile, split)`` programs, tile fastest (as in ``_mm_decode_kernel``'s grid), then segment 1's
    and segment 2's. Each segment's partials and counters follow the previous segment's in the
    workspace. Every segment takes the split-K path (a segment of one split reduces its single
    partial: the same bits)."""
    TILE: tl.constexpr = BLOCK_N * BLOCK_M
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles = tiles_m * tl.cdiv(N0, BLOCK_N)
    first = pid * 0
    part, count = part_ptr, count_ptr
    a_ptr, as_ptr = a0_ptr, as0_ptr
    b_ptr, bs_ptr, al_ptr, alb_ptr, out_ptr, N, iters, n_split = b0_ptr, bs0_ptr, al0_ptr, alb0_ptr, out0_ptr, N0, iters0, split0
    if pid >= tiles * split0:
        first = tiles * split0
        part = part_ptr + first.to(tl.int64) * TILE
        count = count_ptr + tiles
        a_ptr, as_ptr = a1_ptr, as1_ptr
        b_ptr, bs_ptr, al_ptr, alb_ptr, out_ptr, N, iters, n_split = b1_ptr, bs1_ptr, al1_ptr, alb1_ptr, out1_ptr, N1, iters1, split1
        tiles = tiles_m * tl.cdiv(N1, BLOCK_N)
        if SEGMENTS == 3:
            if pid >= first + tiles * split1:
                part = part + (tiles * split1).to(tl.int64) * TILE
                count = count + tiles
                first = first + tiles * split1
                a_ptr, as_ptr = a2_ptr, as2_ptr
                b_ptr, bs_ptr, al_ptr, alb_ptr, out_ptr, N, iters, n_split = b2_ptr, bs2_ptr, al2_ptr, alb2_ptr, out2_ptr, N2, iters2, split2
                tiles = tiles_m * tl.cdiv(N2, BLOCK_N)
    local = pid - first
    _decode_program(a_ptr, as_ptr, b_ptr, bs_ptr, al_ptr, alb_ptr, out_ptr, part, count,
                    local % tiles, local // tiles, M, N, KB, KG, KBP, iters, n_split,
                    BLOCK_M, BLOCK_N, BLOCK_K, True, EVEN_K, FAST_DECODE, PREDECODED, A_SCALE_WORDS,
                    ALPHA_FROM_SCALES, ALPHA_DIV_RN)


@triton.jit
def _decode_program(
    a_ptr, as_ptr, b_ptr, bs_ptr, alpha_ptr, alpha_b_ptr, out_ptr, part_ptr, count_ptr,
    tile, split, M, N, KB, KG, KBP, iters_per_split, n_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, EVEN_K: tl.constexpr, FAST_DECODE: tl.constexpr,
    PREDECODED: tl.constexpr, A_SCALE_WORDS: tl.constexpr,
    ALPHA_FROM_SCALES: tl.constexpr, ALPHA_DIV_RN: tl.constexpr,
):
    """Program ``(tile, split)``: ``acc[BLOCK_N, BLOCK_M]`` = weight rows of the tile times its
    activation rows over the split's K steps, then the output (``n_split == 1``, not PARTIAL) or
    the partial + last-arriver reduction (PARTIAL; module docstring). Tiles are numbered with the
    M tile fastest, so programs sharing a weight tile run side by side (L2 reuse).
    PREDECODED: ``a_ptr`` / ``as_ptr`` are the fp16 planes of ``_predecode_kernel`` (row stride
    ``KBP``), loaded as they are instead of decoding the activation in every program."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = tile % tiles_m
    pid_n = tile // tiles_m
    BKB: tl.constexpr = BLOCK_K // 2

    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # rows past the matrix read other rows (in bounds, finite or not) and are never stored
    w_rows = readable_rows(cols_n, N).to(tl.int64)
    a_rows = readable_rows(rows_m, M).to(tl.int64)

    kb_begin = split * iters_per_split * BKB
    kb_end = tl.minimum(kb_begin + iters_per_split * BKB, KB)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb0 in range(kb_begin, kb_end, BKB):
        w_lo, w_hi = _decoded_tile(b_ptr, bs_ptr, w_rows * KB, w_rows * KG, kb0, KB, KG,
                                   BLOCK_K, EVEN_K, FAST_DECODE)
        if PREDECODED:
            x_offs = a_rows[:, None] * KBP + kb0 + tl.arange(0, BKB)[None, :]
            x_lo = tl.load(a_ptr + x_offs)
            x_hi = tl.load(as_ptr + x_offs)
        else:
            x_lo, x_hi = _decoded_tile(a_ptr, as_ptr, a_rows * KB, a_rows * KG, kb0, KB, KG,
                                       BLOCK_K, EVEN_K, FAST_DECODE, A_SCALE_WORDS)
        acc = tl.dot(w_lo, tl.trans(x_lo), acc)
        acc = tl.dot(w_hi, tl.trans(x_hi), acc)

    finish_tile(acc, alpha_ptr, alpha_b_ptr, out_ptr, part_ptr, count_ptr, tile, split, n_split, rows_m, cols_n, M, N,
                PARTIAL, ALPHA_FROM_SCALES, ALPHA_DIV_RN)


@triton.jit
def finish_tile(acc, alpha_ptr, alpha_b_ptr, out_ptr, part_ptr, count_ptr, tile, split, n_split, rows_m, cols_n, M, N,
                PARTIAL: tl.constexpr, ALPHA_FROM_SCALES: tl.constexpr, ALPHA_DIV_RN: tl.constexpr):
    """The end of program ``(tile, split)`` with its fp32 ``acc[BLOCK_N, BLOCK_M]``: the output
    (not PARTIAL), or the partial and the last-arriver reduction (PARTIAL; module docstring)."""
    if not PARTIAL:
        _store_output(acc, alpha_ptr, alpha_b_ptr, out_ptr, rows_m, cols_n, M, N, ALPHA_FROM_SCALES, ALPHA_DIV_RN)
    else:
        BLOCK_N: tl.constexpr = acc.shape[0]
        BLOCK_M: tl.constexpr = acc.shape[1]
        TILE: tl.constexpr = BLOCK_N * BLOCK_M
        in_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tile_base = part_ptr + tile.to(tl.int64) * n_split * TILE
        tl.store(tile_base + split * TILE + in_tile, acc)
        # every thread's partial is written before thread 0 releases the arrival
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == n_split - 1:
            total = tl.load(tile_base + in_tile, cache_modifier=".cg")
            for sp in range(1, n_split):
                total += tl.load(tile_base + sp * TILE + in_tile, cache_modifier=".cg")
            _store_output(total, alpha_ptr, alpha_b_ptr, out_ptr, rows_m, cols_n, M, N,
                          ALPHA_FROM_SCALES, ALPHA_DIV_RN)
            tl.store(count_ptr + tile, 0)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """One launch of ``_mm_decode_kernel``: ``[block_n, block_m]`` (weight rows x activation rows)
    output tiles, ``block_k`` K elements per step (a multiple of 64), ``split_k`` K ranges per tile
    (reduced in the same launch), Triton's ``num_warps`` / ``num_stages``, and ``max_registers``
    per thread (ptxas's ``maxnreg``; None: the compiler's choice). ``predecode``: decode the
    activation once into fp16 planes (``predecode_activation``, one more launch) instead of in
    every program; pays where many weight tiles share the activation rows (larger M).
    ``scale_words``: load the activation's block scales as int32 words (module docstring) where
    their alignment allows; without ``predecode`` only."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    max_registers: int | None = None
    predecode: bool = False
    scale_words: bool = False


class DecodeWorkspace(NamedTuple):
    """Split-K scratch: ``partials`` fp32 and ``counters`` int32 (zero between calls), both
    contiguous with at least ``decode_workspace_numel`` elements."""

    partials: torch.Tensor
    counters: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a launch covers: tiles, effective split count, K steps per split, mask-free K."""

    tiles: int | torch.SymInt
    split: int
    iters_per_split: int
    even_k: bool


def _plan(cfg: DecodeConfig, m: int | torch.SymInt, n: int, k: int) -> _Plan:
    """Effective split: at most one per K step, and no split without a K step. Memoized for a
    plain row count, like ``decode_config_for``; a symbolic one (a traced launch) gives a
    symbolic tile count."""
    if isinstance(m, int):
        return _plan_for_rows(cfg, m, n, k)
    return _make_plan(cfg, m, n, k)


def _make_plan(cfg: DecodeConfig, m: int | torch.SymInt, n: int, k: int) -> _Plan:
    kb = k // 2
    bkb = cfg.block_k // 2
    split, iters = split_ranges(triton.cdiv(kb, bkb), cfg.split_k)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return _Plan(tiles=tiles, split=split, iters_per_split=iters, even_k=kb % bkb == 0)


_plan_for_rows = functools.lru_cache(maxsize=4096)(_make_plan)


def decode_workspace_numel(m: int, n: int, k: int, config: DecodeConfig) -> tuple[int, int]:
    """``(partials, counters)`` element counts one call needs; ``(0, 0)`` when it does not split."""
    plan = _plan(config, m, n, k)
    if plan.split == 1:
        return 0, 0
    return plan.tiles * plan.split * config.block_n * config.block_m, plan.tiles


def _fits(ws: DecodeWorkspace, partials: int, counters: int) -> bool:
    return ws.partials.numel() >= partials and ws.counters.numel() >= counters


def empty_decode_workspace(partials: int, counters: int, device: torch.device) -> DecodeWorkspace:
    """A new workspace with room for ``partials`` / ``counters`` elements (counters zeroed)."""
    return DecodeWorkspace(torch.empty(max(partials, 1), dtype=torch.float32, device=device),
                           torch.zeros(max(counters, 1), dtype=torch.int32, device=device))


#: (block_m, block_n, num_warps) -> (max_registers, programs one multiprocessor holds at once) of
#: the default tiles, from ptxas's register counts for the sm_90 build (Triton 3.6, 64K registers
#: per multiprocessor, no spills): a 128-register cap costs no spill for 16 and 32 activation rows
#: (136 -> 124 and 154 -> 125 registers) and makes room for a 4th program.
_TILES = {(16, 64, 4): (None, 8), (16, 128, 4): (128, 4), (32, 128, 4): (128, 4), (64, 128, 4): (None, 3)}
#: At least this many K steps per split: a program spends about ``num_stages - 1`` steps filling
#: its load pipeline.
MIN_STEPS_PER_SPLIT = 4

#: Largest M that ``fp4fuse.kernels.triton.mm.mm_fp4_triton`` sends to this kernel: up to
#: ``INKERNEL_DECODE_MAX_M`` rows with the activation decoded in every program, above with it
#: pre-decoded once (``predecode_activation``) and 128 x 64 tiles (``benchmarks/bench_ops.py
#: --mid-sweep``; results in benchmarks/results/), except small launches up to
#: ``MID_INKERNEL_MAX_M`` rows (``wide_step_config``).
DECODE_MAX_M = 256
INKERNEL_DECODE_MAX_M = 64
MAX_SPLIT = 16
#: Programs per multiprocessor that split-K aims at with the pre-decoded 128 x 64 tiles.
PREDECODE_PROGRAMS_PER_SM = 2
#: ``wide_step_config`` serves up to this many activation rows (up to 16 only on weights of at
#: least ``WIDE_STEP_MIN_WEIGHT`` elements), with split-K aiming at this many programs per
#: multiprocessor; in two 32-row tiles ``WIDE_STEP_MAX_M + 1`` to ``INKERNEL_DECODE_MAX_M`` rows on
#: weights of fewer than ``WIDE_STEP_MAX_WEIGHT_TWO_TILES`` elements; and in four,
#: ``INKERNEL_DECODE_MAX_M + 1`` to ``MID_INKERNEL_MAX_M`` rows on weights of at most
#: ``MID_INKERNEL_MAX_WEIGHT`` elements (Llama-3-8B's TP=2 q, k, v and o shards, and smaller ones),
#: where the pre-decoded fp16 activation (4x the bytes of its codes), read again by every weight
#: tile, costs more than decoding the codes again (benchmarks/results/2026-11-27-small-shards-mid-rows-h100.md).
WIDE_STEP_MAX_M = 32
WIDE_STEP_MIN_WEIGHT = 1 << 24
WIDE_STEP_MAX_WEIGHT_TWO_TILES = 1 << 25
WIDE_STEP_PROGRAMS_PER_SM = 4
MID_INKERNEL_MAX_WEIGHT = 1 << 23
MID_INKERNEL_MAX_M = 128
#: Register cap of ``wide_step_config``'s tiles: 4 programs of 4 warps per multiprocessor. Without
#: it the 16-row tile with word-loaded activation scales takes 144 registers (3 programs); capped
#: it takes 128 without spilling (ptxas, sm_90, Triton 3.6).
WIDE_STEP_MAX_REGISTERS = 128


#: Top row counts of the ranges over which ``decode_config_for`` gives one configuration (for any
#: N, K: the 16-, 32- and 64-row tiles cover their range in one tile row, the 32-row tile 33-64 rows
#: in two and 65-128 rows in four, the pre-decoded 128-row tiles in one and two).
DECODE_ROW_RANGES = (16, WIDE_STEP_MAX_M, INKERNEL_DECODE_MAX_M, MID_INKERNEL_MAX_M, DECODE_MAX_M)


def _range_top(m: int | torch.SymInt) -> int:
    """The top of ``DECODE_ROW_RANGES``' range holding ``m`` rows (a symbolic ``m`` is guarded by the
    comparisons); more than ``DECODE_MAX_M`` rows raise."""
    for top in DECODE_ROW_RANGES:
        if m <= top:
            return top
    raise ValueError(f"mm_fp4_decode: {m} activation rows; the decode GEMM serves at most {DECODE_MAX_M}")


def config_rows(m: int | torch.SymInt) -> int:
    """The row count to ask ``decode_config_for`` about for ``m`` activation rows: ``m`` itself, or,
    for a symbolic count (a launch traced into a graph compiled with a dynamic batch, fp4fuse's
    kernel lowering), the top of its range in ``DECODE_ROW_RANGES``. Every count of a range gets
    the same configuration, so the traced launch is the one the eager op makes at every count the
    compiled graph runs at. Comparing a symbolic count guards it: torch.compile decides by the size
    hint and records the guard, and a count in another range recompiles."""
    return m if isinstance(m, int) else _range_top(m)


def filling_split(tiles: int, k: int, num_sms: int, programs_per_sm: int, block_k: int = 128) -> int:
    """Split-K count bringing ``tiles`` programs to about ``programs_per_sm`` per multiprocessor, with at
    least ``MIN_STEPS_PER_SPLIT`` K steps of ``block_k`` elements per split and at most ``MAX_SPLIT``."""
    steps = triton.cdiv(k, block_k)
    return max(1, min(MAX_SPLIT, programs_per_sm * num_sms // tiles, steps // MIN_STEPS_PER_SPLIT))


@functools.lru_cache(maxsize=4096)
def decode_config_for(m: int, n: int, k: int, num_sms: int = 132) -> DecodeConfig:
    """Launch configuration for an ``[m, k] x [n, k]^T`` product on ``num_sms`` multiprocessors:
    ``wide_step_config`` from 17 to ``WIDE_STEP_MAX_M`` rows, up to 16 rows on weights of
    ``WIDE_STEP_MIN_WEIGHT`` elements or more, from ``WIDE_STEP_MAX_M + 1`` to ``INKERNEL_DECODE_MAX_M``
    rows on weights of fewer than ``WIDE_STEP_MAX_WEIGHT_TWO_TILES`` elements and from
    ``INKERNEL_DECODE_MAX_M + 1`` to ``MID_INKERNEL_MAX_M`` rows on weights of at most
    ``MID_INKERNEL_MAX_WEIGHT``; ``narrow_step_config`` on other products up to ``INKERNEL_DECODE_MAX_M``
    rows; and on other products above, the activation pre-decoded (``predecode``, since every weight
    tile's program would decode it again) with tiles of 128 activation rows x 64 weight rows, 4 warps,
    split-K bringing the grid to ``PREDECODE_PROGRAMS_PER_SM`` programs per multiprocessor: the best or
    within 3% of the best of 7 tiles at M = 128 and 256 on five Llama-3-8B / 8192^2 shapes, 1.4-2.1x
    faster than the tiled kernel and dequantize + cuBLAS there (benchmarks/results/).

    The configuration depends on the product alone, never on the products a launch groups it with
    (``group_configs``): a grouped launch then computes each product's output bitwise as its own
    launch would, so a graph whose sibling GEMMs are lowered into one launch keeps the bits of the
    graph without the pass.

    No autotuning at run time: a serving engine sees many M. Memoized (a pure function of its
    arguments; the configuration is frozen): an eager decode step is host-bound."""
    weight = n * k
    if INKERNEL_DECODE_MAX_M < m <= MID_INKERNEL_MAX_M and weight <= MID_INKERNEL_MAX_WEIGHT:
        return wide_step_config(m, n, k, num_sms)
    if m > INKERNEL_DECODE_MAX_M:
        split = filling_split(triton.cdiv(m, 128) * triton.cdiv(n, 64), k, num_sms, PREDECODE_PROGRAMS_PER_SM)
        return DecodeConfig(block_m=128, block_n=64, block_k=128, split_k=split, num_warps=4, num_stages=3,
                            predecode=True)
    if m <= WIDE_STEP_MAX_M and (m > 16 or weight >= WIDE_STEP_MIN_WEIGHT):
        return wide_step_config(m, n, k, num_sms)
    if m > WIDE_STEP_MAX_M and weight < WIDE_STEP_MAX_WEIGHT_TWO_TILES:
        return wide_step_config(m, n, k, num_sms)
    return narrow_step_config(m, n, k, num_sms)


def wide_step_config(m: int, n: int, k: int, num_sms: int = 132) -> DecodeConfig:
    """Tiles of 16 (up to 16 rows) or 32 activation rows (above: one tile row up to
    ``WIDE_STEP_MAX_M`` rows, two up to ``INKERNEL_DECODE_MAX_M``, four up to ``MID_INKERNEL_MAX_M``) x 64
    weight rows, 256 K elements a step (128 code bytes of a weight row per load), 4 warps, 3 stages,
    split-K bringing the grid to ``WIDE_STEP_PROGRAMS_PER_SM`` programs per multiprocessor (counted at
    the top of ``m``'s row range, so that every count of the range gets this configuration).

    How it was chosen: CUDA-graph replays on an H100 (``benchmarks/bench_ops.py --wide-step-sweep``,
    benchmarks/results/) of this tile at split 1..8 against ``narrow_step_config`` on the TP=1 and
    TP=2 Llama-3-8B shapes and 8192^2: at up to 16 rows faster on every weight of 2**24 elements
    or more (up to 1.3x on the largest), a tie on smaller ones; at 32 rows faster on every shape;
    at 64 rows slower on the large weights. At 33-64 rows in two 32-row tiles (CUDA-graph replays on
    an H200 against the 64 x 128 narrow tile, benchmarks/results/2026-11-26-split-k-tail-e2e-2xh200.md):
    faster on every measured launch whose weights hold fewer than ``WIDE_STEP_MAX_WEIGHT_TWO_TILES``
    elements (Llama-3-8B's TP=2 shards, alone and as the grouped q/k/v launch), slower on every
    larger one; as the products of the grouped gate/up launch (2 x 7168 x 4096) faster than the
    narrow tile too (H100, benchmarks/results/2026-11-27-small-shards-mid-rows-h100.md). At 65-128
    rows in four (the same H100 runs, against the pre-decoded 128 x 64 tile and four other tiles):
    1.02-1.61x faster on the q, k/v and o shards alone and 1.14-1.27x as the grouped q/k/v launch,
    slower on the 3072 x 4096 q/k/v shard and larger weights."""
    block_m = 16 if m <= 16 else 32
    tiles = triton.cdiv(_range_top(m), block_m) * triton.cdiv(n, 64)
    split = filling_split(tiles, k, num_sms, WIDE_STEP_PROGRAMS_PER_SM, block_k=256)
    return DecodeConfig(block_m=block_m, block_n=64, block_k=256, split_k=split, num_warps=4, num_stages=3,
                        max_registers=WIDE_STEP_MAX_REGISTERS, scale_words=block_m == 16)


def narrow_step_config(m: int, n: int, k: int, num_sms: int = 132) -> DecodeConfig:
    """Up to ``INKERNEL_DECODE_MAX_M`` rows, 128 K elements a step.

    How it was chosen (no GPU was available when it was written): every candidate tile was
    compiled for sm_90 with Triton 3.6 and ranked by SASS instructions in the K loop per weight
    element (the kernel is bound by decode instructions as much as by HBM) and by programs per
    multiprocessor (registers). Picked, by activation rows: M <= 16 -> 16 x 128 weight rows,
    4 warps, capped at 128 registers (3.3 instructions per weight element, 4 programs per
    multiprocessor); M <= 32 -> 32 rows, same (3.5, 4); M <= 64 -> 64 rows (4.0, 3). All use 128 K
    elements a step (64: 20% more instructions per element) and 3 stages (two steps of loads in
    flight, about 18 KiB per 128-row program).

    Split-K fills one wave: ``split = min(programs that fit / tiles, K steps / MIN_STEPS_PER_SPLIT,
    MAX_SPLIT)``, and when 128-row weight tiles would leave more than 40% of those slots empty
    (small N at M <= 16), 64-row tiles (8 programs per multiprocessor) are used instead."""
    if m <= 16:
        block_m, warps = 16, 4
    elif m <= 32:
        block_m, warps = 32, 4
    else:
        block_m, warps = 64, 4
    steps = triton.cdiv(k // 2, 64)
    max_split = max(1, min(MAX_SPLIT, steps // MIN_STEPS_PER_SPLIT))

    def filled(block_n: int) -> tuple[int, bool]:
        slots = num_sms * _TILES[block_m, block_n, warps][1]
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        split = max(1, min(max_split, slots // tiles))
        return split, tiles * split * 10 >= slots * 6

    block_n = 128
    split, full = filled(block_n)
    if not full and (block_m, 64, warps) in _TILES:
        block_n = 64
        split, _ = filled(block_n)
    return DecodeConfig(block_m=block_m, block_n=block_n, block_k=128, split_k=split, num_warps=warps,
                        num_stages=3, max_registers=_TILES[block_m, block_n, warps][0])


def mm_fp4_decode(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: Alpha, out_dtype: torch.dtype, config: DecodeConfig | None = None,
    workspace: DecodeWorkspace | None = None,
) -> torch.Tensor:
    """``alpha * (q_a * s_a) @ (q_b * s_b)^T`` as ``[M, N]`` ``out_dtype`` in one launch (module
    docstring). ``config``: override of ``decode_config_for`` (sweeps); ``workspace``: split-K
    scratch to use instead of a fresh one (it must hold ``decode_workspace_numel``)."""
    m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return empty_sum_(out, alpha)
    cfg = config or decode_config_for(config_rows(m), n, k, num_sms(a.device))
    _check_config(cfg, "mm_fp4_decode")
    plan = _plan(cfg, m, n, k)
    partials, counters = out, out
    if plan.split > 1:
        need_p, need_c = decode_workspace_numel(m, n, k, cfg)
        if workspace is None:
            workspace = empty_decode_workspace(need_p, need_c, a.device)
        elif not _fits(workspace, need_p, need_c):
            raise ValueError(f"mm_fp4_decode: workspace holds {workspace.partials.numel()} partials / "
                             f"{workspace.counters.numel()} counters; this call needs {need_p} / {need_c}")
        partials, counters = workspace
    x, x_aux, x_stride, scale_words = _activation_operands(a, a_scale, cfg)
    traceable(_mm_decode_kernel)[(plan.tiles, plan.split)](
        x, x_aux, b, b_scale, *alpha_operands(alpha), out, partials, counters,
        m, n, k // 2, k // BLOCK_SIZE, x_stride, plan.iters_per_split, plan.split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PARTIAL=plan.split > 1, EVEN_K=plan.even_k, FAST_DECODE=a.device.type == "cuda",
        PREDECODED=cfg.predecode, A_SCALE_WORDS=scale_words, **alpha_meta(alpha),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_register_cap(cfg, a.device),
    )
    return out


def _check_config(cfg: DecodeConfig, caller: str) -> None:
    if cfg.block_k % 64 or cfg.block_m < 16 or cfg.block_n < 16:
        raise ValueError(f"{caller}: block_k must be a multiple of 64 and block_m, block_n at least 16; got {cfg}")


def _activation_operands(a: torch.Tensor, a_scale: torch.Tensor, cfg: DecodeConfig
                         ) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """``(x, x_aux, row stride of pre-decoded planes or 0, A_SCALE_WORDS)``: the activation as the
    decode kernels read it (pre-decoded once where ``cfg.predecode``)."""
    k = a.shape[1] * 2
    # traced (kernel lowering): fake tensors have no address, so the byte loads (the same bits)
    scale_words = (cfg.scale_words and not cfg.predecode and (k // BLOCK_SIZE) % 4 == 0 and not tracing()
                   and a_scale.data_ptr() % 4 == 0)
    if cfg.predecode:
        lo, hi = predecode_activation(a, a_scale, cfg.block_k)
        return lo, hi, lo.shape[1], scale_words
    return a, a_scale, 0, scale_words


class DecodeWeight(NamedTuple):
    """One product of ``mm_fp4_decode_group``: weight codes ``b [N, K/2]``, block scales
    ``b_scale [N, K/16]`` and ``alpha``, as ``mm_fp4_decode`` takes them."""

    b: torch.Tensor
    b_scale: torch.Tensor
    alpha: Alpha


class DecodeProduct(NamedTuple):
    """One product of ``mm_fp4_decode_products``: ``mm_fp4_decode``'s operands (activation
    ``a [M, K/2]`` and ``a_scale``, weight ``b`` and ``b_scale``, ``alpha``)."""

    a: torch.Tensor
    a_scale: torch.Tensor
    b: torch.Tensor
    b_scale: torch.Tensor
    alpha: Alpha


#: Products one ``_mm_decode_group_kernel`` launch computes at most.
MAX_GROUP = 3


def _agree_but_for_split(cfgs: list[DecodeConfig]) -> bool:
    return len({dataclasses.replace(cfg, split_k=1) for cfg in cfgs}) == 1


def group_configs(m: int | torch.SymInt, ns: list[int], k: int, num_sms: int) -> list[DecodeConfig] | None:
    """Each product's own ``decode_config_for`` where all but their split counts agree (one launch can
    then run them all, each with its own split: each output bitwise its own launch's), else None."""
    cfgs = [decode_config_for(config_rows(m), n, k, num_sms) for n in ns]
    return cfgs if _agree_but_for_split(cfgs) else None


def mm_fp4_decode_group(a: torch.Tensor, a_scale: torch.Tensor, weights: list[DecodeWeight],
                        out_dtype: torch.dtype, configs: list[DecodeConfig] | None = None) -> list[torch.Tensor]:
    """``mm_fp4_decode_products`` of one activation with each of ``weights``: the q/k/v (gate/up)
    projections of a decoder layer whose quantization was shared."""
    return mm_fp4_decode_products([DecodeProduct(a, a_scale, *w) for w in weights], out_dtype, configs)


def mm_fp4_decode_products(products: list[DecodeProduct], out_dtype: torch.dtype,
                           configs: list[DecodeConfig] | None = None) -> list[torch.Tensor]:
    """``[mm_fp4_decode(*p, out_dtype) for p in products]``, bit for bit, in fewer launches: up to
    ``MAX_GROUP`` products at a time with alphas of one kind (in order within each kind) and
    activations of one shape whose configurations agree but for the split count
    (``group_configs``) share one launch of
    ``_mm_decode_group_kernel`` (each keeps its configuration, split and K ranges, so its sums are
    the same) and one split-K workspace (one memset); each distinct activation is pre-decoded once
    where the configuration pre-decodes. Products that cannot share a launch get one each. A decoder
    layer's q/k/v (gate/up) projections read one activation, quantized once (dynamic scales) or once
    per projection (a checkpoint's static scales): at decode sizes their GEMMs are latency-bound, and
    one grid over all of them fills the GPU where the small ones alone cannot (benchmarks/results/).
    ``configs``: one configuration per product instead of ``decode_config_for`` (tests, sweeps);
    they must agree but for ``split_k``."""
    if configs is not None and (len(configs) != len(products) or not _agree_but_for_split(configs)):
        raise ValueError(f"mm_fp4_decode_products: configs must be one per product and agree but for split_k; "
                         f"got {configs}")
    for cfg in configs or ():
        _check_config(cfg, "mm_fp4_decode_products")
    by_alpha_kind: dict[tuple, list[int]] = {}
    for i, p in enumerate(products):
        by_alpha_kind.setdefault(tuple(alpha_meta(p.alpha).items()), []).append(i)
    outs: list[torch.Tensor | None] = [None] * len(products)
    for indices in by_alpha_kind.values():
        for start in range(0, len(indices), MAX_GROUP):
            chunk = indices[start:start + MAX_GROUP]
            got = _decode_group([products[i] for i in chunk], out_dtype, configs and [configs[i] for i in chunk])
            for i, out in zip(chunk, got):
                outs[i] = out
    return outs


def _decode_group(products: list[DecodeProduct], out_dtype: torch.dtype,
                  cfgs: list[DecodeConfig] | None) -> list[torch.Tensor]:
    a = products[0].a
    m, k = a.shape[0], a.shape[1] * 2
    ns = [p.b.shape[0] for p in products]
    same_shape = all(p.a.shape == a.shape and p.a_scale.shape == products[0].a_scale.shape for p in products)
    shared = len(products) > 1 and same_shape and m > 0 and k > 0 and min(ns) > 0
    if shared and cfgs is None:
        cfgs = group_configs(m, ns, k, num_sms(a.device))
    if not shared or cfgs is None:
        cfgs = cfgs or [None] * len(products)
        return [mm_fp4_decode(p.a, p.b, p.a_scale, p.b_scale, p.alpha, out_dtype, cfg)
                for p, cfg in zip(products, cfgs)]
    cfg = cfgs[0]
    plans = [_plan(c, m, n, k) for c, n in zip(cfgs, ns)]
    programs = sum(p.tiles * p.split for p in plans)
    workspace = empty_decode_workspace(programs * cfg.block_n * cfg.block_m, sum(p.tiles for p in plans), a.device)
    outs = [torch.empty((m, n), dtype=out_dtype, device=a.device) for n in ns]
    activations = _distinct_activations(products, cfg)
    segments = [(*activations[_activation_key(p)][:2], p.b, p.b_scale, *alpha_operands(p.alpha), out, n,
                 plan.iters_per_split, plan.split)
                for p, out, n, plan in zip(products, outs, ns, plans)]
    segments += [segments[-1]] * (MAX_GROUP - len(segments))  # unused slots (SEGMENTS prunes them)
    x_stride = next(iter(activations.values()))[2]
    scale_words = all(act[3] for act in activations.values())
    traceable(_mm_decode_group_kernel)[(programs,)](
        workspace.partials, workspace.counters, m, k // 2, k // BLOCK_SIZE, x_stride,
        *(arg for segment in segments for arg in segment),
        SEGMENTS=len(products), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=plans[0].even_k, FAST_DECODE=a.device.type == "cuda", PREDECODED=cfg.predecode,
        A_SCALE_WORDS=scale_words, **alpha_meta(products[0].alpha),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_register_cap(cfg, a.device),
    )
    return outs


def _activation_key(product: DecodeProduct) -> tuple[int, int]:
    return id(product.a), id(product.a_scale)


def _distinct_activations(products: list[DecodeProduct], cfg: DecodeConfig
                          ) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int, bool]]:
    """``_activation_operands`` of each distinct activation of ``products`` (by tensor identity):
    a shared activation is pre-decoded once, and distinct ones in one launch."""
    distinct = {_activation_key(p): (p.a, p.a_scale) for p in products}
    if not cfg.predecode:
        return {key: _activation_operands(a, a_scale, cfg) for key, (a, a_scale) in distinct.items()}
    planes = predecode_activations(list(distinct.values()), cfg.block_k)
    return {key: (lo, hi, lo.shape[1], False) for key, (lo, hi) in zip(distinct, planes)}


def leaves_counters_zero(kernel: object) -> bool:
    """Whether ``kernel`` (a Triton kernel, possibly wrapped: Autotuner, heuristics) is one of this
    module's split-K GEMMs, which need their ``count_ptr`` counters zero at launch and leave them zero
    (module docstring), so that launches in stream order may share one counters buffer."""
    while not isinstance(kernel, triton.runtime.JITFunction) and hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel is _mm_decode_kernel or kernel is _mm_decode_group_kernel


#: Activation rows per program of ``_predecode_kernel``.
PREDECODE_ROWS = 32


def predecode_activation(a: torch.Tensor, a_scale: torch.Tensor, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 ``[M, K/2]`` -> fp16 ``(lo, hi)`` ``[M, KBP]`` in ``_mm_decode_kernel``'s operand order
    for steps of ``block_k`` elements (``_decoded_tile``; ``KBP`` = K/2 rounded up to a whole step,
    zero-padded), values ``e2m1 * 2**-14 * s`` (exact)."""
    return predecode_activations([(a, a_scale)], block_k)[0]


def predecode_activations(activations: list[tuple[torch.Tensor, torch.Tensor]], block_k: int
                          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[predecode_activation(a, a_scale, block_k) for a, a_scale in activations]`` (activations of
    one shape), bit for bit, up to ``MAX_GROUP`` of them per launch."""
    m, kb = activations[0][0].shape
    bkb = block_k // 2
    steps = triton.cdiv(kb, bkb)
    device = activations[0][0].device
    planes = [(torch.empty((m, steps * bkb), dtype=torch.float16, device=device),
               torch.empty((m, steps * bkb), dtype=torch.float16, device=device)) for _ in activations]
    if not (m and steps):
        return planes
    for start in range(0, len(activations), MAX_GROUP):
        segments = [(a, a_scale, lo, hi) for (a, a_scale), (lo, hi) in
                    zip(activations[start:start + MAX_GROUP], planes[start:start + MAX_GROUP])]
        count = len(segments)
        segments += [segments[-1]] * (MAX_GROUP - count)  # unused slots (SEGMENTS prunes them)
        traceable(_predecode_kernel)[(triton.cdiv(m, PREDECODE_ROWS), steps, count)](
            *(arg for segment in segments for arg in segment), m, kb, kb // 8, steps * bkb,
            SEGMENTS=count, ROWS=PREDECODE_ROWS, BLOCK_K=block_k, EVEN_K=kb % bkb == 0,
            FAST_DECODE=device.type == "cuda", num_warps=4)
    return planes


def _register_cap(cfg: DecodeConfig, device: torch.device) -> dict:
    """``maxnreg`` launch option when the config sets one (CUDA only: the interpreter has none)."""
    if cfg.max_registers is None or device.type != "cuda":
        return {}
    return {"maxnreg": cfg.max_registers}
