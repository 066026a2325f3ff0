"""Amax-reduction groups keyed by integer IDs, and the NVFP4 quantizer value object.

A quantizer with a dynamic global scale must agree with its peers on one amax (an all-reduce MAX of
one fp32 over the tensor-parallel group) or gathered shards carry different global scales. The
group travels on the quantizer as an ``int`` ID, never as a ``ProcessGroup``: a process group on a
quantizer broke pickling and torch.compile in TransformerEngine (docs/design.md, "Amax groups").

Registry (one per process). ``_REGISTRY`` is a module-level ``dict[int, AmaxGroup]``, written only
by :func:`register_amax_group` and read only by :func:`amax_group`. The ID is a pure function of
the group's global ranks (:func:`amax_group_id`), so every rank, and every fresh process that
builds a group over the same ranks, computes the same ID: a pickled quantizer restores after
``fp4fuse.register_amax_group(group)`` has run on every rank of the new process group.

Under ``torch.compile`` the registry lookup is an ``int``-keyed dict read that Dynamo traces and
guards; the resolved group name is baked into the graph as the argument of
``_c10d_functional.all_reduce``. Re-registering an ID with another process group (after the
default group was destroyed and re-created) changes the entry, which fails the guard and
recompiles with the new group name.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from typing import Iterable

import torch
import torch.distributed as dist

from fp4fuse.nvfp4 import format as nvfp4

__all__ = [
    "AmaxGroup",
    "UnknownAmaxGroupError",
    "NVFP4Quantizer",
    "abs_amax",
    "amax_group",
    "amax_group_id",
    "group_amax",
    "quantize_weight",
    "register_amax_group",
]

logger = logging.getLogger(__name__)

_ID_DOMAIN = b"fp4fuse.amax_group.v1:"
_INT63 = (1 << 63) - 1

_REGISTRY: dict[int, AmaxGroup] = {}


class UnknownAmaxGroupError(KeyError):
    """An amax-group ID that was never registered in this process."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass(frozen=True)
class AmaxGroup:
    """A registered amax-reduction group as resolved in this process.

    ``group_id``: the registry key (:func:`amax_group_id` of ``ranks``). ``ranks``: the group's
    global ranks, ascending. ``group_name``: ``group.group_name``, the name functional collectives
    take. ``group``: the live ``ProcessGroup``; it never leaves the registry.
    """

    group_id: int
    ranks: tuple[int, ...]
    group_name: str
    group: dist.ProcessGroup = dataclasses.field(repr=False, compare=False)

    def __reduce__(self):
        raise TypeError(
            f"AmaxGroup {self.group_id} holds a live ProcessGroup and cannot be pickled; "
            "pickle the integer group_id (e.g. on an NVFP4Quantizer) instead")


def amax_group_id(ranks: Iterable[int]) -> int:
    """The amax-group ID of a set of global ranks: an int in ``[1, 2**63 - 1]``.

    Deterministic across processes and Python versions (a truncated SHA-256 of the sorted ranks,
    not ``hash()``); order and duplicates in ``ranks`` do not matter."""
    rank_set = sorted({int(r) for r in ranks})
    if not rank_set:
        raise ValueError("amax_group_id: a group needs at least one rank")
    if rank_set[0] < 0:
        raise ValueError(f"amax_group_id: global ranks must be >= 0, got {rank_set}")
    digest = hashlib.sha256(_ID_DOMAIN + ",".join(map(str, rank_set)).encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big") % _INT63 + 1


def register_amax_group(group: dist.ProcessGroup | None = None) -> int:
    """Register ``group`` (default: the default process group) and return its amax-group ID.

    Call it on every rank of the group after ``torch.distributed.init_process_group``. Idempotent:
    registering the same group again returns the same ID and changes nothing. Registering another
    group over the same ranks (e.g. after the default group was re-created) replaces the entry;
    the most recent registration wins."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fp4fuse.register_amax_group: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first")
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER or group is None:
        raise ValueError(
            f"fp4fuse.register_amax_group: rank {dist.get_rank()} is not a member of this group; "
            "register a group only on its own ranks")
    ranks = tuple(sorted(dist.get_process_group_ranks(group)))
    group_id = amax_group_id(ranks)
    record = AmaxGroup(group_id=group_id, ranks=ranks, group_name=group.group_name, group=group)
    previous = _REGISTRY.get(group_id)
    if previous is not None and previous.group is group:
        return group_id
    if previous is not None:
        logger.info("amax group %d (ranks %s): replacing process group %r with %r",
                    group_id, list(ranks), previous.group_name, record.group_name)
    else:
        logger.debug("amax group %d registered: ranks %s, group %r", group_id, list(ranks),
                     record.group_name)
    _REGISTRY[group_id] = record
    return group_id


def amax_group(group_id: int) -> AmaxGroup:
    """Resolve a registered amax-group ID; :class:`UnknownAmaxGroupError` if it is unknown."""
    record = _REGISTRY.get(group_id)
    if record is None:
        # int(): under torch.compile an ID that varied between calls is traced as a SymInt, which
        # an f-string cannot format; int() specializes it to the concrete value.
        raise UnknownAmaxGroupError(
            f"fp4fuse: amax group {int(group_id)} is not registered in this process; call "
            "fp4fuse.register_amax_group(group) on every rank of the group after "
            "torch.distributed.init_process_group (the same global ranks give the same ID)")
    if not torch.compiler.is_compiling() and _destroyed(record.group):
        # torch numbers group names from a counter: after destroy_process_group and a new
        # init_process_group the recorded name may name other ranks' group.
        raise UnknownAmaxGroupError(
            f"fp4fuse: amax group {int(group_id)} (ranks {list(record.ranks)}) was registered for a "
            f"process group that has since been destroyed, and its name {record.group_name!r} may now "
            "name another group; call fp4fuse.register_amax_group(group) again on every rank after "
            "torch.distributed.init_process_group")
    return record


def _destroyed(group: dist.ProcessGroup) -> bool:
    """``group`` is no longer a process group of this process (``destroy_process_group`` ran)."""
    if not dist.is_initialized():
        return True
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return True
    return False


def abs_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over every element of a non-empty ``x``, as a 0-d tensor in x's dtype (NaN if any
    element is NaN): each row's maximum first (the last dim), then theirs. The same value as one
    reduction over every element (a maximum is exact in any order); compiled, Inductor fuses the
    row maxima into the kernel producing ``x`` (SiLU * up, a transposed attention output) instead
    of reading it through one long split reduction, which end to end took longer
    (benchmarks/bench_amax_forms.py; results in benchmarks/results/)."""
    magnitude = x.abs()
    if magnitude.dim() > 1:
        magnitude = magnitude.amax(dim=-1)
    return magnitude.amax()


def group_amax(x: torch.Tensor, group_id: int | None) -> torch.Tensor:
    """``max |x|`` as fp32 ``[1]`` on x's device, agreed over the registered group ``group_id``
    (an all-reduce MAX through ``_c10d_functional``, so compiled graphs contain it) when not None.

    An empty ``x`` counts as 0 (a rank without tokens still joins the all-reduce); NaN counts as
    +inf, which survives any backend's MAX and which ``global_scale_from_amax`` maps to NaN.
    Collective when ``group_id`` is set: every rank of the group must call it."""
    if x.numel() == 0:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    else:
        amax = abs_amax(x).float().reshape(1)
    amax = torch.where(torch.isnan(amax), torch.full_like(amax, math.inf), amax)
    if group_id is not None:
        group_name = amax_group(group_id).group_name
        amax = torch.ops._c10d_functional.all_reduce(amax, "max", group_name)
        amax = torch.ops._c10d_functional.wait_tensor(amax)
    return amax


def quantize_weight(w: torch.Tensor, amax: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a weight ``w [..., K]`` (K a multiple of 16) once, with the global scale of ``amax``.

    Returns ``(q, s, gs)``: q uint8 ``[..., K/2]``, s float8_e4m3fn ``[..., K/16]`` (linear),
    gs fp32 ``[1]`` = ``448 * 6 / amax`` (encode convention; amax 0 -> 1). ``amax`` None uses
    ``max |w|`` of ``w`` itself; a shard of a larger weight passes the full weight's amax, so every
    shard is quantized exactly as the same rows / 16-aligned columns of the full weight would be.
    The one weight quantizer of fp4fuse: ``NVFP4Tensor.from_hp`` and the TP linears call it."""
    if w.dim() < 1 or w.shape[-1] % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(f"quantize_weight: the last dim of w must be a multiple of {nvfp4.BLOCK_SIZE}, "
                         f"got shape {tuple(w.shape)}")
    if amax is None:
        amax = group_amax(w, None)
    gs = nvfp4.global_scale_from_amax(amax.reshape(1))
    k = w.shape[-1]
    q, s = torch.ops.fp4fuse.scaled_fp4_quant(w.reshape(-1, k).contiguous(), gs)
    lead = tuple(w.shape[:-1])
    return q.reshape(*lead, k // 2), s.reshape(*lead, k // nvfp4.BLOCK_SIZE), gs


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer:
    """How to quantize an activation or weight to NVFP4: a plain, picklable value object.

    ``global_scale``: a static encode-convention global scale (``448 * 6 / amax``, unitless,
    finite and > 0), or None for a dynamic one computed from the tensor's amax at each call.
    ``amax_group``: for a dynamic scale, the ID (:func:`register_amax_group`) of the group whose
    ranks share one amax (all-reduce MAX); None keeps the amax local. Setting both is an error:
    a static scale reads no amax.
    """

    amax_group: int | None = None
    global_scale: float | None = None

    def __post_init__(self) -> None:
        if self.amax_group is not None:
            if isinstance(self.amax_group, bool) or not isinstance(self.amax_group, int):
                raise TypeError(f"NVFP4Quantizer.amax_group must be an int ID from "
                                f"fp4fuse.register_amax_group, got {type(self.amax_group).__name__}")
            if not 1 <= self.amax_group <= _INT63:
                raise ValueError(f"NVFP4Quantizer.amax_group must be in [1, 2**63 - 1], got {self.amax_group}")
        if self.global_scale is not None:
            if isinstance(self.global_scale, bool) or not isinstance(self.global_scale, (int, float)):
                raise TypeError(f"NVFP4Quantizer.global_scale must be a float or None, "
                                f"got {type(self.global_scale).__name__}")
            scale = float(self.global_scale)
            # quantize() uses it as fp32: 1e39 overflows there, 1e-46 flushes to 0
            as_fp32 = float(torch.tensor(scale, dtype=torch.float32)) if math.isfinite(scale) else scale
            if not (math.isfinite(as_fp32) and as_fp32 > 0):
                raise ValueError(f"NVFP4Quantizer.global_scale must be finite and > 0 as fp32 (the dtype quantize "
                                 f"uses), got {scale!r}")
            object.__setattr__(self, "global_scale", scale)
            if self.amax_group is not None:
                raise ValueError("NVFP4Quantizer: a static global_scale reads no amax; set amax_group "
                                 "(dynamic, group-wide amax) or global_scale (static), not both")

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quantize ``x [M, K]`` (bf16/fp16/fp32, K a multiple of 16) to NVFP4.

        Returns ``(q, s, gs)``: q uint8 ``[M, K/2]``, s float8_e4m3fn ``[M, K/16]`` (linear),
        gs the encode-convention global scale as fp32 of shape ``[1]`` on x's device; dequantize
        as ``q * s / gs``. A dynamic gs is ``448 * 6 / amax`` with amax the max of ``|x|`` (over
        every rank of ``amax_group`` when set, through ``_c10d_functional.all_reduce``, so a
        compiled graph holds the collective; an empty x counts as amax 0, and an amax of 0 gives
        gs 1). A NaN in x makes gs NaN on every rank of the group.
        """
        gs = self.global_scale_for(x)
        q, s = torch.ops.fp4fuse.scaled_fp4_quant(x, gs)
        return q, s, gs

    def global_scale_for(self, x: torch.Tensor) -> torch.Tensor:
        """The global scale :meth:`quantize` uses for ``x``: fp32 ``[1]`` on x's device."""
        if self.global_scale is not None:
            return torch.full((1,), self.global_scale, dtype=torch.float32, device=x.device)
        return nvfp4.global_scale_from_amax(group_amax(x, self.amax_group))
