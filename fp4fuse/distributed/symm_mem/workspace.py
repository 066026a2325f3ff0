"""Per-group symmetric-memory workspaces for the overlapped collective GEMMs.

A :class:`SymmWorkspace` is one P2P buffer (``torch.distributed._symmetric_memory``, CUDA
backend, no multicast) shared by the ranks of one process group, plus the side stream and events
the pipelines in :mod:`fp4fuse.distributed.symm_mem.pipelines` run on. Every rank maps every peer's buffer, so a
rank pulls a peer's data with a plain copy (copy engine over NVLink) and signals through the
buffer's signal pad (``barrier`` / ``put_signal`` / ``wait_signal``).

Lifetime: a workspace is created on the first overlapped call for its ``(group_name, device)``
(or by :func:`reserve_workspace`) and then kept in this module's registry until the end of the
process, or until the name resolves to another process group: torch numbers group names from a
counter, so after ``destroy_process_group`` and a new ``init_process_group`` a name can come back
for other ranks, and a workspace built for the old group would exchange data with its peers. Each
entry remembers its group, and a lookup that resolves the name to another one builds anew.

Creating and growing are collective: every rank of the group must do them with the same sizes in
the same order. The ops guarantee that by
checking, before their first overlapped call with a given shape, that all ranks agree on the shapes
(:func:`fp4fuse.distributed.groups.check_ranks_agree`); sizes are a pure function of those shapes.

Growing cannot happen while a CUDA graph is being captured (the rendezvous synchronizes the host):
a graph captures with the buffer its warm-up call sized (CUDA-graph trees run every graph eagerly
before capturing it), or :func:`reserve_workspace` sizes it first. The buffer and the rendezvous'
tables are allocated on a helper thread (:func:`outside_cuda_graph_pools`), never in the private
pool a CUDA-graph tree's warm-up routes its thread's allocations to. A captured graph holds the
addresses of its buffer generation (this rank's and the peers' mappings), so a generation that any
capture used is kept mapped when a later, larger call grows the workspace, until the process ends;
replaying the graph then still reads and writes live memory. Handles and peer views are cached, so
steady-state calls do no rendezvous.

Signal-pad channels used by the pipelines (see :class:`Channel`): ``READY`` (data in a buffer may
be read) and ``DONE`` (every peer finished reading this call's buffers; the buffer may be
overwritten). Every op ends with the ``DONE`` barrier on the side stream and the caller's stream
waiting for it, so consecutive ops on one group never race on the buffer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import socket
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist

from fp4fuse.config import env_int
from fp4fuse.distributed.groups import gather_values, resolve_group

logger = logging.getLogger(__name__)

ENV_TIMEOUT_MS = "FP4FUSE_SYMM_MEM_TIMEOUT_MS"
#: How long (ms) a device-side wait for a peer may spin before the kernel traps (an error, not a
#: hang). Generous: a peer may be compiling or autotuning a kernel the first time through.
DEFAULT_TIMEOUT_MS = 300_000
#: Region alignment inside the buffer, bytes (full 128-byte lines for the copy engine).
ALIGN_BYTES = 256
#: Smallest buffer ever allocated, bytes; growth is at least 1.5x so serving with growing batches
#: does few rendezvous.
MIN_CAPACITY_BYTES = 4 << 20
_GROWTH = 1.5
_CAPACITY_ROUND = 2 << 20


class Channel(enum.IntEnum):
    """Signal-pad channels of an fp4fuse workspace."""
    READY = 0
    DONE = 1


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return -(-n // align) * align


def grown_capacity(current: int, requested: int) -> int:
    """Capacity (bytes) to allocate when ``requested`` exceeds ``current``: at least
    ``MIN_CAPACITY_BYTES``, ``requested`` and 1.5x ``current``, rounded up to 2 MiB.
    A pure function, so every rank grows to the same size."""
    want = max(requested, int(current * _GROWTH), MIN_CAPACITY_BYTES)
    return align_up(want, _CAPACITY_ROUND)


def timeout_ms() -> int:
    """``FP4FUSE_SYMM_MEM_TIMEOUT_MS`` (an integer >= 1) or ``DEFAULT_TIMEOUT_MS``."""
    return env_int(ENV_TIMEOUT_MS, DEFAULT_TIMEOUT_MS, minimum=1)


@dataclasses.dataclass(frozen=True)
class Region:
    """A typed window of a workspace buffer: ``shape`` elements of ``dtype`` at byte ``offset``."""
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


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


class WorkspaceUnavailable(RuntimeError):
    """Symmetric memory cannot serve this group; the message says why."""


def _symm_mem_class():
    from torch._C._distributed_c10d import _SymmetricMemory
    return _SymmetricMemory


def local_unavailability(device: torch.device) -> str | None:
    """Why this process cannot use CUDA symmetric memory on ``device`` (``None`` if it can)."""
    if device.type != "cuda":
        return f"inputs are on {device.type}; symmetric memory needs CUDA"
    try:
        symm = _symm_mem_class()
    except ImportError as exc:
        return f"this torch build has no symmetric memory ({exc})"
    backend = symm.get_backend(device) if hasattr(symm, "get_backend") else None
    if backend not in (None, "CUDA"):
        return f"symmetric-memory backend is {backend}; fp4fuse's pipelines are written for the CUDA backend"
    return None


def _host_id() -> int:
    return zlib.crc32(socket.gethostname().encode())


_T = TypeVar("_T")


def outside_cuda_graph_pools(fn: Callable[[], _T], device: torch.device) -> _T:
    """``fn()``, run on a helper thread (joined before returning; its exception re-raised here).

    CUDA-graph trees route every CUDA allocation of the thread that warms a graph up to the graph's
    private pool (``torch._inductor.cudagraph_trees._use_cuda_memory_pool_manager``), and refuse a
    pool allocation that outlives the warm-up without being an output ("tensor(s) in the cudagraph
    pool not tracked as outputs"), since the pool reuses that memory. A workspace lives for the
    process, and the symmetric-memory rendezvous allocates its peer-pointer tables from the caching
    allocator: made on another thread, they come from the ordinary pool, whatever the caller's
    thread is routed to."""
    result: list[_T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            with torch.cuda.device(device):
                result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            error.append(exc)

    worker = threading.Thread(target=run, name="fp4fuse-symm-alloc")
    worker.start()
    worker.join()
    if error:
        raise error[0]
    return result[0]


class SymmWorkspace:
    """One group's symmetric buffer on one device, its side stream and its events.

    Not thread-safe; one workspace serves the ops of its group in stream order on one device.
    """

    def __init__(self, group_name: str, device: torch.device, rank: int, world_size: int) -> None:
        self.group_name = group_name
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.side_stream = torch.cuda.Stream(device=device, priority=-1)
        # Per pipeline step: data handed from one stream to the other (step_events), and a READY
        # handoff completed on the side stream (ready_events). Reused by every call: a wait
        # captures the event's latest record when it is enqueued.
        self.start_event = torch.cuda.Event()
        self.done_event = torch.cuda.Event()
        self.step_events = [torch.cuda.Event() for _ in range(world_size)]
        self.ready_events = [torch.cuda.Event() for _ in range(world_size)]
        self.capacity = 0
        self.generation = 0
        self._buffer: torch.Tensor | None = None
        self._handle = None
        # The last generation a CUDA-graph capture used, and the buffers (with their handles, which
        # hold the peer mappings) of earlier captured generations, kept alive for their graphs.
        self._captured_generation: int | None = None
        self.retired: list[tuple[torch.Tensor, object]] = []
        self._views: dict[tuple[int, Region], torch.Tensor] = {}
        self._streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}

    # -- capacity -------------------------------------------------------------------------------
    def ensure_capacity(self, nbytes: int) -> None:
        """Grow the buffer to hold ``nbytes`` (collective when it grows; see the module doc).
        Every call that uses the buffer makes this call first, so a capture's use is recorded here."""
        capturing = torch.cuda.is_current_stream_capturing()
        if nbytes <= self.capacity:
            if capturing:
                self._captured_generation = self.generation
            return
        if capturing:
            raise RuntimeError(
                f"fp4fuse: the symmetric workspace of group {self.group_name!r} holds {self.capacity} bytes "
                f"but this call needs {nbytes}; it cannot grow during CUDA-graph capture. Call "
                f"fp4fuse.reserve_workspace({self.group_name!r}, max_rows=..., k=..., n=...) "
                "with the largest shapes before capturing.")
        new_capacity = grown_capacity(self.capacity, nbytes)
        symm = _symm_mem_class()
        if self._buffer is not None:
            # Peers may still read the old buffer until this rank's last DONE barrier has run;
            # waiting for the device covers it (the barrier needs every peer's reads finished).
            torch.cuda.synchronize(self.device)
            self._views.clear()
            if self._captured_generation == self.generation:
                self.retired.append((self._buffer, self._handle))
                logger.info("fp4fuse: symmetric workspace of group %r on %s: generation %d (%d bytes) stays "
                            "mapped for the CUDA graphs captured with it", self.group_name, self.device,
                            self.generation, self.capacity)
            self._handle = None
            self._buffer = None
        from torch.distributed._symmetric_memory import rendezvous

        def allocate_and_map() -> tuple[torch.Tensor, object]:
            buffer = symm.empty_strided_p2p((new_capacity,), (1,), torch.uint8, self.device, self.group_name)
            return buffer, rendezvous(buffer, self.group_name)

        buffer, handle = outside_cuda_graph_pools(allocate_and_map, self.device)
        if handle.world_size != self.world_size or handle.rank != self.rank:
            raise RuntimeError(
                f"fp4fuse: symmetric memory of group {self.group_name!r} reports rank {handle.rank} of "
                f"{handle.world_size}, the process group says {self.rank} of {self.world_size}")
        self._buffer, self._handle = buffer, handle
        self.capacity = new_capacity
        self.generation += 1
        logger.info("fp4fuse: symmetric workspace of group %r on %s: %d bytes (generation %d)",
                    self.group_name, self.device, new_capacity, self.generation)

    # -- views ----------------------------------------------------------------------------------
    def view(self, rank: int, region: Region) -> torch.Tensor:
        """``region`` of ``rank``'s buffer as a tensor on this device (peer memory is mapped).

        Cached until the buffer grows; a view never outlives its buffer generation."""
        return self._cached_view((rank, region), region,
                                 lambda: self._handle.get_buffer(rank, (region.nbytes,), torch.uint8, region.offset))

    def local_tensor(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The start of this rank's own buffer as a contiguous ``dtype`` tensor of ``shape``: a view
        of the symmetric allocation itself, so ``torch.ops.symm_mem`` ops find its peer mappings
        (a peer view from :meth:`view` is not one). Cached until the buffer grows."""
        region = Region(0, tuple(shape), dtype)
        return self._cached_view((-1, region), region, lambda: self._buffer[:region.nbytes])

    def _cached_view(self, key: tuple[int, Region], region: Region,
                     raw_bytes: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``raw_bytes()`` (``region.nbytes`` uint8) as ``region``'s dtype and shape, cached under
        ``key`` until the buffer grows."""
        t = self._views.get(key)
        if t is None:
            if region.end > self.capacity:
                raise RuntimeError(f"fp4fuse: region {region} exceeds the workspace ({self.capacity} bytes)")
            t = raw_bytes().view(region.dtype).view(region.shape)
            self._views[key] = t
        return t

    @contextlib.contextmanager
    def on_side_stream(self) -> Iterator[None]:
        """Enqueue the block's launches on the side stream, after everything the current stream holds
        so far, and make the current stream wait for them: the buffer's users run one after another
        on one stream whichever stream each calls from, as NCCL runs a communicator's collectives on
        its own stream (two callers on two streams would otherwise race on the buffer). Allocate
        outside the block: an allocation inside it belongs to the side stream.

        An eager decode step enters this once per all-reduce, so the streams are switched with the
        C calls ``torch.cuda.stream`` makes (not through it: its Python context costs several times
        the launches it wraps); where the current device is not the workspace's, through it."""
        index = self.device.index
        caller = self._current_stream(index)
        side = self.side_stream
        self.start_event.record(caller)
        side.wait_event(self.start_event)
        if torch._C._cuda_getDevice() != index:
            with torch.cuda.stream(side):  # switches the current device too, and restores both
                yield
        else:
            torch._C._cuda_setStream(stream_id=side.stream_id, device_index=index, device_type=side.device_type)
            try:
                yield
            finally:
                torch._C._cuda_setStream(stream_id=caller.stream_id, device_index=index,
                                         device_type=caller.device_type)
        self.done_event.record(side)
        caller.wait_event(self.done_event)

    def _current_stream(self, index: int) -> torch.cuda.Stream:
        """The current stream of device ``index`` as a ``torch.cuda.Stream`` (one object per stream,
        kept: building one per call costs more than the switch)."""
        key = torch._C._cuda_getCurrentStream(index)  # (stream id, device index, device type)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return stream

    # -- signals (enqueued on the current stream) -----------------------------------------------
    def barrier(self, channel: Channel) -> None:
        self._handle.barrier(int(channel), timeout_ms())

    def put_signal(self, dst_rank: int, channel: Channel) -> None:
        self._handle.put_signal(dst_rank, int(channel), timeout_ms())

    def wait_signal(self, src_rank: int, channel: Channel) -> None:
        self._handle.wait_signal(src_rank, int(channel), timeout_ms())


@dataclasses.dataclass(frozen=True)
class _Unavailable:
    reason: str


# Registry: (group_name, device index) -> (the process group the name resolved to, its workspace or
# the reason symmetric memory cannot serve it). An entry is replaced when the name resolves to
# another group (module doc, Lifetime).
_REGISTRY: dict[tuple[str, int], tuple[dist.ProcessGroup, SymmWorkspace | _Unavailable]] = {}
# Replaced workspaces stay referenced: a CUDA graph captured before the re-initialization holds their
# buffers' addresses.
_REPLACED: list[SymmWorkspace | _Unavailable] = []


def _agree_on_capability(group_name: str, device: torch.device) -> str | None:
    """Collective: every rank reports whether it can use symmetric memory and its host; returns
    why the group cannot (``None`` if it can). The same answer on every rank."""
    group = resolve_group(group_name)
    local = local_unavailability(device)
    mine = torch.tensor([0 if local is None else 1, _host_id()], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    gathered = torch.empty((world, 2), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    rows = gathered.tolist()
    bad = [r for r, (flag, _) in enumerate(rows) if flag]
    if bad:
        return local or f"rank(s) {bad} of the group cannot use CUDA symmetric memory"
    if len({host for _, host in rows}) != 1:
        return "the group spans several hosts; fp4fuse's symmetric-memory pipelines need one host (P2P)"
    return None


def get_workspace(group_name: str, device: torch.device) -> SymmWorkspace:
    """The workspace of ``group_name`` on ``device``, created on first use (collective).

    Raises :class:`WorkspaceUnavailable` (the same on every rank) if symmetric memory cannot
    serve the group; the answer is cached."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (group_name, index)
    group = resolve_group(group_name)
    built_for, entry = _REGISTRY.get(key, (None, None))
    if entry is not None and built_for is not group:
        logger.info("fp4fuse: group name %r now names another process group (re-initialized); "
                    "its symmetric workspace is built anew", group_name)
        _REPLACED.append(entry)
        entry = None
    if entry is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"fp4fuse: no symmetric workspace for group {group_name!r} yet, and none can be created "
                "during CUDA-graph capture; call fp4fuse.reserve_workspace(...) (or run the "
                "model once) before capturing.")
        device = torch.device("cuda", index)
        reason = _agree_on_capability(group_name, device)
        if reason is not None:
            entry = _Unavailable(reason)
        else:
            entry = SymmWorkspace(group_name, device, dist.get_rank(group), dist.get_world_size(group))
        _REGISTRY[key] = (group, entry)
    if isinstance(entry, _Unavailable):
        raise WorkspaceUnavailable(entry.reason)
    return entry


def reserve_workspace(
    group_name: str, max_rows: int, k: int, n: int, out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | None = None,
) -> int:
    """Size ``group_name``'s workspace for both collective GEMMs up to ``max_rows`` total rows.

    ``max_rows``: largest total M (gathered rows of ``fused_all_gather_fp4_matmul``, input rows of
    ``fused_fp4_matmul_reduce_scatter``); ``k``: unpacked K; ``n``: output columns; ``out_dtype``:
    the GEMM output dtype. Collective: call it on every rank with the same arguments, outside
    CUDA-graph capture. Returns the capacity in bytes. Raises :class:`WorkspaceUnavailable` if
    symmetric memory cannot serve the group.
    """
    device = device or torch.device("cuda", torch.cuda.current_device())
    if k % 16 != 0 or max_rows < 0 or n < 0:
        raise ValueError(f"reserve_workspace: need max_rows >= 0, n >= 0 and k a multiple of 16; got "
                         f"max_rows={max_rows}, k={k}, n={n}")
    mine = (max_rows, k, n, out_dtype.itemsize)
    everyone = gather_values(group_name, mine, device)
    if any(v != mine for v in everyone):
        raise ValueError(f"reserve_workspace: the ranks of group {group_name!r} passed different sizes "
                         f"(max_rows, k, n, out_dtype bytes) = {everyone}; every rank must pass the same")
    ws = get_workspace(group_name, device)
    world = ws.world_size
    shard_rows = -(-max_rows // world)
    need = max(all_gather_layout(shard_rows, k // 2, k // 16).nbytes,
               reduce_scatter_layout(world, shard_rows, n, out_dtype).nbytes)
    ws.ensure_capacity(need)
    return ws.capacity
