"""Process groups as the ops see them (by name), functional collectives along dim 0, and
cross-rank agreement.

* :func:`resolve_group`, :func:`group_size_of`, :func:`group_rank_of`: the process group
  registered under a name (what functional collectives take).
* :func:`all_gather_rows`, :func:`reduce_scatter_rows_fp32`: dim-0 collectives through
  ``_c10d_functional`` (so compiled graphs hold them); float8 travels as uint8 (gloo has no float8
  collectives).
* Agreement (:func:`check_ranks_agree`, called by every collective op before it issues a
  collective), so that a mismatch is the same clear ``ValueError`` on every rank instead of a hang,
  a crash (gloo aborts the process on mismatched sizes) or collectives that pair up wrongly:

  1. Environment, once per group: the rank-uniform run-time variables
     (``fp4fuse.config.rank_uniform_env()``: overlap threshold and switch, all-gather schedule,
     check mode, backend) decide which collectives a call issues, so the ranks all-gather a hash
     of them at the first call on the group; a mismatch names each variable and every rank's
     value. They are compared as written, stripped and lower-cased: ``1`` and ``true`` differ
     (comparing before parsing keeps a value only one rank would reject from desynchronizing
     the ranks: after agreement every rank parses the same text, so all raise or none).
  2. Call signature: op, each tensor's shape / dtype / contiguity / device (same as the first
     argument's or not), ``out_dtype``. Mode ``FP4FUSE_COLLECTIVE_CHECK``:

     * ``always`` (the default off CUDA): every call; one tiny all-gather plus a host sync.
     * ``first`` (the default on CUDA, where a per-call host sync would cost more than the GEMM
       at small sizes): the first call of each op on each group. The decision keys on the call's
       ordinal per (group, op), which every rank advances in lockstep (a group's collective ops
       must be called in the same order on every rank, or their collectives could not pair up
       at all), never on anything rank-local such as shapes: so either every rank checks or none
       does. FIRST catches what is wrong from the start: mismatched configuration (world layout,
       hidden sizes, weight shards, dtypes, ``out_dtype``) and environment. It does not catch a
       later call whose arguments differ between ranks (for example token counts that diverge in
       a serving loop): that call's collectives then see different sizes (gloo aborts, NCCL may
       hang or read garbage). Use ``always`` to find such a bug.
     * ``off``: never (the environment is still agreed once per group).

  During CUDA-graph capture a host sync is impossible, so a check that falls in a capture (every
  call under ``always``, the first under ``first`` if no eager warm-up call preceded it, the
  environment's if the group's first call is captured) runs on the device instead: the ranks
  all-gather one 64-bit hash and ``torch._assert_async`` compares it, so a mismatch fails as a
  device-side assertion when the graph runs (it kills the CUDA context, but loudly, where the
  collectives would otherwise pair up wrongly). Captured shapes are fixed, so checking at capture
  time covers every replay; under ``always`` the tiny all-gather is part of every replay.
"""
from __future__ import annotations

import enum
import hashlib

import torch
import torch.distributed as dist

from fp4fuse.config import env_choice, rank_uniform_env

__all__ = [
    "SignatureCheck", "agree_on_environment", "all_gather_rows", "assert_same_on_device", "call_signature",
    "check_ranks_agree", "check_rows_divisible", "describe_signature", "gather_strings", "gather_values",
    "group_rank_of", "group_size_of", "reduce_scatter_rows_fp32", "resolve_group", "signature_check_mode",
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
# Collective helpers of the agreement
# ----------------------------------------------------------------------------------------------
def gather_values(group_name: str, values: tuple[int, ...], device: torch.device) -> list[tuple[int, ...]]:
    """Collective: every rank's ``values`` (same length everywhere), indexed by rank. Host sync."""
    world = group_size_of(group_name)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = _funcol.wait_tensor(_funcol.all_gather_into_tensor(mine, world, group_name))
    return [tuple(r) for r in gathered.view(world, len(values)).tolist()]


#: Longest string (UTF-8 bytes) :func:`gather_strings` takes from a rank: the values of environment
#: variables; a longer length means another call's collective paired with this one.
MAX_STRING_BYTES = 1 << 20


def gather_strings(group_name: str, strings: tuple[str, ...], device: torch.device) -> list[tuple[str, ...]]:
    """Collective: every rank's ``strings`` (the same count everywhere), indexed by rank. Two small
    all-gathers (lengths, then the padded UTF-8 bytes); host syncs. A gathered length outside
    ``[0, MAX_STRING_BYTES]`` is a ``RuntimeError`` saying the ranks are out of step."""
    encoded = [text.encode("utf-8") for text in strings]
    lengths = gather_values(group_name, tuple(len(b) for b in encoded), device)
    wrong = [(rank, n) for rank, row in enumerate(lengths) for n in row if not 0 <= n <= MAX_STRING_BYTES]
    if wrong:  # a collective of another call paired with this one: padding to it would exhaust memory
        rank, n = wrong[0]
        raise RuntimeError(
            f"fp4fuse: gathering strings over group {group_name!r}, rank {rank} sent a length of {n} bytes "
            f"(at most {MAX_STRING_BYTES}): the ranks' collective calls are out of step (a rank ran a collective "
            "the others did not, or in another order)")
    width = max(1, max(max(row) for row in lengths))
    padded = b"".join(b.ljust(width, b"\0") for b in encoded)
    rows = gather_values(group_name, tuple(padded), device)
    return [tuple(bytes(row[j * width: j * width + lengths[rank][j]]).decode("utf-8")
                  for j in range(len(strings)))
            for rank, row in enumerate(rows)]


def assert_same_on_device(group_name: str, value: int, device: torch.device, message: str) -> None:
    """Collective, no host sync (so CUDA-graph capture can hold it): all-gather one int64 and
    assert on the device that every rank passed the same ``value``. On CUDA a mismatch is a
    device-side assertion carrying ``message`` when the stream reaches it; on CPU
    ``torch._assert_async`` raises ``RuntimeError(message)`` at once."""
    world = group_size_of(group_name)
    mine = torch.full((1,), value, dtype=torch.int64, device=device)  # a fill: no host-to-device copy
    gathered = _funcol.wait_tensor(_funcol.all_gather_into_tensor(mine, world, group_name))
    torch._assert_async((gathered == mine).all(), message)


def _stable_hash(text: str) -> int:
    """A signed 64-bit hash of ``text``, the same in every process (unlike ``hash()``)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little", signed=True)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------------------------
# Agreement on the environment (once per group)
# ----------------------------------------------------------------------------------------------
_env_agreed: set[str] = set()


def agree_on_environment(group_name: str, device: torch.device) -> None:
    """Collective at the first call per group (nothing after): raise the same ``ValueError`` on
    every rank if the ranks hold different values of a rank-uniform ``FP4FUSE_*`` variable (module
    doc). A group that failed is checked again at its next call."""
    if group_name in _env_agreed:
        return
    values = rank_uniform_env()
    if _capturing(device):
        names = ", ".join(name for name, _ in values)
        assert_same_on_device(group_name, _stable_hash(repr(values)), device,
                              f"fp4fuse: the ranks of group {group_name} disagree on one of {names}")
        _env_agreed.add(group_name)
        return
    rows = gather_values(group_name, tuple(_stable_hash(f"{name}={value}") for name, value in values), device)
    differing = [i for i in range(len(values)) if len({row[i] for row in rows}) > 1]
    if differing:
        per_rank = gather_strings(group_name, tuple(values[i][1] for i in differing), device)
        parts = []
        for j, i in enumerate(differing):
            by_rank = ", ".join(f"rank {rank}: {repr(v[j]) if v[j] else 'unset'}" for rank, v in enumerate(per_rank))
            parts.append(f"{values[i][0]} ({by_rank})")
        raise ValueError(
            f"fp4fuse: the ranks of group {group_name!r} disagree on {'; '.join(parts)}. These variables decide "
            "which collectives each call issues, so every rank must set the same value (or leave it unset "
            "everywhere); values are compared stripped and lower-cased, so '1' and 'true' differ.")
    _env_agreed.add(group_name)


# ----------------------------------------------------------------------------------------------
# Agreement on the call signature
# ----------------------------------------------------------------------------------------------
_DTYPE_CODES: dict[torch.dtype, int] = {
    dt: i for i, dt in enumerate((
        torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32, torch.float64,
        torch.int8, torch.int16, torch.int32, torch.int64, torch.float8_e5m2, torch.bool))
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
#: Leading sizes a signature holds (and an error shows) one by one; the sizes after them are
#: compared through one hash, so tensors that differ in any dimension never agree.
_SHOWN_DIMS = 4


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, len(_DTYPE_CODES))


def _tensor_fields(t: torch.Tensor, first_device: torch.device) -> tuple[int, ...]:
    """(ndim, up to four sizes padded with -1, a hash of the sizes after them (0 if none), dtype
    code, contiguous, on the first argument's device) of one argument."""
    shown = tuple(t.shape[:_SHOWN_DIMS]) + (-1,) * (_SHOWN_DIMS - min(t.dim(), _SHOWN_DIMS))
    rest = _stable_hash(repr(tuple(t.shape[_SHOWN_DIMS:]))) if t.dim() > _SHOWN_DIMS else 0
    return (t.dim(), *shown, rest, _dtype_code(t.dtype), int(t.is_contiguous()), int(t.device == first_device))


_FIELDS_PER_TENSOR = 5 + _SHOWN_DIMS  # ndim, sizes, hash of the other sizes, dtype, contiguous, same device


def call_signature(op_code: int, tensors: tuple[torch.Tensor, ...], out_dtype: torch.dtype) -> tuple[int, ...]:
    """What every rank must agree on: the op, each tensor's ndim/sizes/dtype/contiguity/device
    (whether it shares the first tensor's), out_dtype.

    Built only from metadata, so it is defined even for inputs that local validation would reject
    (ranks agree first, then validate identically)."""
    fields: list[int] = [int(op_code), len(tensors)]
    for t in tensors:
        fields.extend(_tensor_fields(t, tensors[0].device))
    fields.append(_dtype_code(out_dtype))
    return tuple(fields)


def describe_signature(sig: tuple[int, ...], names: tuple[str, ...]) -> str:
    parts = []
    for i, name in enumerate(names):
        ndim, *rest = sig[2 + i * _FIELDS_PER_TENSOR: 2 + (i + 1) * _FIELDS_PER_TENSOR]
        sizes, (_, code, contiguous, same_device) = rest[:_SHOWN_DIMS], rest[_SHOWN_DIMS:]
        shape = "[" + ", ".join([str(s) for s in sizes[:ndim]] + (["..."] if ndim > _SHOWN_DIMS else [])) + "]"
        dtype = str(_CODE_DTYPES.get(code, "other")).replace("torch.", "")
        parts.append(f"{name}{shape} {dtype}{'' if contiguous else ' non-contiguous'}"
                     f"{'' if same_device else f' on another device than {names[0]}'}")
    out_dtype = str(_CODE_DTYPES.get(sig[-1], "other")).replace("torch.", "")
    return ", ".join(parts) + f", out_dtype={out_dtype}"


# (group, op code) -> calls so far in this process: the same on every rank (module doc).
_call_counts: dict[tuple[str, int], int] = {}


def check_ranks_agree(
    op: str, group_name: str, op_code: int, named: dict[str, torch.Tensor], out_dtype: torch.dtype,
) -> None:
    """Agree on the environment (first call per group), then, as the check mode says, on the call
    signature: raise ``ValueError`` on every rank if the ranks of ``group_name`` called ``op`` with
    different shapes / dtypes (module doc: when it runs, what FIRST does not catch, CUDA graphs).
    Collective when it runs; every rank decides the same way whether it runs."""
    tensors = tuple(named.values())
    device = tensors[0].device
    agree_on_environment(group_name, device)
    mode = signature_check_mode(device.type)
    ordinal = _call_counts.get((group_name, op_code), 0)
    _call_counts[(group_name, op_code)] = ordinal + 1
    if mode is SignatureCheck.OFF or (mode is SignatureCheck.FIRST and ordinal > 0):
        return
    sig = call_signature(op_code, tensors, out_dtype)
    if _capturing(device):
        assert_same_on_device(group_name, _stable_hash(repr(sig)), device,
                              f"fp4fuse.{op}: the ranks of group {group_name} called it with different arguments "
                              f"(checked in a CUDA graph, {ENV_CHECK}={mode.value})")
        return
    rows = gather_values(group_name, sig, device)
    if any(r != sig for r in rows):
        names = tuple(named)
        table = "; ".join(f"rank {i}: {describe_signature(r, names)}" for i, r in enumerate(rows))
        raise ValueError(
            f"fp4fuse.{op}: the ranks of group {group_name!r} called it with different arguments ({table}). "
            "Every rank must pass the same shapes, dtypes and out_dtype.")
