"""Overlapped NVFP4 collective GEMMs on CUDA symmetric memory (P2P only, never multicast).

All-gather + GEMM (``W`` ranks, this rank ``r``, ``m`` rows per shard)::

    side stream (high priority)                     caller's stream
    ---------------------------                     ---------------
    wait caller's stream                            prepare(own shard)   (decode kernels, if any)
    own shard (data, scales) -> my buffer
    barrier(READY)                # all shards in   [wait READY]  (only before a GEMM that may hold every SM)
    for p = r+1, r+2, ...:                          mm(own shard)        -> out[r]
        pull p's shard -> a[p]  (copy engine)       for p = r+1, r+2, ...:
        record event(p)                                 wait event(p)
    [gathered variant: a_shard -> a[r]]                 mm(a[p])         -> out[p]
    barrier(DONE)                 # peers done reading my buffer
                                                    wait side stream

GEMM + reduce-scatter (rows of ``a`` split in ``W`` chunks; chunk ``d`` belongs to rank ``d``)::

    caller's stream                                 side stream
    ---------------                                 -----------
    for step s = 1 .. W-1 (dst = r+s, src = r-s):
        [wait READY(s-1)]                               wait event(s)
        mm(a[dst]) -> my buffer slot s-1                signal dst READY, wait src READY
        record event(s)                                 pull src's slot s-1 -> recv[src]
    [wait READY(W-1)]                                   barrier(DONE)
    mm(a[r]) -> recv[r]
    wait side stream
    out = sum_src recv[src]  (one kernel; fp32 accumulation, one rounding to out_dtype)

(The caller's stream issues its first decode / GEMM before the side stream's work: in eager mode
every launch costs the host microseconds, and the GEMM is what the pipeline waits for.)

Source ``s`` keeps its partial for destination ``d`` in slot ``(d - s - 1) mod W``, so the slot a
rank reads at step ``s`` has the same index as the one it wrote. With two ranks the READY handoff
is a single barrier kernel.

Why the bracketed waits: signals are small kernels on the side stream, and a persistent GEMM
(cuBLAS) keeps every multiprocessor until it ends, so a signal kernel queued behind it would start
only after it -- the pull it gates would no longer overlap anything. Before such a GEMM the
caller's stream waits until the handoff has run (it costs the peers' skew, a few microseconds);
the tiled Triton GEMM retires programs tile by tile and skips the waits. The pulls are plain
``copy_`` of mapped peer memory (``cudaMemcpyAsync``: copy engine, no multiprocessors), and the
DONE barrier has the whole next GEMM, or the gaps between kernels, to find a multiprocessor.

Each row block's GEMM writes straight into its rows of the output (or workspace slot) through
:class:`RowBlockGemm`; only where the backend cannot write into a view does it copy.

Numerics: every row block's GEMM equals ``mm_fp4`` on that row block, bit for bit. Against one
``mm_fp4`` over all rows (the unfused graph) a row can differ in the last bits only where the
backend picks another configuration for another row count (the Triton kernel's split-K, its
dequantize + cuBLAS path from ``DEQUANT_MIN_M`` rows, cuBLAS's own heuristics); the tests count
it. The reduce-scatter sums the ``out_dtype`` partials in fp32 in rank order and rounds once, as
the functional fallback does (bit-equal for two ranks; for more, NCCL may sum in another order).
"""
from __future__ import annotations

import dataclasses
import enum
import logging

import torch

from fp4fuse.ops.backend import Backend, backend_for
from fp4fuse.ops.workspace import Channel, Region, SymmWorkspace, align_up

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Buffer layouts (pure functions of the shapes, identical on every rank)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AllGatherLayout:
    """Where a rank's shard sits in its buffer: packed data, then block scales (both uint8)."""
    data: Region
    scales: Region

    @property
    def nbytes(self) -> int:
        return align_up(self.scales.end)


def all_gather_layout(shard_rows: int, k_half: int, k_blocks: int) -> AllGatherLayout:
    data = Region(0, (shard_rows, k_half), torch.uint8)
    scales = Region(align_up(data.end), (shard_rows, k_blocks), torch.uint8)
    return AllGatherLayout(data, scales)


@dataclasses.dataclass(frozen=True)
class ReduceScatterLayout:
    """``W - 1`` slots of one ``[m, N]`` ``out_dtype`` partial each (the rank's own chunk stays local)."""
    slots: tuple[Region, ...]

    @property
    def nbytes(self) -> int:
        return align_up(self.slots[-1].end) if self.slots else 0


def reduce_scatter_layout(world_size: int, chunk_rows: int, n: int, out_dtype: torch.dtype) -> ReduceScatterLayout:
    slot_bytes = align_up(chunk_rows * n * out_dtype.itemsize)
    return ReduceScatterLayout(tuple(
        Region(i * slot_bytes, (chunk_rows, n), out_dtype) for i in range(world_size - 1)))


# ----------------------------------------------------------------------------------------------
# GEMMs of row blocks into preallocated outputs
# ----------------------------------------------------------------------------------------------
class GemmMode(enum.Enum):
    """How :class:`RowBlockGemm` writes a row block's ``mm_fp4`` into an output view."""
    DEQUANT_CUBLAS = "exact bf16 dequantize + cuBLAS into out="
    TILED = "tiled Triton kernel with the whole GEMM's configuration, then copy"
    COPY = "mm_fp4 then copy"


def _triton_mm_module():
    try:
        from fp4fuse.ops import triton_mm
    except ImportError:
        return None
    return triton_mm


@dataclasses.dataclass(frozen=True)
class PreparedBlock:
    """A row block ready for its GEMM: the packed operand, or (DEQUANT_CUBLAS) its bf16 decode."""
    a: torch.Tensor
    a_scale: torch.Tensor
    a_dequant: torch.Tensor | None = None


class RowBlockGemm:
    """``mm_fp4`` of row blocks of ``a`` against one weight, each written into an output view.

    ``fp4fuse::mm_fp4`` returns a fresh tensor; copying each block's output into place would cost
    a full extra pass over ``[M, N]`` (7% of a large GEMM), so this picks, once per op call:

    * ``DEQUANT_CUBLAS``: the Triton backend's own large-M bf16 path, reproduced through its public
      functions so it can write into the view: ``torch.mm(dequant(a), dequant(b).T, out=view)`` then
      ``view *= alpha`` -- the same kernels and arithmetic as ``triton_mm.mm_fp4_dequant_mm``, so
      bit-identical, with ``b`` dequantized once per call instead of once per block;
    * ``TILED``: the Triton backend's tiled kernel, launched with the configuration (tile shape,
      split-K) that ``mm_fp4`` would pick for the whole ``total_rows``-row GEMM, so every output
      element is accumulated in the same order as in the unfused graph (bitwise equal to it);
    * ``COPY``: anything else (reference backend, whose kernel is row-independent).

    The path (dequantize + cuBLAS or tiled) is chosen from ``total_rows`` too, as the unfused
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
        total_rows = block_rows if total_rows is None else total_rows
        self._b_dequant: torch.Tensor | None = None
        backend = backend_for(b)
        triton_mm = _triton_mm_module() if backend is Backend.TRITON else None
        if triton_mm is not None and out_dtype == torch.bfloat16 and total_rows >= triton_mm.DEQUANT_MIN_M:
            self.mode = GemmMode.DEQUANT_CUBLAS
            self._dequantize = triton_mm.dequantize_fp4_triton
        elif triton_mm is not None:
            self.mode = GemmMode.TILED
            self._tiled = triton_mm.mm_fp4_tiled
            self._config = triton_mm.mm_config_for(total_rows, b.shape[0], b.shape[1] * 2, b.device)
        else:
            self.mode = GemmMode.COPY
        # fp4fuse's tiled kernel retires its programs tile by tile; anything else may be persistent.
        self.may_hold_all_sms = self.mode is not GemmMode.TILED
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("fp4fuse: %d-row blocks of %d rows, N=%d, %s: %s", block_rows, total_rows, b.shape[0],
                         out_dtype, self.mode.value)

    def prepare(self, a: torch.Tensor, a_scale: torch.Tensor) -> PreparedBlock:
        """Work before the GEMM proper, on the current stream (short, non-persistent kernels)."""
        if self.mode is not GemmMode.DEQUANT_CUBLAS:
            return PreparedBlock(a, a_scale)
        if self._b_dequant is None:
            self._b_dequant = self._dequantize(self.b, self.b_scale)
        return PreparedBlock(a, a_scale, self._dequantize(a, a_scale))

    def run(self, out: torch.Tensor, block: PreparedBlock) -> None:
        """``out[:] = mm_fp4(block.a, b, block.a_scale, b_scale, alpha, out_dtype)`` on the current
        stream; ``out`` a contiguous ``[rows, N]`` view."""
        if self.mode is GemmMode.DEQUANT_CUBLAS:
            torch.mm(block.a_dequant, self._b_dequant.t(), out=out)
            out.mul_(self.alpha.reshape(()))
        elif self.mode is GemmMode.TILED:
            out.copy_(self._tiled(block.a, self.b, block.a_scale, self.b_scale, self.alpha, self.out_dtype,
                                  self._config))
        else:
            out.copy_(torch.ops.fp4fuse.mm_fp4(block.a, self.b, block.a_scale, self.b_scale, self.alpha,
                                               self.out_dtype))

    def __call__(self, out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor) -> None:
        self.run(out, self.prepare(a, a_scale))


# ----------------------------------------------------------------------------------------------
# Pipelines
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GatheredMatmul:
    """Result of the all-gather pipeline: the GEMM output and the gathered operand."""
    out: torch.Tensor
    a: torch.Tensor
    a_scale: torch.Tensor


def all_gather_fp4_matmul(
    ws: SymmWorkspace, a_shard: torch.Tensor, a_scale_shard: torch.Tensor, b: torch.Tensor,
    b_scale: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype, *, need_gathered: bool,
) -> GatheredMatmul:
    """``mm_fp4(all_gather(a_shard), b, all_gather(a_scale_shard), ...)`` overlapped (module doc).

    Collective over ``ws``'s group; inputs validated and agreed across ranks by the caller.
    ``need_gathered``: also fill this rank's rows of the returned ``a`` / ``a_scale`` (else those
    rows are left unwritten and the caller must not use them)."""
    world, rank = ws.world_size, ws.rank
    m, k_half = a_shard.shape
    k_blocks = a_scale_shard.shape[1]
    layout = all_gather_layout(m, k_half, k_blocks)
    ws.ensure_capacity(layout.nbytes)

    a = a_shard.new_empty((world * m, k_half))
    a_scale = a_scale_shard.new_empty((world * m, k_blocks))
    a_scale_bytes = a_scale.view(torch.uint8)
    out = a_shard.new_empty((world * m, b.shape[0]), dtype=out_dtype)
    peers = [(rank + step) % world for step in range(1, world)]

    gemm = RowBlockGemm(b, b_scale, alpha, out_dtype, m, total_rows=world * m)
    main, side = torch.cuda.current_stream(), ws.side_stream
    own_out = out[rank * m:(rank + 1) * m]
    # Issue order matters in eager mode (each launch costs the host microseconds): the caller's
    # stream gets its first kernels before the side stream's copies and signals are issued.
    ws.start_event.record(main)
    local = gemm.prepare(a_shard, a_scale_shard)
    if not gemm.may_hold_all_sms:
        gemm.run(own_out, local)
    with torch.cuda.stream(side):
        side.wait_event(ws.start_event)
        ws.view(rank, layout.data).copy_(a_shard)
        ws.view(rank, layout.scales).copy_(a_scale_shard.view(torch.uint8))
        ws.barrier(Channel.READY)
        ws.ready_events[0].record(side)
        for step, peer in enumerate(peers, start=1):
            rows = slice(peer * m, (peer + 1) * m)
            a[rows].copy_(ws.view(peer, layout.data))
            a_scale_bytes[rows].copy_(ws.view(peer, layout.scales))
            ws.step_events[step].record(side)
        if need_gathered:
            own = slice(rank * m, (rank + 1) * m)
            a[own].copy_(a_shard)
            a_scale[own].copy_(a_scale_shard)
        ws.barrier(Channel.DONE)

    if gemm.may_hold_all_sms:
        main.wait_event(ws.ready_events[0])  # the READY barrier must have run before the GEMM takes every SM
        gemm.run(own_out, local)
    for step, peer in enumerate(peers, start=1):
        rows = slice(peer * m, (peer + 1) * m)
        main.wait_event(ws.step_events[step])
        gemm(out[rows], a[rows], a_scale[rows])
    main.wait_stream(side)
    return GatheredMatmul(out, a, a_scale)


def fp4_matmul_reduce_scatter(
    ws: SymmWorkspace, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``reduce_scatter_sum(mm_fp4(a, b, ...))`` along dim 0, overlapped (module doc).

    Collective over ``ws``'s group; rows of ``a`` divisible by the group size, inputs validated
    and agreed across ranks by the caller. Returns this rank's ``[M/W, N]`` chunk in ``out_dtype``."""
    world, rank = ws.world_size, ws.rank
    m = a.shape[0] // world
    n = b.shape[0]
    layout = reduce_scatter_layout(world, m, n, out_dtype)
    ws.ensure_capacity(layout.nbytes)

    recv = a.new_empty((world, m, n), dtype=out_dtype)
    gemm = RowBlockGemm(b, b_scale, alpha, out_dtype, m, total_rows=a.shape[0])
    main, side = torch.cuda.current_stream(), ws.side_stream
    side.wait_stream(main)
    for step in range(1, world + 1):
        dst = (rank + step) % world  # step == world: this rank's own chunk, last
        rows = slice(dst * m, (dst + 1) * m)
        block = gemm.prepare(a[rows], a_scale[rows])
        if step > 1 and gemm.may_hold_all_sms:
            # The previous step's handoff must have run before this GEMM takes every SM; then its
            # pull (copy engine) overlaps this GEMM.
            main.wait_event(ws.ready_events[step - 1])
        if step == world:
            gemm.run(recv[rank], block)
            break
        slot = layout.slots[step - 1]
        gemm.run(ws.view(rank, slot), block)
        ws.step_events[step].record(main)
        src = (rank - step) % world
        with torch.cuda.stream(side):
            side.wait_event(ws.step_events[step])
            if world == 2:
                ws.barrier(Channel.READY)
            else:
                ws.put_signal(dst, Channel.READY)
                ws.wait_signal(src, Channel.READY)
            ws.ready_events[step].record(side)
            recv[src].copy_(ws.view(src, slot))
    with torch.cuda.stream(side):
        ws.barrier(Channel.DONE)
    main.wait_stream(side)
    if world == 2:  # one elementwise kernel: bf16/fp16 add in fp32 and round once, like the sum below
        return torch.add(recv[0], recv[1])
    return torch.sum(recv, dim=0)
