"""Overlapped collective GEMM schedules on CUDA symmetric memory (P2P only, never multicast).

The schedules move data and order streams; the per-shard compute is a :class:`ShardConsumer` the
caller passes in (fp4fuse's NVFP4 GEMM is ``fp4fuse.ops.collective_gemm.RowBlockGemm``), as in
PyTorch's ``_pipelined_all_gather_and_consume(shard, shard_consumer, ...)``.

All-gather + GEMM (``W`` ranks, this rank ``r``, ``m`` rows per shard) has two schedules
(:class:`~fp4fuse.distributed.symm_mem.policy.AllGatherSchedule`, chosen by
:func:`fp4fuse.distributed.symm_mem.policy.all_gather_schedule`).

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

Each row block's GEMM writes straight into its rows of the output (or workspace slot) through the
consumer; only where the backend cannot write into a view does it copy.

Numerics: ``DECODE_GATHER`` equals the unfused ``mm_fp4`` over all rows bit for bit. Elsewhere
every row block's GEMM equals ``mm_fp4`` on that row block, bit for bit. Against one
``mm_fp4`` over all rows (the unfused graph) a row can differ in the last bits only where the
backend picks another configuration for another row count (the Triton kernel's split-K, its
dequantize + cuBLAS path from ``DEQUANT_MIN_M`` rows, cuBLAS's own heuristics); the tests count
it. The reduce-scatter sums the ``out_dtype`` partials in fp32 in rank order and rounds once
(``fp4fuse.ops.collective_gemm.sum_in_rank_order``), as the functional fallback does -- bit-equal to it for two ranks; for
more, NCCL's fp32 reduce-scatter sums in its own (ring) order and may differ in the last bit.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from fp4fuse.distributed.symm_mem.policy import AllGatherSchedule
from fp4fuse.distributed.symm_mem.workspace import (
    AllGatherLayout, Channel, SymmWorkspace, all_gather_layout, reduce_scatter_layout,
)

__all__ = ["GatheredMatmul", "PreparedBlock", "ShardConsumer", "all_gather_and_consume", "reduce_scatter_partials"]


@dataclasses.dataclass(frozen=True)
class PreparedBlock:
    """A row block ready for its GEMM: the packed operand, or its bf16 decode (``a_dequant``)."""
    a: torch.Tensor
    a_scale: torch.Tensor
    a_dequant: torch.Tensor | None = None


class ShardConsumer(Protocol):
    """The per-shard work the pipelines drive: a GEMM of packed NVFP4 row blocks ``(a, a_scale)``
    against one weight, written into ``[rows, out_features]`` views of ``out_dtype``.

    ``may_hold_all_sms``: its GEMM kernel may keep every multiprocessor until it ends (a persistent
    kernel), so a signal kernel queued on another stream meanwhile would not start before it
    finishes. ``decodes_operands``: the GEMM proper multiplies bf16 decodes of both operands
    (``decoded_weight`` / ``decode_rows`` / ``run_decoded`` are then available)."""

    out_features: int
    out_dtype: torch.dtype
    may_hold_all_sms: bool
    decodes_operands: bool

    def decoded_weight(self) -> torch.Tensor: ...

    def decode_rows(self, a: torch.Tensor, a_scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def run_decoded(self, out: torch.Tensor, a_dequant: torch.Tensor) -> None: ...

    def prepare(self, a: torch.Tensor, a_scale: torch.Tensor) -> PreparedBlock: ...

    def run(self, out: torch.Tensor, block: PreparedBlock) -> None: ...

    def __call__(self, out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor) -> None: ...


# ----------------------------------------------------------------------------------------------
# Pipelines
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GatheredMatmul:
    """Result of the all-gather pipeline: the GEMM output and the gathered operand."""
    out: torch.Tensor
    a: torch.Tensor
    a_scale: torch.Tensor


def all_gather_and_consume(
    ws: SymmWorkspace, a_shard: torch.Tensor, a_scale_shard: torch.Tensor, gemm: ShardConsumer, *,
    need_gathered: bool, schedule: AllGatherSchedule,
) -> GatheredMatmul:
    """``gemm`` over ``all_gather(a_shard), all_gather(a_scale_shard)`` along dim 0, overlapped
    (module doc): returns the ``[W*m, out_features]`` output and the gathered operand.

    Collective over ``ws``'s group; inputs validated and agreed across ranks by the caller.
    ``need_gathered``: also fill this rank's rows of the returned ``a`` / ``a_scale`` (else those
    rows are left unwritten and the caller must not use them). ``DECODE_GATHER`` needs a consumer
    that ``decodes_operands`` and falls back to ``PER_SHARD`` otherwise."""
    m, k_half = a_shard.shape
    layout = all_gather_layout(m, k_half, a_scale_shard.shape[1])
    ws.ensure_capacity(layout.nbytes)
    if schedule is AllGatherSchedule.DECODE_GATHER and gemm.decodes_operands:
        return _all_gather_decode_gather(ws, layout, gemm, a_shard, a_scale_shard, need_gathered)
    return _all_gather_per_shard(ws, layout, gemm, a_shard, a_scale_shard, need_gathered)


def _gathered_buffers(world: int, a_shard: torch.Tensor, a_scale_shard: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Uninitialised gathered ``a`` ``[W*m, K/2]`` and ``a_scale`` ``[W*m, K/16]`` (plus its uint8 view)."""
    m = a_shard.shape[0]
    a = a_shard.new_empty((world * m, a_shard.shape[1]))
    a_scale = a_scale_shard.new_empty((world * m, a_scale_shard.shape[1]))
    return a, a_scale, a_scale.view(torch.uint8)


def _pull_peer_shard(ws: SymmWorkspace, layout: AllGatherLayout, peer: int, rows: slice,
                     a: torch.Tensor, a_scale_bytes: torch.Tensor) -> None:
    """On the current stream: copy ``peer``'s published shard (copy engine) into its gathered rows."""
    a[rows].copy_(ws.view(peer, layout.data))
    a_scale_bytes[rows].copy_(ws.view(peer, layout.scales))


def _publish_own_shard(ws: SymmWorkspace, layout: AllGatherLayout, a_shard: torch.Tensor,
                       a_scale_shard: torch.Tensor) -> None:
    """On the current (side) stream: this rank's shard into its buffer, then the READY barrier."""
    ws.view(ws.rank, layout.data).copy_(a_shard)
    ws.view(ws.rank, layout.scales).copy_(a_scale_shard.view(torch.uint8))
    ws.barrier(Channel.READY)


def _all_gather_decode_gather(
    ws: SymmWorkspace, layout: AllGatherLayout, gemm: ShardConsumer, a_shard: torch.Tensor,
    a_scale_shard: torch.Tensor, need_gathered: bool,
) -> GatheredMatmul:
    """DECODE_GATHER: the gather is hidden under the GEMM's decode prologue, and one GEMM runs over
    all rows -- the unfused ``mm_fp4``'s own kernels on the same shapes, so bit-identical to it."""
    world, rank = ws.world_size, ws.rank
    m, k_half = a_shard.shape
    a, a_scale, a_scale_bytes = _gathered_buffers(world, a_shard, a_scale_shard)
    a_dequant = torch.empty((world * m, k_half * 2), dtype=torch.bfloat16, device=a_shard.device)
    out = a_shard.new_empty((world * m, gemm.out_features), dtype=gemm.out_dtype)
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
                _pull_peer_shard(ws, layout, peer, rows, a, a_scale_bytes)
            own = slice(rank * m, (rank + 1) * m)
            a[own].copy_(a_shard)
            a_scale[own].copy_(a_scale_shard)
        ws.barrier(Channel.DONE)
    main.wait_event(ws.ready_events[0])
    gemm.run_decoded(out, a_dequant)
    main.wait_stream(side)
    return GatheredMatmul(out, a, a_scale)


def _all_gather_per_shard(
    ws: SymmWorkspace, layout: AllGatherLayout, gemm: ShardConsumer, a_shard: torch.Tensor,
    a_scale_shard: torch.Tensor, need_gathered: bool,
) -> GatheredMatmul:
    """PER_SHARD: one GEMM per shard, each peer's shard pulled by the copy engine during the GEMMs
    before it."""
    world, rank = ws.world_size, ws.rank
    m = a_shard.shape[0]
    a, a_scale, a_scale_bytes = _gathered_buffers(world, a_shard, a_scale_shard)
    out = a_shard.new_empty((world * m, gemm.out_features), dtype=gemm.out_dtype)
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
            _pull_peer_shard(ws, layout, peer, rows, a, a_scale_bytes)
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


def reduce_scatter_partials(
    ws: SymmWorkspace, a: torch.Tensor, a_scale: torch.Tensor, gemm: ShardConsumer,
) -> torch.Tensor:
    """The partials of a reduce-scatter of ``gemm(a, a_scale)`` along dim 0, overlapped (module doc):
    ``recv[src]`` ``[W, M/W, out_features]`` is rank ``src``'s product for this rank's rows; the
    caller sums them (in rank order, ``fp4fuse.ops.collective_gemm.sum_in_rank_order``).

    Collective over ``ws``'s group; rows of ``a`` divisible by the group size, inputs validated
    and agreed across ranks by the caller."""
    world, rank = ws.world_size, ws.rank
    m = a.shape[0] // world
    layout = reduce_scatter_layout(world, m, gemm.out_features, gemm.out_dtype)
    ws.ensure_capacity(layout.nbytes)

    recv = a.new_empty((world, m, gemm.out_features), dtype=gemm.out_dtype)
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
    return recv

