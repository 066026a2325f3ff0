"""Warp-specialized W4A4 NVFP4 GEMM for Hopper (sm_90), in Gluon: the middle range of M.

Contract: ``mm_fp4_hopper(a, b, a_scale, b_scale, alpha, out_dtype, out=None) -> out [M, N]``, the
same as ``mm_fp4`` (``fp4fuse.kernels.triton.mm``) for the calls :func:`hopper_serves` and
:func:`hopper_operands_ok` accept: a uint8 ``[M, K/2]``, b uint8 ``[N, K/2]`` (weight, row-major,
16-byte aligned), linear e4m3 scales ``[M, K/16]`` / ``[N, K/16]`` (``b_scale`` 4-byte aligned),
``K % 64 == 0``, alpha a one-element fp32 tensor or ``GlobalScales`` (``fp4fuse.kernels.triton.alpha``),
``out = alpha * (q_a * s_a) @ (q_b * s_b)^T`` in bf16/fp16/fp32, written into ``out`` when given (a
``[M, N]`` tensor with row stride N: a row range of a larger output).

Numerics: those of ``_mm_fp4_kernel`` (fp4fuse/kernels/triton/mm.py): both operands decoded exactly to
fp16 ``e2m1 * 2**-14 * s`` (``fp4fuse.kernels.triton.decode``), products exact in fp32, fp32
accumulation in the tensor cores, the epilogue times ``2**28`` (exact) and alpha, one rounding.
Each output element is summed over the same K steps in the same order whatever M, N or its tile,
so a row block of a GEMM computed alone is bitwise that block of the whole GEMM. A NaN block scale
makes the outputs that read it NaN.

Design (``_mm_hopper_kernel``):

* Swapped product: a program computes ``acc[BLOCK_N, BLOCK_M] = W_tile @ X_tile^T``. The weight
  rows are the wgmma M side, so the decoded weight is wgmma's register operand (A) and is never
  stored decoded; the activation, decoded once per call into fp16 halves ``[M, K/2]`` (even / odd
  elements, ``decode_fp4_halves``), is the shared-memory operand (B). A K step of 64 elements
  (32 code bytes) runs two wgmma chains: even weight elements with the even half, odd with odd.
* Warp specialization (``gl.warp_specialize``): one loader warp issues TMA loads of the step's
  two activation halves ``[BLOCK_M, 32]`` and weight code bytes ``[BLOCK_N, 32]`` into a
  ``STAGES``-deep ring (mbarriers ``ready`` / ``empty``); two consumer warpgroups (8 warps) each
  own 64 weight rows. A consumer loads its code bytes from shared memory, decodes them with the
  GEMMs' PTX decoder and multiplies by the block scales (loaded from global memory as int32 words
  of four: one word per row and step).
* Fragment order (``FRAGMENT_ORDER``, shipped): a wgmma A fragment's lane column t holds K slots
  2t, 2t+1, 2t+8, 2t+9 of each k16, so code bytes loaded in K order come as 2-byte loads packed
  with byte permutes, and each pair needs its own scale shift. Instead each thread loads 8 Q
  contiguous code bytes of each of its two rows (Q = step_k / 64; one 16-element block, one
  scale, per 8 bytes: :func:`codes_layout`) and puts byte ``8 Q t + 4 i + 2 j + b`` in slot ``16 i +
  8 j + 2 t + b`` (``_in_fragment_order``: registers only). The activation halves are decoded in
  the same K order (``decode_activation``), so every product is the same; which products share a
  k16 wgmma, and so the fp32 sums' last bits, differ from the K-order form (``fragment_order=False``,
  kept for sweeps). About a third fewer instructions per K step (offline SASS; benchmarks/results/).
* Weight scales a step ahead (``SCALE_AHEAD``, shipped): a consumer loads the next step's scale
  words during the step before, out of the step's chain (``bench_hopper_scale_ahead.py``; results
  in benchmarks/results/). It moves loads only: the sums are unchanged.
* Sweep parameters (``mm_fp4_hopper``; the shipped launches use the defaults): ``step_k=128``
  steps of 128 elements (64 code bytes, one int64 word of eight scales a row), half the per-step
  chains (barrier waits, scale load, decode, wgmma wait) for twice the fragment registers
  (``bench_hopper_wide_step.py``; benchmarks/results/), and ``scale_ahead=0``, the scales loaded
  in their own step.
* Queued wgmmas: a step is decoded and its wgmmas issued while the previous step's still run; then
  the consumer waits for the previous step's and frees its stage. A wgmma reads its register
  operand asynchronously, so nothing may write those registers before a wait covers it: the loop
  body holds two steps (``_queued_step`` twice), so consecutive steps' fragments live in different
  registers and each set is rewritten only after the wait on the wgmmas that read it (checked in
  the PTX: every fragment register is written once per loop iteration, after that wait). Step 0
  runs before the loop with ``use_acc=False`` so that no instruction but a wgmma writes the
  accumulator while wgmmas are in flight (ptxas serializes them otherwise, warning C7515).
* Tile 128 weight rows x 256 tokens (16 to 128 for sweeps), one program per tile and K range;
  programs sharing a weight tile are adjacent in launch order (``GROUP_M`` token tiles at a time)
  so the tile is read from HBM once. 168 registers per thread for 12 warps (the loader's
  warpgroup gives its registers to the consumers: ``setmaxnreg`` 24 / 240).
* Split-K (up to ``DECODE_MAX_M`` rows, where the 256-token tiles number only N / 128): program
  ``(tile, split)`` covers K steps ``[split * iters, +iters)`` and stores its unscaled fp32 sums
  into a per-call ``[splits, M, N]`` workspace, straight from the accumulator's layout; a second
  launch (``reduce.sum_split_partials``, over every multiprocessor) adds them in split order and
  applies the epilogue. The split count is part of the numerics: row blocks match the whole
  product with its split count (``split_for`` of the whole M). The reduction used to run inside
  the launch (the last of a tile's programs to arrive summed the tile alone), which cost more
  than the programs' own K steps at small shapes (``profile_hopper_split.py``; benchmarks/results/).

Measured against the other paths and cuBLAS bf16 in benchmarks/results/ (``bench_ops.py
--hopper-sweep`` and ``--hopper-split-sweep``); :data:`HOPPER_BF16_MAX_M`, :data:`SPLIT_MIN_M` and
:data:`SPLIT_MIN_WEIGHT` come from there. Gluon is Triton's experimental
low-level language and its API changes between releases: this module is written for, and only
used with, Triton 3.6 (``hopper_available``); other versions take the other paths.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fp4fuse.config import env_bool
from fp4fuse.kernels.triton.alpha import Alpha, alpha_meta, alpha_operands, empty_sum_, load_alpha
from fp4fuse.kernels.triton.decode import (
    DECODE_PTX, DECODE_SCALE_UNDO, decode_fp4_halves, grouped_tile, num_sms, split_ranges,
)
from fp4fuse.kernels.triton.launch import FastKernel, Relaunch, launch_hooks_set, traceable, tracing, triton_version
from fp4fuse.kernels.triton.mm_decode import DECODE_MAX_M
from fp4fuse.kernels.triton.reduce import sum_split_partials

__all__ = ["DEFAULT_LAUNCH", "ENV_DISABLE_GLUON", "HOPPER_BF16_MAX_M", "HopperLaunch", "SPLIT_MIN_M", "SPLIT_MIN_WEIGHT",
           "codes_layout", "decode_activation", "fills_the_gpu", "finish_tile",
           "gluon_disabled",
           "hopper_available", "hopper_device", "hopper_operands_ok", "hopper_serves", "hopper_split", "mm_fp4_hopper",
           "mm_fp4_hopper_halves", "mm_fp4_hopper_products", "serves_shape", "split_for"]

logger = logging.getLogger(__name__)

ENV_DISABLE_GLUON = "FP4FUSE_DISABLE_GLUON"
#: The Triton release whose Gluon API this module is written to.
GLUON_TRITON = (3, 6)
#: bf16 outputs use this kernel from DECODE_MAX_M + 1 rows up to here where the product fills the
#: GPU (``fills_the_gpu``); otherwise dequantize + cuBLAS (faster at 4096 rows on every measured
#: shape). fp16 / fp32 outputs use it for every M above DECODE_MAX_M (their other path, the tiled
#: kernel, is 2-3x slower).
HOPPER_BF16_MAX_M = 2048
#: Up to DECODE_MAX_M rows the kernel takes products above SPLIT_MIN_M rows whose weight holds at
#: least SPLIT_MIN_WEIGHT elements (3072 x 4096, Llama-3-8B's and Qwen3-8B's TP=2 q/k/v shard),
#: with split-K (``split_for``); the decode GEMM keeps the rest, where it was faster
#: (benchmarks/results/, ``bench_ops.py --hopper-split-sweep``).
SPLIT_MIN_M = 128
SPLIT_MIN_WEIGHT = 3 << 22
#: ``fills_the_gpu``'s least fill of the launched tiles, in tenths.
MIN_FILL_TENTHS = 8
#: K elements per step (code bytes: half), and the alignment of K it needs (whole scale words).
STEP_K = 64
STEP_BYTES = STEP_K // 2
#: K steps ``mm_fp4_hopper(step_k=...)`` takes (sweeps), and the integer word holding one weight
#: row's block scales of a step (four e4m3 scales in an int32, eight in an int64), which the
#: consumers load per row and step.
STEP_K_CHOICES = (64, 128)
_SCALE_WORD = {64: torch.int32, 128: torch.int64}
BLOCK_M = 256
BLOCK_N = 128
STAGES = 4
#: K steps ahead of its use that a consumer loads a step's weight scales (0 or 1; ``mm_fp4_hopper``'s
#: ``scale_ahead``; module docstring).
SCALE_AHEAD = 1
#: Whether a consumer loads each weight row's code bytes of a step as contiguous words and holds
#: the K step in the fragment order of ``decode.decode_fp4_halves(fragment_group=...)`` (the
#: activation decoded in that order), rather than in K order from 2-byte loads
#: (``mm_fp4_hopper``'s ``fragment_order``; module docstring).
FRAGMENT_ORDER = True
#: Shared memory a program may hold (sm_90: 227 KiB), and what the ring leaves of it for the
#: epilogue's layout conversion and the mbarriers (``max_stages``).
SMEM_BYTES = 227 * 1024
EPILOGUE_SMEM_BYTES = 64 * 1024
GROUP_M = 8
#: Tokens per program ``mm_fp4_hopper`` takes (the wgmma N side).
BLOCK_M_CHOICES = (16, 32, 64, 128, 256)
#: Split-K bounds of :func:`hopper_split`.
MAX_SPLIT = 16
MIN_STEPS_PER_SPLIT = 8
#: The two consumer warpgroups (the default partition).
NUM_WARPS = 8
#: Registers per thread over the 12 warps (8 consumers, the loader rounded up to a warpgroup), and
#: what ``setmaxnreg`` leaves the loader (the consumers get the rest: 240).
MAX_REGISTERS = 168
LOADER_REGISTERS = gl.constexpr(24)


@dataclasses.dataclass(frozen=True)
class HopperLaunch:
    """How :func:`mm_fp4_hopper` launches ``_mm_hopper_kernel`` (its keyword arguments, which document
    each field): ``block_m`` tokens a program; ``split_k`` K ranges a tile (None: :func:`split_for`
    of the call's M); ptxas's ``max_registers`` a thread; ``stages`` of the TMA ring;
    ``scale_ahead`` K steps the weight scales load early; ``step_k`` K elements a step;
    ``fragment_order`` the K order of a step's fragments (and of the decoded activation). The
    defaults are the shipped launch (:data:`DEFAULT_LAUNCH`), the only one a traced call makes."""

    block_m: int = BLOCK_M
    split_k: int | None = None
    max_registers: int = MAX_REGISTERS
    stages: int = STAGES
    scale_ahead: int = SCALE_AHEAD
    step_k: int = STEP_K
    fragment_order: bool = FRAGMENT_ORDER


DEFAULT_LAUNCH = HopperLaunch()


def stage_bytes(block_m: int, step_k: int = STEP_K) -> int:
    """Shared memory of one ring stage: the activation halves ``2 x [block_m, step_k / 2]`` fp16 and
    the weight codes ``[BLOCK_N, step_k / 2]``."""
    return (2 * block_m * 2 + BLOCK_N) * (step_k // 2)


def max_stages(block_m: int, step_k: int = STEP_K) -> int:
    """The deepest ring of ``block_m``-token tiles and ``step_k``-element steps that fits
    ``SMEM_BYTES`` beside the epilogue."""
    return (SMEM_BYTES - EPILOGUE_SMEM_BYTES) // stage_bytes(block_m, step_k)


def gluon_disabled() -> bool:
    """``FP4FUSE_DISABLE_GLUON=1``: never use this kernel (its products take the other paths)."""
    return env_bool(ENV_DISABLE_GLUON, False)


def hopper_available(device_index: int) -> bool:
    """Whether CUDA device ``device_index`` runs this kernel: ``FP4FUSE_DISABLE_GLUON`` unset (read
    on every call, as ``FusionPass.uuid`` reads it) and :func:`hopper_device`."""
    return not gluon_disabled() and hopper_device(device_index)


@functools.cache
def hopper_device(device_index: int) -> bool:
    """Compute capability 9.0 (wgmma, TMA) and Triton 3.6 (cached per device: read once)."""
    if triton_version() != GLUON_TRITON:
        logger.debug("fp4fuse: Hopper Gluon GEMM off: Triton %s is not %s", triton.__version__, GLUON_TRITON)
        return False
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def hopper_serves(m: int | torch.SymInt, n: int, k: int, out_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``mm_fp4_triton`` sends an ``[M, K] x [N, K]^T`` product to this kernel (shapes and
    device only; the operands' alignment is :func:`hopper_operands_ok`'s)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return hopper_available(index) and serves_shape(m, n, k, out_dtype, num_sms(device))


def serves_shape(m: int | torch.SymInt, n: int, k: int, out_dtype: torch.dtype, sms: int) -> bool:
    """The shape rule of :func:`hopper_serves` on a GPU of ``sms`` multiprocessors: K a nonzero
    multiple of ``STEP_K``, N > 0, and either M in ``(SPLIT_MIN_M, DECODE_MAX_M]`` with a weight of
    at least ``SPLIT_MIN_WEIGHT`` elements (split-K launches, any output dtype), or M above
    ``DECODE_MAX_M``; there, for a bf16 output, also M at most ``HOPPER_BF16_MAX_M`` and a product
    that fills the launched tiles (:func:`fills_the_gpu`), where dequantize + cuBLAS is otherwise
    faster. A symbolic ``m`` is compared like a number: each comparison is guarded by the tracer
    (the bounds are those of ``mm_decode.DECODE_ROW_RANGES``, so a traced range is served whole or
    not at all)."""
    if k == 0 or k % STEP_K or n == 0:
        return False
    if m <= DECODE_MAX_M:
        return m > SPLIT_MIN_M and n * k >= SPLIT_MIN_WEIGHT
    return out_dtype != torch.bfloat16 or (m <= HOPPER_BF16_MAX_M and fills_the_gpu(m, n, sms))


def split_for(m: int, n: int, k: int, sms: int) -> int:
    """The split-K count :func:`mm_fp4_hopper` uses for an ``[m, K] x [n, K]^T`` product by default:
    :func:`hopper_split` up to ``DECODE_MAX_M`` rows (whose 256-token tiles number only N / 128),
    none above. ``RowBlockGemm`` passes the whole GEMM's to each row block."""
    return hopper_split(m, n, k, sms, BLOCK_M) if m <= DECODE_MAX_M else 1


def fills_the_gpu(m: int | torch.SymInt, n: int, sms: int) -> bool:
    """Whether the ``[m, n]`` output fills at least ``MIN_FILL_TENTHS / 10`` of what its launch can compute:
    waves of ``sms`` programs of ``BLOCK_M x BLOCK_N`` outputs. A partial last wave and padded
    token rows leave multiprocessors idle, and one program's tile takes the same time whatever it
    holds (benchmarks/results/: below 0.8 the kernel lost to dequantize + cuBLAS on every measured
    shape but one, above it won or tied; 2026-11-27-gluon-fill-rule.md says why a lower threshold,
    which wins on partial single waves measured alone, was not taken)."""
    tiles = -(-m // BLOCK_M) * -(-n // BLOCK_N)
    waves = -(-tiles // sms)
    return MIN_FILL_TENTHS * waves * sms * BLOCK_M * BLOCK_N <= 10 * m * n


def hopper_operands_ok(b: torch.Tensor, b_scale: torch.Tensor, step_k: int = STEP_K) -> bool:
    """The weight's alignment the kernel needs: TMA reads the codes (16-byte base), the scales
    are read as one word a step (4-byte base for 64-element steps, 8-byte for 128). Not checkable
    while tracing (fake tensors)."""
    return b.data_ptr() % 16 == 0 and b_scale.data_ptr() % _SCALE_WORD[step_k].itemsize == 0


@gluon.jit
def _load_partition(xlo_desc, xhi_desc, w_desc, xlo_bufs, xhi_bufs, w_bufs, ready, empty, off_m, off_n, k_begin,
                    k_count):
    """Loader warp: TMA loads of the activation halves and weight codes of K steps
    ``[k_begin, k_begin + k_count)`` into the ring."""
    num_stages: gl.constexpr = w_bufs.type.shape[0]
    step_bytes: gl.constexpr = w_desc.block_type.shape[1]
    nbytes: gl.constexpr = 2 * xlo_desc.block_type.nbytes + w_desc.block_type.nbytes
    for i in range(k_count):
        stage = i % num_stages
        mbarrier.wait(empty.index(stage), ((i // num_stages) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, nbytes)
        col = (k_begin + i) * step_bytes
        tma.async_copy_global_to_shared(xlo_desc, [off_m, col], bar, xlo_bufs.index(stage))
        tma.async_copy_global_to_shared(xhi_desc, [off_m, col], bar, xhi_bufs.index(stage))
        tma.async_copy_global_to_shared(w_desc, [off_n, col], bar, w_bufs.index(stage))


@gluon.jit
def _in_fragment_order(x, a_layout: gl.constexpr):
    """``[BLOCK_N, 32 Q]`` values in :func:`codes_layout` (column = code byte of the step) -> wgmma A
    fragments (``a_layout``) whose column ``16 i + 8 j + 2 t + b`` is code byte ``8 Q t + 4 i + 2 j
    + b``: each thread keeps its own values (the order ``decode_fp4_halves`` gives the activation
    with ``fragment_group``)."""
    rows: gl.constexpr = x.shape[0]
    cols: gl.constexpr = x.shape[1]
    x = gl.reshape(x, [rows, 4, cols // 16, 2, 2])
    x = gl.permute(x, [0, 2, 3, 1, 4])
    return gl.convert_layout(gl.reshape(x, [rows, cols]), a_layout)


@gluon.jit
def _decoded_weight(w_buf, words, shift, a_layout: gl.constexpr, codes_layout: gl.constexpr,
                    FRAGMENT_ORDER: gl.constexpr):
    """A stage's weight codes -> (even, odd) elements as fp16 wgmma A fragments, times their scales.
    FRAGMENT_ORDER: the codes are loaded in ``codes_layout`` (contiguous bytes a thread, one scale
    per row and 16-element block) and the fragments' K order is ``_in_fragment_order``'s; else
    loaded in the fragments' own layout (2-byte loads), in K order."""
    if FRAGMENT_ORDER:
        codes = w_buf.load(codes_layout)
    else:
        codes = w_buf.load(a_layout)
    lo, hi = gl.inline_asm_elementwise(DECODE_PTX, "=r,=r,=r,=r,r", [codes],
                                       dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
    scale_bits = ((words[:, None] >> shift[None, :]) & 0xFF).to(gl.uint8)
    scales = scale_bits.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    lo = lo * scales
    hi = hi * scales
    if FRAGMENT_ORDER:
        lo = _in_fragment_order(lo, a_layout)
        hi = _in_fragment_order(hi, a_layout)
    return lo, hi


@gluon.jit
def _step_words(word_ptrs, i, k_count, SCALE_AHEAD: gl.constexpr):
    """The scale words ``_queued_step`` decodes step ``i`` with when it is called for step ``i -
    SCALE_AHEAD`` (clamped to the program's last step, so no load reads past its range)."""
    return gl.load(word_ptrs + gl.minimum(i + SCALE_AHEAD, k_count - 1))


@gluon.jit
def _queued_step(acc, i, lo_prev, hi_prev, words, xlo_bufs, xhi_bufs, w_bufs, ready, empty, word_ptrs, shift, k_count,
                 a_layout: gl.constexpr, codes_layout: gl.constexpr, SCALE_AHEAD: gl.constexpr,
                 FRAGMENT_ORDER: gl.constexpr):
    """K step ``i`` (of the program's range): decode its weight fragments (while step i - 1's
    wgmmas run), issue its wgmmas, then wait for step i - 1's (whose fragments ``lo_prev, hi_prev``
    stay live until then) and free that step's stage. Returns the accumulator, step i's fragments
    and the scale words of step ``i + 1``. SCALE_AHEAD: ``words`` are step i's, loaded a step
    earlier, and step i + 1's load is issued before step i's wait for its codes; 0: ``words`` are
    ignored and step i's are loaded here (the load's latency in the step)."""
    num_stages: gl.constexpr = w_bufs.type.shape[0]
    stage = i % num_stages
    if SCALE_AHEAD:
        next_words = _step_words(word_ptrs, i, k_count, SCALE_AHEAD)
    else:
        words = gl.load(word_ptrs + i)
        next_words = words
    mbarrier.wait(ready.index(stage), (i // num_stages) & 1)
    lo, hi = _decoded_weight(w_bufs.index(stage), words, shift, a_layout, codes_layout, FRAGMENT_ORDER)
    acc = warpgroup_mma(lo, xlo_bufs.index(stage).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(hi, xhi_bufs.index(stage).permute((1, 0)), acc, is_async=True)
    lo_prev, hi_prev = warpgroup_mma_wait(num_outstanding=2, deps=(lo_prev, hi_prev))
    mbarrier.arrive(empty.index((i - 1) % num_stages))
    return acc, lo, hi, next_words


@gluon.jit
def _mma_partition(xlo_bufs, xhi_bufs, w_bufs, ready, empty, ws_ptr, words_per_row, off_n, N, k_begin, k_count,
                   BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SCALE_AHEAD: gl.constexpr,
                   FRAGMENT_ORDER: gl.constexpr, codes_layout: gl.constexpr, num_warps: gl.constexpr):
    """Consumer warpgroups: decode each step's weight rows into wgmma fragments and accumulate
    ``acc[BLOCK_N, BLOCK_M]`` over K steps ``[k_begin, k_begin + k_count)`` (a step decoded and its
    wgmmas queued while the previous step's run)."""
    step_bytes: gl.constexpr = w_bufs.type.shape[2]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    if FRAGMENT_ORDER:
        rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, codes_layout))
        shift = gl.arange(0, step_bytes, layout=gl.SliceLayout(0, codes_layout))
    else:
        rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))
        shift = gl.arange(0, step_bytes, layout=gl.SliceLayout(0, a_layout))
    rows = gl.where(rows < N, rows, 0)  # rows past N (zero codes from TMA) read row 0's scales; not stored
    # one int32 word holds a row's 4 block scales of one 64-element step
    word_ptrs = ws_ptr + rows.to(gl.int64) * words_per_row + k_begin
    # byte of the row's scale word for each code byte of the step (8 code bytes per 16-element block)
    shift = (shift // 8) * 8
    # Step i's wgmmas are issued while step i - 1's still run. A wgmma reads its register operand
    # asynchronously, so no instruction may write those registers before a wait covers it: two
    # call sites of _queued_step per loop iteration give consecutive steps their own registers, and
    # each site rewrites its registers one step after the wait on the wgmmas that read them.
    # Step 0 with use_acc=False: nothing but wgmmas may write the accumulator while they are in
    # flight (ptxas would serialize them), and from then on they always are.
    if SCALE_AHEAD:
        words = gl.load(word_ptrs)
        next_words = _step_words(word_ptrs, 0, k_count, SCALE_AHEAD)
        mbarrier.wait(ready.index(0), 0)
    else:
        mbarrier.wait(ready.index(0), 0)
        words = gl.load(word_ptrs)
        next_words = words
    lo_a, hi_a = _decoded_weight(w_bufs.index(0), words, shift, a_layout, codes_layout, FRAGMENT_ORDER)
    acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, mma_layout)
    acc = warpgroup_mma(lo_a, xlo_bufs.index(0).permute((1, 0)), acc, use_acc=False, is_async=True)
    acc = warpgroup_mma(hi_a, xhi_bufs.index(0).permute((1, 0)), acc, is_async=True)
    for i in range(1, k_count - 1, 2):
        acc, lo_b, hi_b, next_words = _queued_step(acc, i, lo_a, hi_a, next_words, xlo_bufs, xhi_bufs, w_bufs, ready,
                                                   empty, word_ptrs, shift, k_count, a_layout, codes_layout,
                                                   SCALE_AHEAD, FRAGMENT_ORDER)
        acc, lo_a, hi_a, next_words = _queued_step(acc, i + 1, lo_b, hi_b, next_words, xlo_bufs, xhi_bufs, w_bufs,
                                                   ready, empty, word_ptrs, shift, k_count, a_layout, codes_layout,
                                                   SCALE_AHEAD, FRAGMENT_ORDER)
    if k_count % 2 == 0:
        acc, lo_b, hi_b, next_words = _queued_step(acc, k_count - 1, lo_a, hi_a, next_words, xlo_bufs, xhi_bufs,
                                                   w_bufs, ready, empty, word_ptrs, shift, k_count, a_layout,
                                                   codes_layout, SCALE_AHEAD, FRAGMENT_ORDER)
        result, lo_b, hi_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc, lo_b, hi_b))
    else:
        result, lo_a, hi_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, lo_a, hi_a))
    return (result,)


@gluon.jit
def _store_output(acc, alpha_ptr, alpha_b_ptr, out_ptr, off_m, off_n, M, N, ALPHA_FROM_SCALES: gl.constexpr,
                  ALPHA_DIV_RN: gl.constexpr, num_warps: gl.constexpr):
    """``out[off_m + m, off_n + n] = acc[n, m] * 2**28 * alpha`` inside ``[M, N]``, in out's dtype."""
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    alpha = load_alpha(alpha_ptr, alpha_b_ptr, ALPHA_FROM_SCALES, ALPHA_DIV_RN)
    res = ((acc * DECODE_SCALE_UNDO) * alpha).to(out_ptr.dtype.element_ty)
    # out[m, n] = res[n, m]: 8 consecutive n per thread, so each thread stores 16 contiguous bytes
    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, num_warps], [0, 1])
    res = gl.convert_layout(res, out_layout)
    n_idx = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    m_idx = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
    offs = m_idx[None, :].to(gl.int64) * N + n_idx[:, None]
    gl.store(out_ptr + offs, res, mask=(m_idx < M)[None, :] & (n_idx < N)[:, None])


@gluon.jit
def _mm_hopper_kernel(xlo_desc, xhi_desc, w_desc, ws_ptr, alpha_ptr, alpha_b_ptr, out_ptr, part_ptr,
                      M, N, k_steps, words_per_row, iters_per_split,
                      ALPHA_FROM_SCALES: gl.constexpr, ALPHA_DIV_RN: gl.constexpr, PARTIAL: gl.constexpr,
                      STAGES: gl.constexpr, GROUP_M: gl.constexpr, SCALE_AHEAD: gl.constexpr,
                      FRAGMENT_ORDER: gl.constexpr, CODES_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
    """Program ``(tile, split)``: the tile's K steps ``[split * iters_per_split, +iters_per_split)``;
    the output (not PARTIAL) or the split's partial sums (PARTIAL: split-K, module docstring)."""
    BLOCK_M: gl.constexpr = xlo_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    step_bytes: gl.constexpr = w_desc.block_type.shape[1]
    tile = gl.program_id(0)
    split = gl.program_id(1)
    tile_m, tile_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = tile_m * BLOCK_M
    off_n = tile_n * BLOCK_N
    k_begin = split * iters_per_split
    k_count = gl.minimum(iters_per_split, k_steps - k_begin)

    xlo_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_M, step_bytes], xlo_desc.layout)
    xhi_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_M, step_bytes], xhi_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, step_bytes], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    results = gl.warp_specialize([
        (_mma_partition, (xlo_bufs, xhi_bufs, w_bufs, ready, empty, ws_ptr, words_per_row, off_n, N, k_begin, k_count,
                          BLOCK_N, BLOCK_M, SCALE_AHEAD, FRAGMENT_ORDER, CODES_LAYOUT, num_warps)),
        (_load_partition, (xlo_desc, xhi_desc, w_desc, xlo_bufs, xhi_bufs, w_bufs, ready, empty, off_m, off_n,
                           k_begin, k_count)),
    ], [1], [LOADER_REGISTERS])
    finish_tile(results[0], alpha_ptr, alpha_b_ptr, out_ptr, part_ptr, split, off_m, off_n, M, N, PARTIAL,
                ALPHA_FROM_SCALES, ALPHA_DIV_RN, num_warps)


@gluon.jit
def finish_tile(acc, alpha_ptr, alpha_b_ptr, out_ptr, part_ptr, split, off_m, off_n, M, N, PARTIAL: gl.constexpr,
                ALPHA_FROM_SCALES: gl.constexpr, ALPHA_DIV_RN: gl.constexpr, num_warps: gl.constexpr):
    """The end of program ``(tile, split)`` with its fp32 ``acc[BLOCK_N, BLOCK_M]`` (any distributed
    layout) for outputs ``[off_m, +BLOCK_M) x [off_n, +BLOCK_N)`` inside ``[M, N]``: the output (not
    PARTIAL), or (PARTIAL: split-K) the unscaled sums into ``part[split, m, n]`` of the fp32
    ``[splits, M, N]`` workspace, which ``reduce.sum_split_partials`` sums after the launch."""
    if not PARTIAL:
        _store_output(acc, alpha_ptr, alpha_b_ptr, out_ptr, off_m, off_n, M, N, ALPHA_FROM_SCALES, ALPHA_DIV_RN,
                      num_warps)
    else:
        # stored from the accumulator's own layout: a warp's store covers 8 consecutive n (32 bytes)
        # in each of 4 rows, whole sectors, with no shared-memory round trip
        BLOCK_N: gl.constexpr = acc.shape[0]
        BLOCK_M: gl.constexpr = acc.shape[1]
        # 32-bit offsets inside the tile (BLOCK_M * N < 2**31), the tile's corner in 64 bits
        n_in = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc.type.layout))
        m_in = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc.type.layout))
        corner = part_ptr + (split.to(gl.int64) * M + off_m) * N + off_n
        gl.store(corner + (m_in[None, :] * N + n_in[:, None]), acc,
                 mask=(m_in < M - off_m)[None, :] & (n_in < N - off_n)[:, None])


def hopper_split(m: int, n: int, k: int, sms: int, block_m: int) -> int:
    """Split-K count of an ``[m, K] x [n, K]^T`` product with ``block_m``-token tiles: none where the
    tiles fill ``sms`` multiprocessors, else enough K ranges to bring the programs to one wave, at
    most ``MAX_SPLIT`` and with at least ``MIN_STEPS_PER_SPLIT`` K steps each."""
    tiles = -(-m // block_m) * -(-n // BLOCK_N)
    steps = k // STEP_K
    return max(1, min(sms // tiles, steps // MIN_STEPS_PER_SPLIT, MAX_SPLIT))


@functools.cache
def codes_layout(step_bytes: int = STEP_BYTES) -> gl.DistributedLinearLayout:
    """FRAGMENT_ORDER's register layout of a stage's ``[BLOCK_N, step_bytes]`` weight codes (the
    kernel's ``CODES_LAYOUT``): the thread that holds rows r and r + 8 of a wgmma A fragment (lane
    ``4 g + t`` of warp w: r = 16 w + g) holds ``step_bytes / 4`` contiguous code bytes of each,
    bytes ``[t, t + 1) * step_bytes / 4``: registers over bytes then row + 8, lanes over t then g,
    warps over 16-row slices."""
    byte_bases = [[0, 1 << bit] for bit in range((step_bytes // 4).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=byte_bases + [[8, 0]],
        lane_bases=[[0, step_bytes // 4], [0, step_bytes // 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 << w, 0] for w in range(NUM_WARPS.bit_length() - 1)], block_bases=[],
        shape=[BLOCK_N, step_bytes])


@functools.cache
def _smem_layouts(block_m: int, step_bytes: int = STEP_BYTES) -> tuple[gl.NVMMASharedLayout, gl.NVMMASharedLayout]:
    """The TMA tiles' shared-memory layouts: activation halves ``[block_m, step_bytes]`` fp16 and
    weight codes ``[BLOCK_N, step_bytes]`` uint8 (computed once: they are part of the launch's key)."""
    return (gl.NVMMASharedLayout.get_default_for([block_m, step_bytes], gl.float16),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, step_bytes], gl.uint8))


def mm_fp4_hopper(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, alpha: Alpha,
    out_dtype: torch.dtype, out: torch.Tensor | None = None, block_m: int = BLOCK_M, split_k: int | None = None,
    max_registers: int = MAX_REGISTERS, stages: int = STAGES, scale_ahead: int = SCALE_AHEAD, step_k: int = STEP_K,
    fragment_order: bool = FRAGMENT_ORDER,
) -> torch.Tensor:
    """``alpha * (q_a * s_a) @ (q_b * s_b)^T`` (module docstring); ``out``: where to write it;
    ``block_m``: tokens per program, one of ``BLOCK_M_CHOICES``; ``split_k``: K ranges per tile
    (default :func:`split_for` of this call's M), summed in the launch in a fixed order. The sums,
    so the bits, depend on it: a row block computed alone matches the whole product only with the
    whole product's ``split_k``. ``max_registers``: ptxas's cap per thread over the 12 warps
    (sweeps: below 171 two programs fit a multiprocessor's registers, below 114 three).
    ``stages``: depth of the TMA ring, 2 to :func:`max_stages` (sweeps; the sums do not depend on it).
    ``scale_ahead``: 1 (shipped) loads each K step's weight scales a step ahead, 0 in the step (the
    sums do not depend on it). ``step_k``: K elements a step, one of ``STEP_K_CHOICES`` (sweeps;
    128 needs K % 128 == 0 and an 8-byte aligned ``b_scale``). A step's two nibble planes are
    accumulated one after the other, so the order of the fp32 sums, and with it the last bits,
    depends on it. ``fragment_order``: True (shipped) holds each step's K in the wgmma fragments'
    order, the activation decoded in that order (:func:`decode_activation`); False in K order
    (sweeps). Which products share a wgmma differs, so the last bits may.

    Under a tracer (fp4fuse's kernel lowering) the activation's decode is traced as its Triton
    launch and the Gluon launch, whose TMA descriptors Inductor cannot build, as one call of the
    internal op ``fp4fuse::_mm_fp4_hopper`` (``mm.mm_fp4_hopper_decoded``): the default launch
    only, so the compiled graph computes what the eager call computes, bit for bit."""
    launch = HopperLaunch(block_m, split_k, max_registers, stages, scale_ahead, step_k, fragment_order)
    _check_operands(a, b, a_scale, b_scale, out_dtype, out, launch)
    xlo, xhi = decode_activation(a, a_scale, launch)
    return _on_halves(a, a_scale, xlo, xhi, b, b_scale, alpha, out_dtype, out, launch)


def mm_fp4_hopper_products(a: torch.Tensor, a_scale: torch.Tensor,
                           weights: list[tuple[torch.Tensor, torch.Tensor, Alpha]], out_dtype: torch.dtype,
                           ) -> list[torch.Tensor]:
    """``[mm_fp4_hopper(a, b, a_scale, b_scale, alpha, out_dtype) for b, b_scale, alpha in weights]``,
    bit for bit, with the activation decoded once for all of them (a layer's sibling GEMMs)."""
    for b, b_scale, _ in weights:
        _check_operands(a, b, a_scale, b_scale, out_dtype, None, DEFAULT_LAUNCH)
    xlo, xhi = decode_activation(a, a_scale)
    return [_on_halves(a, a_scale, xlo, xhi, b, b_scale, alpha, out_dtype, None, DEFAULT_LAUNCH)
            for b, b_scale, alpha in weights]


def decode_activation(a: torch.Tensor, a_scale: torch.Tensor, launch: HopperLaunch = DEFAULT_LAUNCH
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation ``(a, a_scale)`` decoded to the fp16 halves ``launch`` reads
    (``decode.decode_fp4_halves``, in fragment order when ``launch.fragment_order``); what
    :func:`mm_fp4_hopper_halves` takes, as ``fp4fuse::_mm_fp4_hopper`` does (default launch)."""
    return decode_fp4_halves(a, a_scale, launch.step_k // 2 if launch.fragment_order else 0)


def _on_halves(a: torch.Tensor, a_scale: torch.Tensor, xlo: torch.Tensor, xhi: torch.Tensor, b: torch.Tensor,
               b_scale: torch.Tensor, alpha: Alpha, out_dtype: torch.dtype, out: torch.Tensor | None,
               launch: HopperLaunch) -> torch.Tensor:
    """``mm_fp4_hopper``'s launch on the activation ``(a, a_scale)`` decoded to ``xlo, xhi``, the
    arguments checked (``_check_operands``): under a tracer one call of ``fp4fuse::_mm_fp4_hopper``
    (the default launch only), else ``mm_fp4_hopper_halves``."""
    if tracing():
        if out is not None or launch != DEFAULT_LAUNCH:
            raise RuntimeError("mm_fp4_hopper: a traced call takes the default launch (no out, block_m, split_k, "
                               "max_registers, stages, scale_ahead, step_k or fragment_order): the op "
                               "fp4fuse::_mm_fp4_hopper makes it")
        alpha_a, alpha_b = alpha_operands(alpha)
        meta = alpha_meta(alpha)
        return torch.ops.fp4fuse._mm_fp4_hopper(a, a_scale, xlo, xhi, b, b_scale, alpha_a, alpha_b,
                                                meta["ALPHA_FROM_SCALES"], meta["ALPHA_DIV_RN"], out_dtype)
    return mm_fp4_hopper_halves(xlo, xhi, b, b_scale, alpha, out_dtype, out, launch)


def _check_operands(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                    out_dtype: torch.dtype, out: torch.Tensor | None, launch: HopperLaunch) -> None:
    """``mm_fp4_hopper``'s argument rules, each a ValueError naming the argument (before any launch).
    The weight's alignment is not checked under a tracer (fake tensors have no address)."""
    for name, t in (("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale)):
        if not t.is_contiguous():  # the kernel reads every operand as dense rows
            raise ValueError(f"mm_fp4_hopper: {name} must be contiguous (row-major); got strides {t.stride()}")
    m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
    block_m, split_k, stages, scale_ahead, step_k = (launch.block_m, launch.split_k, launch.stages,
                                                     launch.scale_ahead, launch.step_k)
    if step_k not in STEP_K_CHOICES:
        raise ValueError(f"mm_fp4_hopper: step_k must be one of {STEP_K_CHOICES}; got {step_k}")
    word = _SCALE_WORD[step_k].itemsize
    if k % step_k or (not tracing() and not hopper_operands_ok(b, b_scale, step_k)):
        raise ValueError(f"mm_fp4_hopper: needs K % {step_k} == 0, a 16-byte aligned b and a {word}-byte aligned "
                         f"b_scale (step_k={step_k}); got K={k}, b at {b.data_ptr() % 16} mod 16, b_scale at "
                         f"{b_scale.data_ptr() % word} mod {word}")
    if out is not None and (out.shape != (m, n) or out.dtype != out_dtype or out.stride() != (n, 1)):
        raise ValueError(f"mm_fp4_hopper: out must be a [{m}, {n}] {out_dtype} tensor with row stride {n}; got "
                         f"{out.dtype} {list(out.shape)} strides {out.stride()}")
    if block_m not in BLOCK_M_CHOICES:
        raise ValueError(f"mm_fp4_hopper: block_m must be one of {BLOCK_M_CHOICES}; got {block_m}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"mm_fp4_hopper: split_k must be at least 1; got {split_k}")
    if split_k not in (None, 1) and block_m * n >= 2 ** 31:  # the partials' 32-bit offsets in a tile
        raise ValueError(f"mm_fp4_hopper: split_k > 1 needs block_m * N < 2**31; got block_m={block_m}, N={n}")
    if not 2 <= stages <= max_stages(block_m, step_k):
        raise ValueError(f"mm_fp4_hopper: stages must be 2 to {max_stages(block_m, step_k)} for {block_m}-token tiles "
                         f"and {step_k}-element steps (the ring, {stage_bytes(block_m, step_k)} bytes a stage, must "
                         f"fit {SMEM_BYTES - EPILOGUE_SMEM_BYTES} bytes of shared memory); got {stages}")
    if scale_ahead not in (0, 1):
        raise ValueError(f"mm_fp4_hopper: scale_ahead must be 0 or 1 (K steps the weight scales load ahead); "
                         f"got {scale_ahead}")


def mm_fp4_hopper_halves(xlo: torch.Tensor, xhi: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                         alpha: Alpha, out_dtype: torch.dtype, out: torch.Tensor | None = None,
                         launch: HopperLaunch = DEFAULT_LAUNCH) -> torch.Tensor:
    """The Gluon launch on the activation decoded to fp16 halves (:func:`decode_activation` with
    the same ``launch``): the arguments as ``mm_fp4_hopper`` checks them (``_check_operands``), the
    weight aligned (:func:`hopper_operands_ok`). ``mm.mm_fp4_hopper_decoded`` calls it from a lowered graph.

    A call that allocates its output (``out`` None) repeats a prepared launch (``launch.Relaunch``:
    TMA descriptors encoded once, no per-call key of every argument) when an earlier call had the
    same :func:`_relaunch_key`, as a compiled graph's calls do forward after forward."""
    m, n, k = xlo.shape[0], b.shape[0], xlo.shape[1] * 2
    if m == 0 or n == 0:
        return out if out is not None else torch.empty((m, n), dtype=out_dtype, device=b.device)
    if k == 0:
        return empty_sum_(out if out is not None else torch.empty((m, n), dtype=out_dtype, device=b.device), alpha)
    alpha_a, alpha_b = alpha_operands(alpha)
    alpha_flags = alpha_meta(alpha)
    key = None
    if out is None and not tracing() and not launch_hooks_set():
        key = _relaunch_key(xlo, xhi, b, b_scale, alpha_a, alpha_b, alpha_flags, out_dtype, launch)
        prepared = _RELAUNCHES.get(key)
        if prepared is not None:
            relaunch, splits = prepared
            out = torch.empty((m, n), dtype=out_dtype, device=b.device)
            partials = _split_workspace(splits, m, n, b.device)
            relaunch(b_scale.view(_SCALE_WORD[launch.step_k]), alpha_a, alpha_b, out,
                     out if partials is None else partials)
            return _sum_splits(partials, out, alpha)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=b.device)
    block_m, step_k = launch.block_m, launch.step_k
    split_k = launch.split_k if launch.split_k is not None else split_for(m, n, k, num_sms(b.device))
    k_steps = k // step_k
    splits, iters = split_ranges(k_steps, split_k)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, BLOCK_N)
    partials = _split_workspace(splits, m, n, b.device)
    step_bytes = step_k // 2
    x_layout, w_layout = _smem_layouts(block_m, step_bytes)
    # one scale word per weight row and step: words_per_row == k_steps
    args = (TensorDescriptor.from_tensor(xlo, [block_m, step_bytes], x_layout),
            TensorDescriptor.from_tensor(xhi, [block_m, step_bytes], x_layout),
            TensorDescriptor.from_tensor(b, [BLOCK_N, step_bytes], w_layout),
            b_scale.view(_SCALE_WORD[step_k]), alpha_a, alpha_b, out, out if partials is None else partials, m, n,
            k_steps, k_steps, iters)
    meta = dict(**alpha_flags, PARTIAL=splits > 1, STAGES=launch.stages, GROUP_M=GROUP_M,
                SCALE_AHEAD=launch.scale_ahead, FRAGMENT_ORDER=launch.fragment_order,
                CODES_LAYOUT=codes_layout(step_bytes) if launch.fragment_order else None, num_warps=NUM_WARPS,
                maxnreg=launch.max_registers)
    kernel = traceable(_mm_hopper_kernel)
    if key is None or not isinstance(kernel, FastKernel):
        kernel[(tiles, splits)](*args, **meta)
        return _sum_splits(partials, out, alpha)
    relaunch = kernel.prepare((tiles, splits), *args, **meta)  # launches
    if relaunch is not None:
        if len(_RELAUNCHES) >= MAX_RELAUNCHES:
            _RELAUNCHES.clear()
        _RELAUNCHES[key] = (relaunch, splits)
    return _sum_splits(partials, out, alpha)


def _split_workspace(splits: int, m: int, n: int, device: torch.device) -> torch.Tensor | None:
    """The fp32 ``[splits, m, n]`` partial sums of a split-K launch (None for one split), fresh per
    call: nothing may outlive a CUDA-graph tree's pool (``mm_decode``'s workspace rule). Every
    element is written by its split's program, so it needs no zeroing."""
    return torch.empty((splits, m, n), dtype=torch.float32, device=device) if splits > 1 else None


def _sum_splits(partials: torch.Tensor | None, out: torch.Tensor, alpha: Alpha) -> torch.Tensor:
    """``out``, after the split-K launch's partials (if any) are summed into it in split order."""
    return out if partials is None else sum_split_partials(partials, out, alpha)


#: Prepared launches of :func:`mm_fp4_hopper_halves`, by :func:`_relaunch_key`; cleared when full
#: (a graph's calls hold a few dozen; addresses that change every call would otherwise pile up).
_RELAUNCHES: dict[tuple, tuple[Relaunch, int]] = {}
MAX_RELAUNCHES = 1024


def _relaunch_key(xlo: torch.Tensor, xhi: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  alpha_a: torch.Tensor, alpha_b: torch.Tensor, alpha_flags: dict[str, bool], out_dtype: torch.dtype,
                  launch: HopperLaunch) -> tuple:
    """What a prepared launch fixes (``launch.Relaunch``): the device; the three descriptors'
    tensors' addresses, shapes and strides (which also fix M, N, K, so the grid, the split and the
    scalars); the dtype and 16-byte alignment of each tensor passed per call (the output and the
    workspace come from the allocator, aligned); alpha's form (``alpha_flags``, ``alpha_meta``'s
    constexprs), the output dtype and the launch. With ``b``'s address and ``b_scale``'s
    alignment class the weight alignment rule's outcome is fixed too."""
    return (torch._C._cuda_getDevice(), out_dtype, launch, tuple(alpha_flags.items()),
            xlo.data_ptr(), xlo.dtype, xlo.shape, xlo.stride(), xhi.data_ptr(), xhi.dtype, xhi.shape, xhi.stride(),
            b.data_ptr(), b.dtype, b.shape, b.stride(), b_scale.dtype, b_scale.data_ptr() % 16,
            alpha_a.dtype, alpha_a.data_ptr() % 16 == 0, alpha_b.dtype, alpha_b.data_ptr() % 16 == 0)
