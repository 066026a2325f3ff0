"""Every FP4FUSE_* variable: read through fp4fuse.config's one parser, a bad value is a
ValueError naming the variable and the accepted values, an empty value means unset."""
from __future__ import annotations

import importlib

import pathlib
import re
from typing import Any, Callable

import pytest

import fp4fuse
from fp4fuse.config import ENV_VARS, RUNTIME_ENV_VARS, FusionConfig, RankCheck
from fp4fuse.distributed import groups
from fp4fuse.distributed.symm_mem import all_reduce as symm_all_reduce
from fp4fuse.distributed.symm_mem import policy, workspace
from fp4fuse.ops import backend

PACKAGE_DIR = pathlib.Path(fp4fuse.__file__).parent
REPO_DIR = PACKAGE_DIR.parent

# variable -> (what reads it, the value it takes when unset)
READERS: dict[str, tuple[Callable[[], Any], Any]] = {
    "FP4FUSE_ENABLE_SP": (lambda: FusionConfig.from_env().enable_sequence_parallelism, False),
    "FP4FUSE_ENABLE_ASYNC_TP": (lambda: FusionConfig.from_env().enable_async_tp, False),
    "FP4FUSE_ENABLE_BF16_ASYNC_TP": (lambda: FusionConfig.from_env().enable_bf16_async_tp, False),
    "FP4FUSE_MIN_TOKENS": (lambda: FusionConfig.from_env().min_tokens, None),
    "FP4FUSE_LOG_LEVEL": (lambda: FusionConfig.from_env().log_level, None),
    "FP4FUSE_LOWER_KERNELS": (lambda: FusionConfig.from_env().lower_kernels, True),
    "FP4FUSE_ENABLE_NORM_QUANT": (lambda: FusionConfig.from_env().enable_norm_quant_fusion, True),
    "FP4FUSE_ENABLE_SYMM_ALL_REDUCE": (lambda: FusionConfig.from_env().enable_symm_all_reduce, True),
    "FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES": (symm_all_reduce.max_bytes, symm_all_reduce.DEFAULT_MAX_BYTES),
    "FP4FUSE_RANK_CHECK": (lambda: FusionConfig.from_env().rank_check, RankCheck.FIRST),
    "FP4FUSE_OVERLAP_MIN_ROWS": (lambda: policy.overlap_min_rows(policy.CollectiveGemmKind.ALL_GATHER_MATMUL, 2),
                                 policy.DEFAULT_ALL_GATHER_MIN_ROWS),
    "FP4FUSE_DISABLE_OVERLAP": (policy.overlap_disabled, False),
    "FP4FUSE_AG_SCHEDULE": (lambda: policy.all_gather_schedule(2, 8, 64, 64), policy.AllGatherSchedule.DECODE_GATHER),
    "FP4FUSE_COLLECTIVE_CHECK": (lambda: groups.signature_check_mode("cpu"), groups.SignatureCheck.ALWAYS),
    "FP4FUSE_BACKEND": (backend.forced_backend, None),
    "FP4FUSE_SYMM_MEM_TIMEOUT_MS": (workspace.timeout_ms, workspace.DEFAULT_TIMEOUT_MS),
    "FP4FUSE_DISABLE_GLUON": (lambda: importlib.import_module("fp4fuse.kernels.triton.mm_hopper").gluon_disabled(),
                              False),
}

BOOL_ACCEPTED = ("1/true/yes/on", "0/false/no/off")
# variable -> [(bad value, text every accepted-values message must contain), ...]
BAD_VALUES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "FP4FUSE_ENABLE_SP": [("abc", BOOL_ACCEPTED), ("2", BOOL_ACCEPTED)],
    "FP4FUSE_ENABLE_ASYNC_TP": [("enabled", BOOL_ACCEPTED)],
    "FP4FUSE_ENABLE_BF16_ASYNC_TP": [("y", BOOL_ACCEPTED)],
    "FP4FUSE_MIN_TOKENS": [("-3", ("an integer >= 0",)), ("1e3", ("an integer >= 0",))],
    "FP4FUSE_LOG_LEVEL": [("verbose", ("DEBUG, INFO, WARNING, ERROR, CRITICAL",))],
    "FP4FUSE_LOWER_KERNELS": [("sometimes", BOOL_ACCEPTED)],
    "FP4FUSE_ENABLE_NORM_QUANT": [("maybe", BOOL_ACCEPTED)],
    "FP4FUSE_ENABLE_SYMM_ALL_REDUCE": [("fast", BOOL_ACCEPTED)],
    "FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES": [("16MiB", ("an integer >= 0",)), ("-1", ("an integer >= 0",))],
    "FP4FUSE_RANK_CHECK": [("never", ("first, always, off",))],
    "FP4FUSE_OVERLAP_MIN_ROWS": [("abc", ("an integer >= 0",)), ("-1", ("an integer >= 0",)),
                                 ("2.5", ("an integer >= 0",))],
    "FP4FUSE_DISABLE_OVERLAP": [("abc", BOOL_ACCEPTED), ("-1", BOOL_ACCEPTED)],
    "FP4FUSE_AG_SCHEDULE": [("sideways", ("auto, decode-gather, per-shard",))],
    "FP4FUSE_COLLECTIVE_CHECK": [("sometimes", ("off, first, always",)), ("1", ("off, first, always",))],
    "FP4FUSE_BACKEND": [("cuda", ("reference, triton, flashinfer",))],
    "FP4FUSE_SYMM_MEM_TIMEOUT_MS": [("abc", ("an integer >= 1",)), ("-1", ("an integer >= 1",)),
                                    ("0", ("an integer >= 1",))],
    "FP4FUSE_DISABLE_GLUON": [("gluon", BOOL_ACCEPTED)],
}

ALL_VARS = set(ENV_VARS.values()) | {v.name for v in RUNTIME_ENV_VARS}


def test_every_variable_has_a_reader_and_bad_values():
    assert set(READERS) == ALL_VARS == set(BAD_VALUES)


@pytest.mark.parametrize("var, raw, accepted", [
    (var, raw, accepted) for var, cases in BAD_VALUES.items() for raw, accepted in cases])
def test_bad_value_names_the_variable_and_the_accepted_values(monkeypatch, var, raw, accepted):
    monkeypatch.setenv(var, raw)
    read, _ = READERS[var]
    with pytest.raises(ValueError) as info:
        read()
    message = str(info.value)
    assert f"{var}={raw!r}" in message
    for text in accepted:
        assert text in message, message


@pytest.mark.parametrize("var", sorted(ALL_VARS))
@pytest.mark.parametrize("raw", ["", "   "])
def test_empty_means_unset(monkeypatch, var, raw):
    read, default = READERS[var]
    monkeypatch.delenv(var, raising=False)
    assert read() == default
    monkeypatch.setenv(var, raw)
    assert read() == default


@pytest.mark.parametrize("var, raw, expected", [
    ("FP4FUSE_OVERLAP_MIN_ROWS", " 4096 ", 4096),
    ("FP4FUSE_DISABLE_OVERLAP", "Yes", True),
    ("FP4FUSE_AG_SCHEDULE", "PER-SHARD", policy.AllGatherSchedule.PER_SHARD),
    ("FP4FUSE_COLLECTIVE_CHECK", "First", groups.SignatureCheck.FIRST),
    ("FP4FUSE_BACKEND", "Triton", backend.Backend.TRITON),
    ("FP4FUSE_SYMM_MEM_TIMEOUT_MS", "1", 1),
    ("FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES", "0", 0),
    ("FP4FUSE_ENABLE_SYMM_ALL_REDUCE", "OFF", False),
])
def test_good_values_parse(monkeypatch, var, raw, expected):
    monkeypatch.setenv(var, raw)
    assert READERS[var][0]() == expected


def _python_sources() -> list[pathlib.Path]:
    return sorted(PACKAGE_DIR.rglob("*.py")) + sorted((REPO_DIR / "benchmarks").glob("*.py"))


def test_no_raw_environment_reads_of_fp4fuse_variables():
    """Outside fp4fuse/config.py nothing reads an FP4FUSE_* variable (by literal or through an
    ``ENV_*`` constant) from ``os.environ`` / ``os.getenv``; writes (launchers, benchmarks) are fine."""
    read = re.compile(r"os\.(?:environ\.get|getenv)\(\s*([^,)]*)|os\.environ\[([^\]]*)\](?!\s*=)")
    offenders = []
    for path in _python_sources():
        if path == PACKAGE_DIR / "config.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for match in read.finditer(line):
                key = match.group(1) or match.group(2)
                if "FP4FUSE_" in key or re.search(r"\bENV_", key):
                    offenders.append(f"{path.relative_to(REPO_DIR)}:{n}: {line.strip()}")
    assert offenders == []


def test_every_variable_named_in_the_package_is_declared():
    """A new FP4FUSE_* variable must be declared (ENV_VARS or RUNTIME_ENV_VARS), so it is
    documented, parsed and, where it changes the collectives, agreed across ranks."""
    named = set()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        named |= set(re.findall(r"[\"'](FP4FUSE_[A-Z0-9_]+)[\"']", path.read_text()))
    assert named <= ALL_VARS, named - ALL_VARS


@pytest.mark.parametrize("name, suggestion", [
    ("FP4FUSE_ENABLE_ASYNCTP", "FP4FUSE_ENABLE_ASYNC_TP"),
    ("fp4fuse_min_tokens", "FP4FUSE_MIN_TOKENS"),
    ("FP4FUSE_DISABLE_OVERLAPS", "FP4FUSE_DISABLE_OVERLAP"),
])
def test_misspelled_variable_is_a_warning_naming_the_closest(monkeypatch, name, suggestion):
    """A typo used to be ignored without a word (the pass silently stayed off)."""
    monkeypatch.setenv(name, "1")
    with pytest.warns(UserWarning, match=f"{name} is not an fp4fuse variable and is ignored; did you mean {suggestion}"):
        FusionConfig.from_env()
    with pytest.warns(UserWarning, match=name):
        FusionConfig.from_env({name: "1"})


def test_known_and_tooling_variables_do_not_warn(recwarn):
    env = {var: "" for var in ALL_VARS} | {"FP4FUSE_E2E_DEVICE": "cpu", "FP4FUSE_BENCH_VERBOSE": "1", "OTHER": "x"}
    FusionConfig.from_env(env)
    assert [str(w.message) for w in recwarn if "fp4fuse" in str(w.message)] == []


@pytest.mark.parametrize("env", [{"FP4FUSE_ENABLE_SP": "0"}, {"FP4FUSE_ENABLE_ASYNC_TP": "off"},
                                 {"FP4FUSE_ENABLE_SP": "no", "FP4FUSE_ENABLE_ASYNC_TP": "0"}])
def test_demo_does_not_run_passes_the_environment_turned_off(monkeypatch, env):
    """python -m fp4fuse.demo used to run SP + AsyncTP when both were off, also when set off."""
    from fp4fuse import demo
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    args = demo.DemoArgs(demo.Device.CPU, tp=2, layers=1, hidden=64, tokens_per_rank=8, iters=1)
    with pytest.raises(ValueError, match=f"{next(iter(env))}=.*nothing would fuse"):
        demo.fusion_config(args)
    monkeypatch.setenv("FP4FUSE_ENABLE_SP", "1")
    cfg = demo.fusion_config(args)
    assert cfg.enable_sequence_parallelism and not cfg.enable_async_tp  # SP only, as asked
    monkeypatch.delenv("FP4FUSE_ENABLE_SP")
    monkeypatch.delenv("FP4FUSE_ENABLE_ASYNC_TP", raising=False)
    assert demo.fusion_config(args).enable_async_tp  # neither set: both, the demo's default
