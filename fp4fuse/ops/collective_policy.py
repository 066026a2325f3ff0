"""When the collective GEMMs overlap, and the cross-rank agreement checks that keep them from hanging.

* Size threshold: below :func:`overlap_min_rows` total rows (gathered rows of the all-gather GEMM,
  input rows of the GEMM + reduce-scatter) the ops run the functional-collective path, where the
  overlapped pipeline's fixed cost (more launches, handoffs, host issue time) does not pay. The
  defaults come from ``benchmarks/bench_collective_gemm.py`` on 2x and 4x H200 (NV18), torch 2.11,
  Triton 3.6 (``benchmarks/results/2026-11-21-collective-gemm-{2,4}xh200-final.md``). With the host
  ahead of the GPU (CUDA graphs, or a model whose GPU runs behind its host) the all-gather side is
  at least as fast as unfused from 512 rows and the reduce-scatter side from 512 (2 ranks) / 2048
  (4 ranks). With an idle GPU waiting on eager host launches -- what a ``torch.compile`` graph
  without CUDA graphs does; the fused ops issue ~0.1-0.5 ms more host work -- the all-gather side
  breaks even only from 32768 rows and the reduce-scatter side from 2048 rows per rank (4096 at 2
  ranks, 8192 at 4). The defaults are these eager-safe crossovers (all-gather 32768 total rows,
  reduce-scatter 2048 rows per rank), so the fused ops are not measurably slower than unfused in
  either mode; under CUDA graphs ``FP4FUSE_OVERLAP_MIN_ROWS=2048`` overlaps both sides from 2048
  total rows (all-gather 1.03-1.33x, reduce-scatter 1.1-1.9x on the measured grid).
  ``FP4FUSE_OVERLAP_MIN_ROWS`` sets both sides; ``FP4FUSE_DISABLE_OVERLAP=1`` turns the overlapped
  path off. Both must be the same on every rank (the decision must be the same everywhere).
* All-gather schedule (:func:`all_gather_schedule`): ``decode-gather`` (the gather hidden under
  the GEMM's bf16 decode prologue, then one GEMM over all rows, bitwise equal to unfused) up to
  ``DECODE_GATHER_MAX_PEER_ELEMENTS`` gathered elements, else ``per-shard`` (one GEMM per shard, later shards
  pulled during earlier GEMMs). ``FP4FUSE_AG_SCHEDULE=decode-gather|per-shard|auto`` overrides it.
* Agreement: the group all-gathers the call signature (op, every tensor's shape / dtype /
  contiguity, ``out_dtype``) and every rank raises the same clear ``ValueError`` if they differ,
  instead of hanging in (or corrupting) a collective. Mode ``FP4FUSE_COLLECTIVE_CHECK``:
  ``always`` checks every call (one tiny all-gather plus a host sync: the default off CUDA, where
  the functional path is not latency-bound), ``first`` checks the first call with each signature
  (the default on CUDA, where a per-call host sync would cost more than the GEMM at small sizes),
  ``off`` never. Limit of ``first``: a rank repeating a signature it already agreed on skips the
  check, so a mismatch pairing a known signature with another one is not caught (the
  symmetric-memory path still cannot hang forever: its device-side waits time out, see
  ``fp4fuse.ops.workspace``; NCCL's own watchdog covers the functional path).
* Why-not-overlapped is logged once per (group, reason) at INFO.
"""
from __future__ import annotations

import enum
import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV_MIN_ROWS = "FP4FUSE_OVERLAP_MIN_ROWS"
ENV_DISABLE = "FP4FUSE_DISABLE_OVERLAP"
ENV_CHECK = "FP4FUSE_COLLECTIVE_CHECK"
ENV_AG_SCHEDULE = "FP4FUSE_AG_SCHEDULE"

#: Defaults below which the functional-collective path runs instead of the overlapped one: total
#: gathered rows (all-gather side), rows per rank's output chunk (reduce-scatter side). Measured
#: eager crossovers on 2x / 4x H200 (NV18), torch 2.11, Triton 3.6: see the module doc.
DEFAULT_ALL_GATHER_MIN_ROWS = 32768
DEFAULT_REDUCE_SCATTER_MIN_ROWS_PER_RANK = 2048

_funcol = torch.ops._c10d_functional


class CollectiveKind(enum.IntEnum):
    ALL_GATHER_MATMUL = 1
    ALL_GATHER_MATMUL_GATHERED = 2
    MATMUL_REDUCE_SCATTER = 3


class SignatureCheck(enum.Enum):
    OFF = "off"
    FIRST = "first"
    ALWAYS = "always"


class NoOverlapReason(enum.Enum):
    """Why a call ran the functional-collective path."""
    NOT_CUDA = "inputs are not on a CUDA device"
    SINGLE_RANK = "the group has one rank"
    DISABLED = f"{ENV_DISABLE}=1"
    BELOW_THRESHOLD = "fewer rows than the overlap threshold"
    EMPTY = "no rows"
    SYMM_MEM_UNAVAILABLE = "symmetric memory cannot serve the group"


def default_min_rows(kind: CollectiveKind, world: int) -> int:
    """Default total-row threshold of ``kind`` for a group of ``world`` ranks."""
    if kind is CollectiveKind.MATMUL_REDUCE_SCATTER:
        return DEFAULT_REDUCE_SCATTER_MIN_ROWS_PER_RANK * world
    return DEFAULT_ALL_GATHER_MIN_ROWS


def overlap_min_rows(kind: CollectiveKind, world: int) -> int:
    """Total-row threshold for the overlapped path of ``kind`` in a group of ``world`` ranks
    (``FP4FUSE_OVERLAP_MIN_ROWS``, which sets every kind, or the kind's default)."""
    value = os.environ.get(ENV_MIN_ROWS)
    if value is None or value == "":
        return default_min_rows(kind, world)
    try:
        rows = int(value)
    except ValueError:
        raise ValueError(f"{ENV_MIN_ROWS}={value!r}: must be a non-negative integer") from None
    if rows < 0:
        raise ValueError(f"{ENV_MIN_ROWS}={value!r}: must be a non-negative integer")
    return rows


#: Largest gather (peer elements, ``(W - 1) * shard_rows * K``) the decode-gather schedule takes;
#: above it per-shard. Measured on 2xH200 (NV18), torch 2.11 (round-robin device-bound timing,
#: benchmarks/results/2026-11-21-collective-gemm-2xh200-final.md): at 2**24 peer elements (two ranks,
#: M=8192 with K=4096) the two tie within 1%; above it
#: the peers' decode (~340 GB/s over NVLink) outlasts the decode prologue and per-shard is 0-6%
#: faster; below it decode-gather is up to 16% faster at 2 ranks, 38% at 4 (one GEMM, one handoff).
DECODE_GATHER_MAX_PEER_ELEMENTS = 1 << 24


def all_gather_schedule(world: int, shard_rows: int, n: int, k: int):
    """The :class:`~fp4fuse.ops.symm_mem_gemm.AllGatherSchedule` for an all-gather GEMM of ``world``
    shards of ``shard_rows`` rows against an ``[n, k]`` weight: ``FP4FUSE_AG_SCHEDULE`` if set, else
    decode-gather up to ``DECODE_GATHER_MAX_PEER_ELEMENTS`` gathered peer elements. A pure function
    of agreed shapes and the environment, so every rank picks the same."""
    from fp4fuse.ops.symm_mem_gemm import AllGatherSchedule
    value = os.environ.get(ENV_AG_SCHEDULE, "auto").lower()
    if value != "auto":
        try:
            return AllGatherSchedule(value)
        except ValueError:
            choices = ["auto"] + [s.value for s in AllGatherSchedule]
            raise ValueError(f"{ENV_AG_SCHEDULE}={value!r}: must be one of {choices}") from None
    del n  # the measured rule does not depend on N (N only lengthens the prologue, in decode-gather's favour)
    if (world - 1) * shard_rows * k <= DECODE_GATHER_MAX_PEER_ELEMENTS:
        return AllGatherSchedule.DECODE_GATHER
    return AllGatherSchedule.PER_SHARD


def overlap_disabled() -> bool:
    return os.environ.get(ENV_DISABLE, "0").lower() in ("1", "true", "yes", "on")


def signature_check_mode(device_type: str = "cuda") -> SignatureCheck:
    """``FP4FUSE_COLLECTIVE_CHECK`` if set; else ``first`` on CUDA, ``always`` elsewhere (gloo)."""
    default = SignatureCheck.FIRST if device_type == "cuda" else SignatureCheck.ALWAYS
    value = os.environ.get(ENV_CHECK, default.value).lower()
    try:
        return SignatureCheck(value)
    except ValueError:
        raise ValueError(f"{ENV_CHECK}={value!r}: must be one of {[m.value for m in SignatureCheck]}") from None


_logged: set[tuple[str, NoOverlapReason]] = set()


def log_no_overlap_once(op: str, group_name: str, reason: NoOverlapReason, detail: str = "") -> None:
    """INFO once per (group, reason): the call ran without overlap, and why."""
    key = (group_name, reason)
    if key in _logged:
        logger.debug("fp4fuse.%s: group %r not overlapped: %s %s", op, group_name, reason.value, detail)
        return
    _logged.add(key)
    logger.info("fp4fuse.%s: group %r runs the functional-collective path (no overlap): %s%s "
                "(logged once per group and reason)", op, group_name, reason.value,
                f" ({detail})" if detail else "")


# ----------------------------------------------------------------------------------------------
# Cross-rank agreement on the call signature
# ----------------------------------------------------------------------------------------------
_DTYPE_CODES: dict[torch.dtype, int] = {
    dt: i for i, dt in enumerate((
        torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32, torch.float64,
        torch.int8, torch.int16, torch.int32, torch.int64, torch.float8_e5m2, torch.bool))
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
_MAX_DIMS = 2


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, len(_DTYPE_CODES))


def _tensor_fields(t: torch.Tensor) -> tuple[int, ...]:
    """(ndim, up to two sizes padded with -1, dtype code, contiguous) of one argument."""
    sizes = tuple(t.shape[:_MAX_DIMS]) + (-1,) * (_MAX_DIMS - min(t.dim(), _MAX_DIMS))
    return (t.dim(), *sizes, _dtype_code(t.dtype), int(t.is_contiguous()))


_FIELDS_PER_TENSOR = 3 + _MAX_DIMS  # ndim, sizes, dtype, contiguous


def call_signature(kind: CollectiveKind, tensors: tuple[torch.Tensor, ...], out_dtype: torch.dtype) -> tuple[int, ...]:
    """What every rank must agree on: the op, each tensor's ndim/sizes/dtype/contiguity, out_dtype.

    Built only from metadata, so it is defined even for inputs that local validation would reject
    (ranks agree first, then validate identically)."""
    fields: list[int] = [int(kind), len(tensors)]
    for t in tensors:
        fields.extend(_tensor_fields(t))
    fields.append(_dtype_code(out_dtype))
    return tuple(fields)


def describe_signature(sig: tuple[int, ...], names: tuple[str, ...]) -> str:
    parts = []
    for i, name in enumerate(names):
        ndim, *rest = sig[2 + i * _FIELDS_PER_TENSOR: 2 + (i + 1) * _FIELDS_PER_TENSOR]
        sizes, code, contiguous = rest[:_MAX_DIMS], rest[_MAX_DIMS], rest[_MAX_DIMS + 1]
        shape = [s for s in sizes[:ndim]] + (["..."] if ndim > _MAX_DIMS else [])
        dtype = str(_CODE_DTYPES.get(code, "other")).replace("torch.", "")
        parts.append(f"{name}{shape} {dtype}{'' if contiguous else ' non-contiguous'}")
    out_dtype = str(_CODE_DTYPES.get(sig[-1], "other")).replace("torch.", "")
    return ", ".join(parts) + f", out_dtype={out_dtype}"


# (group, kind, out_dtype, (shape, dtype, contiguous) per tensor) of calls every rank agreed on.
_agreed: set[tuple] = set()


def gather_values(group_name: str, values: tuple[int, ...], device: torch.device) -> list[tuple[int, ...]]:
    """Collective: every rank's ``values`` (same length everywhere), indexed by rank."""
    from fp4fuse.ops.collective_ops import group_size_of
    world = group_size_of(group_name)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = _funcol.wait_tensor(_funcol.all_gather_into_tensor(mine, world, group_name))
    return [tuple(r) for r in gathered.view(world, len(values)).tolist()]


def check_ranks_agree(
    op: str, group_name: str, kind: CollectiveKind, named: dict[str, torch.Tensor], out_dtype: torch.dtype,
) -> None:
    """Raise ``ValueError`` on every rank if the ranks of ``group_name`` called ``op`` with different
    shapes / dtypes (see the module doc for when this runs). Collective when it runs."""
    tensors = tuple(named.values())
    device = tensors[0].device
    mode = signature_check_mode(device.type)
    if mode is SignatureCheck.OFF:
        return
    key = (group_name, kind, out_dtype, *((t.shape, t.dtype, t.is_contiguous()) for t in tensors))
    if mode is SignatureCheck.FIRST and key in _agreed:
        return
    sig = call_signature(kind, tensors, out_dtype)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # a host sync is impossible here; capture replays a call that was checked in warm-up
    rows = gather_values(group_name, sig, device)
    if any(r != sig for r in rows):
        names = tuple(named)
        table = "; ".join(f"rank {i}: {describe_signature(r, names)}" for i, r in enumerate(rows))
        raise ValueError(
            f"fp4fuse.{op}: the ranks of group {group_name!r} called it with different arguments ({table}). "
            "Every rank must pass the same shapes, dtypes and out_dtype.")
    _agreed.add(key)
