"""When the collective GEMMs overlap, and how.

* Size threshold: below :func:`overlap_min_rows` total rows (gathered rows of the all-gather GEMM,
  input rows of the GEMM + reduce-scatter) the ops run the functional-collective path, where the
  overlapped pipeline's fixed cost (more launches, handoffs, host issue time) does not pay. The
  defaults are the crossovers measured with ``benchmarks/bench_collective_gemm.py`` on 2x and 4x
  H200 in eager mode (the host issuing every launch; the stricter case): all-gather
  ``DEFAULT_ALL_GATHER_MIN_ROWS`` total rows, reduce-scatter
  ``DEFAULT_REDUCE_SCATTER_MIN_ROWS_PER_RANK`` rows per rank. With the host ahead of the GPU (CUDA
  graphs) both sides pay from far fewer rows; the measurements are in
  ``benchmarks/results/2026-11-21-collective-gemm-{2,4}xh200-final.md``.
  ``FP4FUSE_OVERLAP_MIN_ROWS`` sets both sides; ``FP4FUSE_DISABLE_OVERLAP=1`` turns the overlapped
  path off. Both must be the same on every rank (the decision must be the same everywhere).
* All-gather schedule (:func:`all_gather_schedule`): ``decode-gather`` (the gather hidden under
  the GEMM's bf16 decode prologue, then one GEMM over all rows, bitwise equal to unfused) up to
  ``DECODE_GATHER_MAX_PEER_ELEMENTS`` gathered peer elements, else ``per-shard`` (one GEMM per
  shard, later shards pulled during earlier GEMMs). ``FP4FUSE_AG_SCHEDULE`` overrides it.
* Why-not-overlapped is logged once per (group, reason) at INFO.
"""
from __future__ import annotations

import enum
import logging

from fp4fuse.config import env_bool, env_choice, env_int

__all__ = [
    "AllGatherSchedule", "CollectiveGemmKind", "DECODE_GATHER_MAX_PEER_ELEMENTS", "DEFAULT_ALL_GATHER_MIN_ROWS",
    "DEFAULT_REDUCE_SCATTER_MIN_ROWS_PER_RANK", "NoOverlapReason", "all_gather_schedule", "default_min_rows",
    "log_no_overlap_once", "overlap_disabled", "overlap_min_rows",
]

logger = logging.getLogger(__name__)

ENV_MIN_ROWS = "FP4FUSE_OVERLAP_MIN_ROWS"
ENV_DISABLE = "FP4FUSE_DISABLE_OVERLAP"
ENV_AG_SCHEDULE = "FP4FUSE_AG_SCHEDULE"

#: Defaults below which the functional-collective path runs instead of the overlapped one: total
#: gathered rows (all-gather side), rows per rank's output chunk (reduce-scatter side).
DEFAULT_ALL_GATHER_MIN_ROWS = 32768
DEFAULT_REDUCE_SCATTER_MIN_ROWS_PER_RANK = 2048

#: Largest gather (peer elements, ``(W - 1) * shard_rows * K``) the decode-gather schedule takes;
#: above it the peers' decode over NVLink outlasts the decode prologue and per-shard wins
#: (the measured tie point, benchmarks/results/2026-11-21-collective-gemm-2xh200-final.md).
DECODE_GATHER_MAX_PEER_ELEMENTS = 1 << 24


class CollectiveGemmKind(enum.IntEnum):
    """The collective GEMM ops (also their code in the cross-rank call signature)."""
    ALL_GATHER_MATMUL = 1
    ALL_GATHER_MATMUL_GATHERED = 2
    MATMUL_REDUCE_SCATTER = 3


class AllGatherSchedule(enum.Enum):
    """How the all-gather pipeline overlaps the gather with the GEMM (``pipelines`` module doc)."""
    DECODE_GATHER = "decode-gather"
    PER_SHARD = "per-shard"


class _ScheduleChoice(enum.Enum):
    AUTO = "auto"
    DECODE_GATHER = "decode-gather"
    PER_SHARD = "per-shard"


class NoOverlapReason(enum.Enum):
    """Why a call ran the functional-collective path."""
    NOT_CUDA = "inputs are not on a CUDA device"
    SINGLE_RANK = "the group has one rank"
    DISABLED = f"{ENV_DISABLE}=1"
    BELOW_THRESHOLD = "fewer rows than the overlap threshold"
    EMPTY = "empty operands (no rows, or an empty weight)"
    SYMM_MEM_UNAVAILABLE = "symmetric memory cannot serve the group"


def default_min_rows(kind: CollectiveGemmKind, world: int) -> int:
    """Default total-row threshold of ``kind`` for a group of ``world`` ranks."""
    if kind is CollectiveGemmKind.MATMUL_REDUCE_SCATTER:
        return DEFAULT_REDUCE_SCATTER_MIN_ROWS_PER_RANK * world
    return DEFAULT_ALL_GATHER_MIN_ROWS


def overlap_min_rows(kind: CollectiveGemmKind, world: int) -> int:
    """Total-row threshold for the overlapped path of ``kind`` in a group of ``world`` ranks
    (``FP4FUSE_OVERLAP_MIN_ROWS``, which sets every kind, or the kind's default)."""
    return env_int(ENV_MIN_ROWS, default_min_rows(kind, world))


def all_gather_schedule(world: int, shard_rows: int, n: int, k: int) -> AllGatherSchedule:
    """The schedule of an all-gather GEMM of ``world`` shards of ``shard_rows`` rows against an
    ``[n, k]`` weight: ``FP4FUSE_AG_SCHEDULE`` if set, else decode-gather up to
    ``DECODE_GATHER_MAX_PEER_ELEMENTS`` gathered peer elements. A pure function of agreed shapes and
    the environment, so every rank picks the same."""
    choice = env_choice(ENV_AG_SCHEDULE, _ScheduleChoice, _ScheduleChoice.AUTO)
    if choice is not _ScheduleChoice.AUTO:
        return AllGatherSchedule(choice.value)
    del n  # the measured rule does not depend on N (N only lengthens the prologue, in decode-gather's favour)
    if (world - 1) * shard_rows * k <= DECODE_GATHER_MAX_PEER_ELEMENTS:
        return AllGatherSchedule.DECODE_GATHER
    return AllGatherSchedule.PER_SHARD


def overlap_disabled() -> bool:
    return env_bool(ENV_DISABLE, False)


_logged: set[tuple[str, NoOverlapReason]] = set()


def log_no_overlap_once(op: str, group_name: str, reason: NoOverlapReason, detail: str = "") -> None:
    """INFO once per (group, reason): the call ran without overlap, and why."""
    key = (group_name, reason)
    if key in _logged:
        return
    _logged.add(key)
    logger.info("fp4fuse.%s: group %r runs the functional-collective path (no overlap): %s%s "
                "(logged once per group and reason)", op, group_name, reason.value,
                f" ({detail})" if detail else "")
