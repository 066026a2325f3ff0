"""Overlapped NVFP4 collective GEMMs on CUDA symmetric memory (P2P only, never multicast).

All-gather + GEMM (``W`` ranks, this rank ``r``, ``m`` rows per shard) has two schedules
(:class:`AllGatherSchedule`, chosen by :func:`fp4fuse.ops.collective_policy.all_gather_schedule`).

``DECODE_GATHER`` (the decode + cuBLAS GEMM path, i.e. bf16 output from ``DEQUANT_MIN_M`` rows): the
GEMM proper multiplies bf16 decodes of both operands, and decoding them is a prologue of
``(N + m) * K`` elements that needs no peer data. The gather hides under it: each peer's packed
shard is decoded straight out of the peer's buffer (SM loads over NVLink) into its rows of the
bf16 operand, and then one GEMM runs over all rows -- the kernels and shapes of the unfused
``mm_fp4``, so the result is bit-identical to it::

    side stream (high priority)                     caller's stream
    ---------------------------                     ---------------
    wait caller's stream                            decode(b)
    own shard (data, scales) -> my buffer           decode(own shard)   -> a_bf16[r]
    barrier(READY)
    for p != r: decode(p's buffer) -> a_bf16[p]
    record event                                    wait event
    [gathered variant: pull packed shards]          mm(a_bf16, b_bf16^T) -> out; out *= alpha
    barrier(DONE)                                   wait side stream

``PER_SHARD`` (anything else, and where the gather outlasts the prologue)::

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

Numerics: ``DECODE_GATHER`` equals the unfused ``mm_fp4`` over all rows bit for bit. Elsewhere
every row block's GEMM equals ``mm_fp4`` on that row block, bit for bit. Against one
``mm_fp4`` over all rows (the unfused graph) a row can differ in the last bits only where the
backend picks another configuration for another row count (the Triton kernel's split-K, its
dequantize + cuBLAS path from ``DEQUANT_MIN_M`` rows, cuBLAS's own heuristics); the tests count
it. The reduce-scatter sums the ``out_dtype`` partials in fp32 in rank order and rounds once
(:func:`sum_in_rank_order`), as the functional fallback does -- bit-equal to it for two ranks; for
more, NCCL's fp32 reduce-scatter sums in its own (ring) order and may differ in the last bit.
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
      the in-place alpha scale -- the same kernels and arithmetic as ``triton_mm.mm_fp4_dequant_mm``, so
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
            self._scale_by_alpha = triton_mm.scale_by_alpha_
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


class AllGatherSchedule(enum.Enum):
    """How the all-gather pipeline overlaps the gather with the GEMM (module doc)."""
    DECODE_GATHER = "decode-gather"
    PER_SHARD = "per-shard"


def all_gather_fp4_matmul(
    ws: SymmWorkspace, a_shard: torch.Tensor, a_scale_shard: torch.Tensor, b: torch.Tensor,
    b_scale: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype, *, need_gathered: bool,
    schedule: AllGatherSchedule | None = None,
) -> GatheredMatmul:
    """``mm_fp4(all_gather(a_shard), b, all_gather(a_scale_shard), ...)`` overlapped (module doc).

    Collective over ``ws``'s group; inputs validated and agreed across ranks by the caller.
    ``need_gathered``: also fill this rank's rows of the returned ``a`` / ``a_scale`` (else those
    rows are left unwritten and the caller must not use them). ``schedule``: default
    :func:`~fp4fuse.ops.collective_policy.all_gather_schedule`; ``DECODE_GATHER`` needs the
    decode + cuBLAS GEMM path and falls back to ``PER_SHARD`` elsewhere."""
    from fp4fuse.ops import collective_policy as policy
    world = ws.world_size
    m, k_half = a_shard.shape
    layout = all_gather_layout(m, k_half, a_scale_shard.shape[1])
    ws.ensure_capacity(layout.nbytes)
    gemm = RowBlockGemm(b, b_scale, alpha, out_dtype, m, total_rows=world * m)
    if schedule is None:
        schedule = policy.all_gather_schedule(world, m, b.shape[0], k_half * 2)
    if schedule is AllGatherSchedule.DECODE_GATHER and gemm.decodes_operands:
        return _all_gather_decode_gather(ws, layout, gemm, a_shard, a_scale_shard, need_gathered)
    return _all_gather_per_shard(ws, layout, gemm, a_shard, a_scale_shard, need_gathered)


def _gathered_buffers(world: int, a_shard: torch.Tensor, a_scale_shard: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Uninitialised gathered ``a`` ``[W*m, K/2]`` and ``a_scale`` ``[W*m, K/16]`` (plus its uint8 view)."""
    m = a_shard.shape[0]
    a = a_shard.new_empty((world * m, a_shard.shape[1]))
    a_scale = a_scale_shard.new_empty((world * m, a_scale_shard.shape[1]))
    return a, a_scale, a_scale.view(torch.uint8)


def _publish_own_shard(ws: SymmWorkspace, layout: AllGatherLayout, a_shard: torch.Tensor,
                       a_scale_shard: torch.Tensor) -> None:
    """On the current (side) stream: this rank's shard into its buffer, then the READY barrier."""
    ws.view(ws.rank, layout.data).copy_(a_shard)
    ws.view(ws.rank, layout.scales).copy_(a_scale_shard.view(torch.uint8))
    ws.barrier(Channel.READY)


def _all_gather_decode_gather(
    ws: SymmWorkspace, layout: AllGatherLayout, gemm: RowBlockGemm, a_shard: torch.Tensor,
    a_scale_shard: torch.Tensor, need_gathered: bool,
) -> GatheredMatmul:
    """DECODE_GATHER: the gather is hidden under the GEMM's decode prologue, and one GEMM runs over
    all rows -- the unfused ``mm_fp4``'s own kernels on the same shapes, so bit-identical to it."""
    world, rank = ws.world_size, ws.rank
    m, k_half = a_shard.shape
    a, a_scale, a_scale_bytes = _gathered_buffers(world, a_shard, a_scale_shard)
    a_dequant = torch.empty((world * m, k_half * 2), dtype=torch.bfloat16, device=a_shard.device)
    out = a_shard.new_empty((world * m, gemm.b.shape[0]), dtype=gemm.out_dtype)
    main, side = torch.cuda.current_stream(), ws.side_stream

    ws.start_event.record(main)
    gemm.decoded_weight()
    gemm.decode_rows(a_shard, a_scale_shard, out=a_dequant[rank * m:(rank + 1) * m])
    with torch.cuda.stream(side):
        side.wait_event(ws.start_event)
        _publish_own_shard(ws, layout, a_shard, a_scale_shard)
        for step in range(1, world):
            peer = (rank + step) % world
            rows = slice(peer * m, (peer + 1) * m)
            # SM loads of the peer's mapped buffer over NVLink, decoded on the way in.
            gemm.decode_rows(ws.view(peer, layout.data), ws.view(peer, layout.scales),
                             out=a_dequant[rows])
        ws.ready_events[0].record(side)
        if need_gathered:
            for step in range(1, world):
                peer = (rank + step) % world
                rows = slice(peer * m, (peer + 1) * m)
                a[rows].copy_(ws.view(peer, layout.data))
                a_scale_bytes[rows].copy_(ws.view(peer, layout.scales))
            own = slice(rank * m, (rank + 1) * m)
            a[own].copy_(a_shard)
            a_scale[own].copy_(a_scale_shard)
        ws.barrier(Channel.DONE)
    main.wait_event(ws.ready_events[0])
    gemm.run_decoded(out, a_dequant)
    main.wait_stream(side)
    return GatheredMatmul(out, a, a_scale)


def _all_gather_per_shard(
    ws: SymmWorkspace, layout: AllGatherLayout, gemm: RowBlockGemm, a_shard: torch.Tensor,
    a_scale_shard: torch.Tensor, need_gathered: bool,
) -> GatheredMatmul:
    """PER_SHARD: one GEMM per shard, each peer's shard pulled by the copy engine during the GEMMs
    before it."""
    world, rank = ws.world_size, ws.rank
    m = a_shard.shape[0]
    a, a_scale, a_scale_bytes = _gathered_buffers(world, a_shard, a_scale_shard)
    out = a_shard.new_empty((world * m, gemm.b.shape[0]), dtype=gemm.out_dtype)
    peers = [(rank + step) % world for step in range(1, world)]
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
        _publish_own_shard(ws, layout, a_shard, a_scale_shard)
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
    return sum_in_rank_order(recv)


def sum_in_rank_order(partials: torch.Tensor) -> torch.Tensor:
    """``partials[0] + partials[1] + ...`` (``[W, m, N]``) accumulated in fp32 in that order and
    rounded once to the partials' dtype: the same bits on every run and for every reduction kernel
    choice (``torch.sum`` over dim 0 does not promise an order)."""
    if partials.shape[0] == 2:  # one elementwise kernel: bf16/fp16 operands are added in fp32, rounded once
        return torch.add(partials[0], partials[1])
    if partials.is_cuda and backend_for(partials) is Backend.TRITON:
        from fp4fuse.ops.triton_reduce import sum_partials_in_order
        return sum_partials_in_order(partials)  # one pass; the loop below makes W + 1 over fp32
    acc = partials[0].to(torch.float32, copy=True)
    for p in partials[1:]:
        acc += p
    return acc.to(partials.dtype)
