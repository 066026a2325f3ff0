"""Run-time proof that tensors hold the same bytes on every rank of a process group.

The sequence-parallel rewrites (fp4fuse.patterns) move work from a gathered, replicated tensor to
each rank's shard. That is only equal to the unrewritten graph when the values the shards are
computed with -- norm weights, static global scales, residuals -- are the same on every rank. For
model state (parameters, buffers) that holds by construction; this module verifies it where the
compiled graph runs:

    check_same_on_every_rank(model_state, per_call, names, group_name, check_id)
        -> returns, or raises RankMismatchError on every rank of the group, naming each tensor
           some rank holds differently

What is compared: a fingerprint of each tensor's bytes (:func:`fingerprint`): its byte count, then
one int64 per 64 KiB chunk, ``sum(byte[i] * w[i])`` with fixed odd weights ``w`` in
``[2**20, 2**21)``. Integer sums are exact and independent of reduction order, so equal bytes
give equal fingerprints on every device and backend, and no chunk sum can overflow (< 2**45). A
single differing byte always changes its chunk's sum (``delta * w != 0``); two or more escape
only if their weighted differences cancel exactly (about ``2**-19`` for a pair of bytes with
opposite differences, far less for the thousands of bytes a wrong checkpoint changes). The ranks
all-gather the byte counts, then the fingerprints (two small all-gathers, two host syncs), and
every rank compares every rank's against rank 0's, so all raise the same error together.

When. Model state (parameters, buffers) is verified on the first call with each ``check_id`` and
again whenever ``model_state[0]`` is another object than the one last verified under that id
(another model instance compiled to the same graph); values changed in place later
(``load_state_dict`` into the same tensors) are not re-verified. Per-call inputs (passed only in
``RankCheck.ALWAYS`` mode, fp4fuse.config) are verified on every call. Both decisions depend only
on what every rank is called with, so the ranks never disagree on whether to run the collectives.
During CUDA-graph capture nothing runs (a host sync cannot be captured): CUDA-graph trees run each
graph eagerly before capturing it, and that call verifies; replays run no host code, so per-call
inputs are not verified on replay.

Cost of a call that verifies nothing: a dict lookup and one identity comparison, plus the
dispatcher's handling of the op's tensor lists (fp4fuse.ops.rank_check).
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fp4fuse.distributed.groups import resolve_group

__all__ = ["RankMismatchError", "check_same_on_every_rank", "fingerprint", "verify_same_on_every_rank"]

_funcol = torch.ops._c10d_functional

CHUNK_BYTES = 1 << 16
_SLAB_CHUNKS = 64          # chunks hashed per kernel: 4 MiB of bytes, a 32 MiB int64 temporary
_MAX_BYTES = 1 << 34       # keeps the byte count and every sum far from int64 overflow


class RankMismatchError(RuntimeError):
    """Tensors a compiled graph relies on being the same on every rank of its group differ."""


@functools.cache
def _weights() -> torch.Tensor:
    """int64 ``[CHUNK_BYTES]``, odd values in ``[2**20, 2**21)``: the same on every rank (fixed seed).
    Cached on the CPU only: a device copy cached for the process would be allocated inside the
    CUDA-graph pool when the first check runs in a CUDA-graph tree's warm-up, which the tree
    rejects (a live allocation it does not track)."""
    gen = torch.Generator().manual_seed(0x5EED_F4F5)
    return torch.randint(1 << 19, 1 << 20, (CHUNK_BYTES,), generator=gen, dtype=torch.int64) * 2 + 1


def fingerprint(t: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[1 + ceil(nbytes / CHUNK_BYTES)]`` on ``t``'s device: the byte count, then per chunk
    ``sum(byte[i] * w[i])`` (module docstring). Equal bytes, equal fingerprints, on any backend.
    ``weights``: ``w`` already on ``t``'s device (a caller fingerprinting many tensors copies it once)."""
    data = t.detach().reshape(-1).contiguous().view(torch.uint8)
    n = data.numel()
    if n >= _MAX_BYTES:
        raise ValueError(f"fp4fuse rank check: a tensor of {n} bytes is too large to fingerprint (limit {_MAX_BYTES})")
    w = weights if weights is not None else _weights().to(data.device)
    full, rest = divmod(n, CHUNK_BYTES)
    parts = [torch.tensor([n], dtype=torch.int64, device=data.device)]
    for first in range(0, full, _SLAB_CHUNKS):
        last = min(full, first + _SLAB_CHUNKS)
        slab = data[first * CHUNK_BYTES:last * CHUNK_BYTES].view(last - first, CHUNK_BYTES)
        parts.append((slab.to(torch.int64) * w).sum(dim=1))
    if rest or n == 0:
        parts.append((data[full * CHUNK_BYTES:].to(torch.int64) * w[:rest]).sum().reshape(1))
    return torch.cat(parts)


def _all_gather_rows(values: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Every rank's ``values`` (same length everywhere) as ``[world, len]`` on the host."""
    gathered = _funcol.wait_tensor(_funcol.all_gather_into_tensor(values.contiguous(), world, group_name))
    return gathered.view(world, -1).cpu()


def _collective_device(group_name: str, tensors: Sequence[torch.Tensor]) -> torch.device:
    """Where the group's collectives run: the first CUDA tensor's device, else the CPU (gloo)."""
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


def verify_same_on_every_rank(tensors: Sequence[torch.Tensor], names: Sequence[str], group_name: str) -> None:
    """Raise :class:`RankMismatchError` on every rank of ``group_name`` if some rank holds any of
    ``tensors`` (named by ``names``) differently from rank 0. Collective: every rank of the group
    must call it with its own tensors of the same names."""
    if len(tensors) != len(names):
        raise ValueError(f"fp4fuse rank check: {len(tensors)} tensors but {len(names)} names")
    world = dist.get_world_size(resolve_group(group_name))
    device = _collective_device(group_name, tensors)
    weights = {where: _weights().to(where) for where in {t.device for t in tensors}}
    prints = [fingerprint(t, weights[t.device]).to(device) for t in tensors]
    lengths = torch.tensor([p.numel() for p in prints], dtype=torch.int64, device=device)
    all_lengths = _all_gather_rows(lengths, group_name, world)
    if not bool((all_lengths == all_lengths[0]).all()):
        bad = [name for i, name in enumerate(names) if bool((all_lengths[:, i] != all_lengths[0, i]).any())]
        _raise(group_name, [(name, "has a different number of bytes on some ranks") for name in bad])
    rows = _all_gather_rows(torch.cat(prints), group_name, world)
    problems = []
    start = 0
    for name, p in zip(names, prints):
        segment = rows[:, start:start + p.numel()]
        start += p.numel()
        differ = [r for r in range(1, world) if not torch.equal(segment[r], segment[0])]
        if differ:
            problems.append((name, f"differs from rank 0's on rank{'s' if len(differ) > 1 else ''} "
                                   f"{', '.join(map(str, differ))}"))
    if problems:
        _raise(group_name, problems)


def _raise(group_name: str, problems: list[tuple[str, str]]) -> None:
    listing = "\n".join(f"  {name}: {what}" for name, what in problems)
    raise RankMismatchError(
        f"fp4fuse: this compiled graph was rewritten for sequence parallelism on the promise that these "
        f"tensors are the same on every rank of process group {group_name!r}, and they are not:\n{listing}\n"
        "Load the same values on every rank (they are model state: norm weights, activation global "
        "scales). Compiling without fp4fuse's sequence parallelism also works; turning the check off "
        "(FusionConfig(rank_check='off'), FP4FUSE_RANK_CHECK=off) would let the rewritten graph compute "
        "something else than the original.")


# check_id -> the first model-state tensor verified under it (identity only; module docstring)
_verified: dict[str, weakref.ref[torch.Tensor]] = {}


def check_same_on_every_rank(model_state: Sequence[torch.Tensor], per_call: Sequence[torch.Tensor],
                             names: Sequence[str], group_name: str, check_id: str) -> None:
    """:func:`verify_same_on_every_rank` of ``model_state`` on the first call with ``check_id``
    (and whenever ``model_state[0]`` is another object), and of ``per_call`` on every call.
    ``names`` names ``model_state`` then ``per_call``. Collective whenever it verifies."""
    if len(names) != len(model_state) + len(per_call):
        raise ValueError(f"fp4fuse rank check: {len(model_state) + len(per_call)} tensors but {len(names)} names")
    last = _verified.get(check_id)
    state_done = not model_state or (last is not None and last() is model_state[0])
    if state_done and not per_call:
        return
    if any(t.is_cuda for t in (*model_state, *per_call)) and torch.cuda.is_current_stream_capturing():
        return
    tensors = list(per_call) if state_done else [*model_state, *per_call]
    verify_same_on_every_rank(tensors, names[len(names) - len(tensors):], group_name)
    if model_state:
        _verified[check_id] = weakref.ref(model_state[0])
