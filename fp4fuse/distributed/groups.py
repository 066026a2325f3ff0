"""Process groups as the ops see them (by name), functional collectives along dim 0, and
cross-rank agreement.

* :func:`resolve_group`, :func:`group_size_of`, :func:`group_rank_of`: the process group
  registered under a name (what functional collectives take).
* :func:`all_gather_rows`, :func:`reduce_scatter_rows_fp32`: dim-0 collectives through
  ``_c10d_functional`` (so compiled graphs hold them); float8 travels as uint8 (gloo has no float8
  collectives).
* Agreement: before a collective op issues its collectives, the group all-gathers the call
  signature (op, every tensor's shape / dtype / contiguity, ``out_dtype``) and every rank raises
  the same clear ``ValueError`` if they differ, instead of hanging in (or corrupting) a collective.
  Mode ``FP4FUSE_COLLECTIVE_CHECK``: ``always`` checks every call (one tiny all-gather plus a host
  sync: the default off CUDA), ``first`` checks the first call with each signature (the default on
  CUDA, where a per-call host sync would cost more than the GEMM at small sizes), ``off`` never.
"""
from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from fp4fuse.config import env_choice

__all__ = [
    "SignatureCheck", "all_gather_rows", "call_signature", "check_ranks_agree", "check_rows_divisible",
    "describe_signature", "gather_values", "group_rank_of", "group_size_of", "reduce_scatter_rows_fp32",
    "resolve_group", "signature_check_mode",
]

_funcol = torch.ops._c10d_functional

ENV_CHECK = "FP4FUSE_COLLECTIVE_CHECK"


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (the name functional collectives take).

    fp4fuse's one use of torch's private ``_resolve_process_group``; raises if the name is unknown
    in this process."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name)


def group_size_of(group_name: str) -> int:
    """World size of the process group registered under ``group_name``."""
    return dist.get_world_size(resolve_group(group_name))


def group_rank_of(group_name: str) -> int:
    """This process's rank in the process group registered under ``group_name``."""
    return dist.get_rank(resolve_group(group_name))


def check_rows_divisible(op: str, name: str, rows: int, world: int) -> None:
    """``ValueError`` naming ``op`` and the argument unless ``rows`` divides over ``world`` ranks."""
    if rows % world != 0:
        raise ValueError(f"fp4fuse.{op}: {name} has {rows} rows, which must be divisible by the group size {world}")


def all_gather_rows(t: torch.Tensor, group_name: str, group_size: int | None = None) -> torch.Tensor:
    """All-gather ``t`` along dim 0 over ``group_name`` (``group_size`` ranks, looked up if None)
    through functional collectives; float8 travels as a uint8 view."""
    world = group_size_of(group_name) if group_size is None else group_size
    is_fp8 = t.dtype == torch.float8_e4m3fn
    payload = t.view(torch.uint8) if is_fp8 else t
    out = _funcol.wait_tensor(_funcol.all_gather_into_tensor(payload.contiguous(), world, group_name))
    return out.view(torch.float8_e4m3fn) if is_fp8 else out


def reduce_scatter_rows_fp32(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum ``partial`` over the group in fp32 and return this rank's dim-0 chunk in its dtype."""
    world = group_size_of(group_name)
    summed = _funcol.wait_tensor(
        _funcol.reduce_scatter_tensor(partial.float().contiguous(), "sum", world, group_name))
    return summed.to(partial.dtype)


class SignatureCheck(enum.Enum):
    OFF = "off"
    FIRST = "first"
    ALWAYS = "always"


def signature_check_mode(device_type: str = "cuda") -> SignatureCheck:
    """``FP4FUSE_COLLECTIVE_CHECK`` if set; else ``first`` on CUDA, ``always`` elsewhere (gloo)."""
    default = SignatureCheck.FIRST if device_type == "cuda" else SignatureCheck.ALWAYS
    return env_choice(ENV_CHECK, SignatureCheck, default)


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


def call_signature(op_code: int, tensors: tuple[torch.Tensor, ...], out_dtype: torch.dtype) -> tuple[int, ...]:
    """What every rank must agree on: the op, each tensor's ndim/sizes/dtype/contiguity, out_dtype.

    Built only from metadata, so it is defined even for inputs that local validation would reject
    (ranks agree first, then validate identically)."""
    fields: list[int] = [int(op_code), len(tensors)]
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


# (group, op code, out_dtype, (shape, dtype, contiguous) per tensor) of calls every rank agreed on.
_agreed: set[tuple] = set()


def gather_values(group_name: str, values: tuple[int, ...], device: torch.device) -> list[tuple[int, ...]]:
    """Collective: every rank's ``values`` (same length everywhere), indexed by rank."""
    world = group_size_of(group_name)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = _funcol.wait_tensor(_funcol.all_gather_into_tensor(mine, world, group_name))
    return [tuple(r) for r in gathered.view(world, len(values)).tolist()]


def check_ranks_agree(
    op: str, group_name: str, op_code: int, named: dict[str, torch.Tensor], out_dtype: torch.dtype,
) -> None:
    """Raise ``ValueError`` on every rank if the ranks of ``group_name`` called ``op`` with different
    shapes / dtypes (see the module doc for when this runs). Collective when it runs."""
    tensors = tuple(named.values())
    device = tensors[0].device
    mode = signature_check_mode(device.type)
    if mode is SignatureCheck.OFF:
        return
    key = (group_name, op_code, out_dtype, *((t.shape, t.dtype, t.is_contiguous()) for t in tensors))
    if mode is SignatureCheck.FIRST and key in _agreed:
        return
    sig = call_signature(op_code, tensors, out_dtype)
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
