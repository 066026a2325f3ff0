"""``FusionConfig`` (which fp4fuse passes run) and the one parser of ``FP4FUSE_*`` variables.

    cfg = FusionConfig(enable_async_tp=True, min_tokens=1024)
    cfg = FusionConfig.from_env()       # serving engines: one flag per switch

Environment variables. Every ``FP4FUSE_*`` variable is read through :func:`env_bool`,
:func:`env_int`, :func:`env_choice` or :func:`env_log_level`: an unset or empty (whitespace only)
variable takes its default, anything else must parse or raises ``ValueError`` naming the variable
and the accepted values; a set ``FP4FUSE_*`` name that fp4fuse does not read (a typo such as
``FP4FUSE_ENABLE_ASYNCTP``) is a warning naming the closest known one (:func:`warn_unknown_env`,
at import and in ``from_env()``). :data:`RUNTIME_ENV_VARS` lists the run-time switches read by the ops;
those marked rank-uniform must hold the same value on every rank of a group (the collective ops
agree on them at first use, ``fp4fuse.distributed.groups``).

Normalization (``__post_init__``): ``enable_bf16_async_tp`` implies ``enable_async_tp``, which
implies ``enable_sequence_parallelism`` (AsyncTP fuses the collectives that SP introduces). The
stored fields are the normalized ones, so two configs that run the same passes compare and hash
equal.

``hash_key()`` covers every field that changes a compiled graph; it goes into
``FusionPass.uuid()`` so the FX graph cache never serves a graph compiled under other settings.
``log_level`` changes no graph and is left out of it.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar, overload

__all__ = [
    "ENV_VARS", "RUNTIME_ENV_VARS", "FusionConfig", "RankCheck", "compile_time_env", "env_bool", "env_choice",
    "env_int", "env_log_level", "env_value", "rank_uniform_env", "unknown_env_vars", "warn_unknown_env",
]

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# field name -> environment variable read by FusionConfig.from_env()
ENV_VARS: dict[str, str] = {
    "enable_sequence_parallelism": "FP4FUSE_ENABLE_SP",
    "enable_async_tp": "FP4FUSE_ENABLE_ASYNC_TP",
    "enable_bf16_async_tp": "FP4FUSE_ENABLE_BF16_ASYNC_TP",
    "enable_norm_quant_fusion": "FP4FUSE_ENABLE_NORM_QUANT",
    "enable_symm_all_reduce": "FP4FUSE_ENABLE_SYMM_ALL_REDUCE",
    "min_tokens": "FP4FUSE_MIN_TOKENS",
    "lower_kernels": "FP4FUSE_LOWER_KERNELS",
    "rank_check": "FP4FUSE_RANK_CHECK",
    "log_level": "FP4FUSE_LOG_LEVEL",
}

# Fields that do not change any compiled graph (left out of hash_key()).
_NON_GRAPH_FIELDS = frozenset({"log_level"})


class RankCheck(enum.Enum):
    """When a compiled graph compares, across the tensor-parallel group, the model state its
    sequence-parallel rewrites rely on being the same on every rank (norm weights, static global
    scales: parameters and buffers); see ``fp4fuse.distributed.rank_check``.

    ``FIRST``: on the first call of the compiled graph (and again for other model-state objects);
    per-call graph inputs (activations) are not trusted, so rewrites that need them uniform are
    skipped. ``ALWAYS``: on every call, per-call graph inputs included, which the rewrites may then
    rely on. ``OFF``: no check; model state is trusted as replicated (the user's promise),
    per-call graph inputs are not.
    """

    FIRST = "first"
    ALWAYS = "always"
    OFF = "off"


@dataclasses.dataclass(frozen=True)
class FusionConfig:
    """Switches for fp4fuse's post-grad passes.

    Attributes:
        enable_sequence_parallelism: rewrite ``all_reduce -> rms_norm (-> fp4 quant)`` into
            ``reduce_scatter -> rms_norm -> quant -> all_gather`` (SequenceParallelismPass).
        enable_async_tp: fuse ``all_gather + mm_fp4`` and ``mm_fp4 + reduce_scatter`` into
            fp4fuse's collective GEMMs (AsyncTPPass). Implies ``enable_sequence_parallelism``.
        enable_bf16_async_tp: also fuse plain ``aten.mm`` with an all-gather / reduce-scatter
            into ``torch.ops.symm_mem.*`` (CUDA only; skipped with a logged reason on CPU).
            Implies ``enable_async_tp``.
        enable_norm_quant_fusion: fuse fp4fuse's ``rms_norm`` / ``fused_add_rms_norm`` with the NVFP4
            quantization of their output into ``rms_norm_fp4_quant`` / ``fused_add_rms_norm_fp4_quant``
            where the output has no other reader and one static global scale (NormQuantFusionPass;
            exact; on by default, also when no collective fusion is enabled).
        enable_symm_all_reduce: rewrite functional all-reduces (sum) of two-rank groups into
            ``fp4fuse::all_reduce_sum``, which sums through PyTorch's symmetric-memory one-shot /
            two-shot kernels on CUDA and keeps NCCL for what they do not serve, bitwise NCCL's
            result (SymmAllReducePass; on by default, also when no fusion is enabled; decided per
            call at run time, so ``min_tokens`` does not apply).
        min_tokens: a collective whose token count is below this is left alone (vLLM compiles a
            separate small-batch graph without SP/AsyncTP, where they do not pay). The token count
            is the number of rows of the full, unsharded activation: the input rows of a
            reduce-scatter or all-reduce, ``group_size x`` the shard rows of an all-gather.
            ``None`` (default): the measured crossovers of fp4fuse.patterns.thresholds on CUDA
            (each rewrite fires where it measured faster), every size elsewhere; 0 fuses at every
            size; a dynamic count is decided by its size hint, with a guard on the side chosen.
        lower_kernels: replace fp4fuse's op calls on CUDA by the Triton launches they run, so the
            compiled graph launches kernels without a Python op call per kernel
            (KernelLoweringPass, the last pass; on by default, also when no fusion is enabled).
        rank_check: when compiled graphs verify that the model state their rewrites rely on is
            the same on every rank (:class:`RankCheck`, or its string value; default ``first``).
        log_level: if set, the level given to the ``fp4fuse`` logger when a ``FusionPass`` is
            built (``"DEBUG"`` shows every skipped match and its reason). ``None`` leaves logging
            configuration alone. Not part of ``hash_key()``.
    """

    enable_sequence_parallelism: bool = False
    enable_async_tp: bool = False
    enable_bf16_async_tp: bool = False
    enable_norm_quant_fusion: bool = True
    enable_symm_all_reduce: bool = True
    min_tokens: int | None = None
    lower_kernels: bool = True
    rank_check: RankCheck = RankCheck.FIRST
    log_level: str | None = None

    def __post_init__(self) -> None:
        for f in ("enable_sequence_parallelism", "enable_async_tp", "enable_bf16_async_tp", "enable_norm_quant_fusion",
                  "enable_symm_all_reduce", "lower_kernels"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"FusionConfig.{f} must be a bool, got {getattr(self, f)!r}")
        if self.min_tokens is not None and (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)):
            raise TypeError(f"FusionConfig.min_tokens must be an int or None, got {self.min_tokens!r}")
        if self.min_tokens is not None and self.min_tokens < 0:
            raise ValueError(f"FusionConfig.min_tokens must be >= 0, got {self.min_tokens}")
        if not isinstance(self.rank_check, RankCheck):
            allowed = ", ".join(m.value for m in RankCheck)
            try:
                object.__setattr__(self, "rank_check", RankCheck(str(self.rank_check).lower()))
            except ValueError:
                raise ValueError(f"FusionConfig.rank_check must be a RankCheck or one of {allowed}, "
                                 f"got {self.rank_check!r}") from None
        if self.log_level is not None:
            level = str(self.log_level).upper()
            if level not in _LOG_LEVELS:
                raise ValueError(f"FusionConfig.log_level must be one of {', '.join(_LOG_LEVELS)} "
                                 f"or None, got {self.log_level!r}")
            object.__setattr__(self, "log_level", level)
        if self.enable_bf16_async_tp:
            object.__setattr__(self, "enable_async_tp", True)
        if self.enable_async_tp:
            object.__setattr__(self, "enable_sequence_parallelism", True)

    @property
    def log_level_number(self) -> int | None:
        return None if self.log_level is None else logging.getLevelName(self.log_level)

    def to_dict(self) -> dict[str, Any]:
        """Every field; enums as their values (JSON-ready)."""
        return {k: v.value if isinstance(v, enum.Enum) else v for k, v in dataclasses.asdict(self).items()}

    def to_json(self) -> str:
        """All fields, sorted keys, no whitespace: stable across processes and Python versions."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def hash_key(self) -> str:
        """sha256 hex digest of the fields that change a compiled graph (not ``log_level``)."""
        graph_fields = {k: v for k, v in self.to_dict().items() if k not in _NON_GRAPH_FIELDS}
        payload = json.dumps(graph_fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> FusionConfig:
        """Build a config from ``FP4FUSE_*`` variables (see ``ENV_VARS``); unset ones keep defaults.

        Booleans accept 1/0, true/false, yes/no, on/off (any case); ``FP4FUSE_MIN_TOKENS`` an
        integer >= 0; ``FP4FUSE_RANK_CHECK`` one of first, always, off; ``FP4FUSE_LOG_LEVEL`` a
        logging level name. An invalid value raises ``ValueError`` naming the variable and the
        accepted values; an ``FP4FUSE_*`` name fp4fuse does not know (a typo) is a warning
        (:func:`warn_unknown_env`). Keyword ``overrides`` win over the environment.
        """
        warn_unknown_env(environ)
        values: dict[str, Any] = {}
        for field, var in ENV_VARS.items():
            if _raw(var, environ) is None:
                continue
            if field == "min_tokens":
                values[field] = env_int(var, 0, environ=environ)
            elif field == "rank_check":
                values[field] = env_choice(var, RankCheck, RankCheck.FIRST, environ=environ)
            elif field == "log_level":
                values[field] = env_log_level(var, environ=environ)
            else:
                values[field] = env_bool(var, getattr(cls, field), environ=environ)
        values.update(overrides)
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class RuntimeEnvVar:
    """A run-time ``FP4FUSE_*`` switch: what it means, whether every rank must agree on it, and
    whether the passes also read it while they compile a graph (``compile_time``: a threshold they
    apply, or which kernels a lowered call takes), so that its value is part of
    ``FusionPass.uuid()`` (:func:`compile_time_env`)."""

    name: str
    meaning: str
    rank_uniform: bool
    compile_time: bool = False


#: The run-time switches the ops read (README, "Run-time knobs"). A rank-uniform switch changes
#: which collectives a call issues, so ranks that disagree would hang or pair up wrongly.
RUNTIME_ENV_VARS: tuple[RuntimeEnvVar, ...] = (
    RuntimeEnvVar("FP4FUSE_OVERLAP_MIN_ROWS", "total rows from which the collective GEMMs overlap", True, True),
    RuntimeEnvVar("FP4FUSE_DISABLE_OVERLAP", "never overlap the collective GEMMs", True),
    RuntimeEnvVar("FP4FUSE_AG_SCHEDULE", "all-gather GEMM schedule: auto, decode-gather, per-shard", True),
    RuntimeEnvVar("FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES",
                  "largest all-reduce fp4fuse::all_reduce_sum sums through symmetric memory (0: never)", True, True),
    RuntimeEnvVar("FP4FUSE_COLLECTIVE_CHECK", "cross-rank argument check: always, first, off", True),
    RuntimeEnvVar("FP4FUSE_BACKEND", "CUDA kernel family: reference, triton, flashinfer", True, True),
    RuntimeEnvVar("FP4FUSE_SYMM_MEM_TIMEOUT_MS", "device-side wait limit of the symmetric-memory pipelines", False),
    RuntimeEnvVar("FP4FUSE_DISABLE_GLUON", "never use the Hopper Gluon GEMM (fp4fuse/kernels/triton/mm_hopper.py)",
                  False, True),
)


def compile_time_env(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The values (None: unset or empty) of the run-time switches the passes also read while they
    compile (``RuntimeEnvVar.compile_time``): the FX graph cache must not serve a graph compiled
    under other values, since its thresholds and kernel choices came from them."""
    return {v.name: _raw(v.name, environ) for v in RUNTIME_ENV_VARS if v.compile_time}


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
EnumT = TypeVar("EnumT", bound=enum.Enum)


def _raw(var: str, environ: Mapping[str, str] | None) -> str | None:
    """The variable's value, or None when it is unset or empty (whitespace only)."""
    raw = (os.environ if environ is None else environ).get(var)
    return None if raw is None or raw.strip() == "" else raw


def env_value(var: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, stripped; None when it is unset or empty (whitespace only)."""
    raw = _raw(var, environ)
    return None if raw is None else raw.strip()


def env_bool(var: str, default: bool, *, environ: Mapping[str, str] | None = None) -> bool:
    """``1/0, true/false, yes/no, on/off`` (any case) -> bool; unset or empty -> ``default``."""
    raw = _raw(var, environ)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{var}={raw!r} is not a boolean; accepted values: "
                     f"{'/'.join(_TRUE)} (true) or {'/'.join(_FALSE)} (false), any case")


def env_int(var: str, default: int, *, minimum: int = 0, environ: Mapping[str, str] | None = None) -> int:
    """A decimal integer >= ``minimum``; unset or empty -> ``default``."""
    raw = _raw(var, environ)
    if raw is None:
        return default
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{var}={raw!r} is not valid; accepted values: an integer >= {minimum}")
    return value


@overload
def env_choice(var: str, choices: type[EnumT], default: EnumT, *,
               environ: Mapping[str, str] | None = None) -> EnumT: ...


@overload
def env_choice(var: str, choices: type[EnumT], default: None, *,
               environ: Mapping[str, str] | None = None) -> EnumT | None: ...


def env_choice(var: str, choices: type[EnumT], default: EnumT | None, *,
               environ: Mapping[str, str] | None = None) -> EnumT | None:
    """One of the string values of the enum ``choices`` (any case); unset or empty -> ``default``
    (which may be None: "not set, decide otherwise")."""
    raw = _raw(var, environ)
    if raw is None:
        return default
    value = raw.strip().lower()
    for member in choices:
        if member.value == value:
            return member
    allowed = ", ".join(str(m.value) for m in choices)
    raise ValueError(f"{var}={raw!r} is not valid; accepted values: {allowed} (any case)")


def env_log_level(var: str, *, environ: Mapping[str, str] | None = None) -> str | None:
    """A ``logging`` level name (any case), upper-cased; unset or empty -> None."""
    raw = _raw(var, environ)
    if raw is None:
        return None
    value = raw.strip().upper()
    if value not in _LOG_LEVELS:
        raise ValueError(f"{var}={raw!r} is not valid; accepted values: {', '.join(_LOG_LEVELS)} (any case)")
    return value


_PREFIX = "FP4FUSE_"
#: ``FP4FUSE_*`` names read by the repository's tests and benchmarks, never by the package: known,
#: so not warned about (spelled from the prefix: the package declares only what it reads itself).
_TOOLING_ENV_VARS = frozenset(_PREFIX + name for name in ("E2E_DEVICE", "BENCH_VERBOSE"))


def _known_env_vars() -> frozenset[str]:
    return frozenset(ENV_VARS.values()) | {v.name for v in RUNTIME_ENV_VARS}


def unknown_env_vars(environ: Mapping[str, str] | None = None) -> list[str]:
    """The set ``FP4FUSE_*`` names (any case) that fp4fuse does not read: typos, sorted."""
    known = _known_env_vars() | _TOOLING_ENV_VARS
    return sorted(name for name in (os.environ if environ is None else environ)
                  if name.upper().startswith(_PREFIX) and name not in known)


def warn_unknown_env(environ: Mapping[str, str] | None = None) -> None:
    """A ``UserWarning`` for each ``FP4FUSE_*`` variable fp4fuse does not read (a misspelled name
    would otherwise be ignored without a word), naming the closest known one. Called by
    :meth:`FusionConfig.from_env` and when ``fp4fuse`` is imported."""
    known = sorted(_known_env_vars())
    for name in unknown_env_vars(environ):
        close = difflib.get_close_matches(name.upper(), known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        warnings.warn(f"fp4fuse: {name} is not an fp4fuse variable and is ignored; {hint}"
                      f"fp4fuse reads: {', '.join(known)}", UserWarning, stacklevel=3)


def rank_uniform_env(environ: Mapping[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """``(name, stripped value)`` of every rank-uniform run-time variable ('' when unset): what the
    ranks of a group compare at first use."""
    return tuple((v.name, (_raw(v.name, environ) or "").strip().lower())
                 for v in RUNTIME_ENV_VARS if v.rank_uniform)
