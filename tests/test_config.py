"""FusionConfig: normalization, validation, FP4FUSE_* parsing, stable hashing."""
from __future__ import annotations

import dataclasses

import pytest

from fp4fuse.config import ENV_VARS, FusionConfig, RankCheck


def test_defaults_run_no_fusion():
    cfg = FusionConfig()
    assert not cfg.enable_sequence_parallelism and not cfg.enable_async_tp and not cfg.enable_bf16_async_tp
    assert cfg.min_tokens is None and cfg.log_level is None


def test_async_tp_implies_sp_and_bf16_implies_async_tp():
    assert FusionConfig(enable_async_tp=True).enable_sequence_parallelism
    bf16 = FusionConfig(enable_bf16_async_tp=True)
    assert bf16.enable_async_tp and bf16.enable_sequence_parallelism
    assert FusionConfig(enable_async_tp=True) == FusionConfig(enable_async_tp=True, enable_sequence_parallelism=True)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FusionConfig().min_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, error, text", [
    ({"min_tokens": -1}, ValueError, "min_tokens must be >= 0"),
    ({"min_tokens": 1.5}, TypeError, "min_tokens must be an int"),
    ({"min_tokens": True}, TypeError, "min_tokens must be an int"),
    ({"enable_async_tp": 1}, TypeError, "enable_async_tp must be a bool"),
    ({"log_level": "LOUD"}, ValueError, "log_level must be one of"),
])
def test_invalid_fields(kwargs, error, text):
    with pytest.raises(error, match=text):
        FusionConfig(**kwargs)


def test_log_level_normalized_and_not_hashed():
    cfg = FusionConfig(log_level="debug")
    assert cfg.log_level == "DEBUG" and cfg.log_level_number == 10
    assert cfg.hash_key() == FusionConfig().hash_key()
    assert cfg.to_json() != FusionConfig().to_json()


@pytest.mark.parametrize("raw, expected", [
    ("1", True), ("true", True), ("YES", True), (" On ", True),
    ("0", False), ("False", False), ("no", False), ("OFF", False),
])
def test_env_bools(raw, expected):
    cfg = FusionConfig.from_env({"FP4FUSE_ENABLE_SP": raw})
    assert cfg.enable_sequence_parallelism is expected


def test_env_full():
    env = {"FP4FUSE_ENABLE_ASYNC_TP": "1", "FP4FUSE_MIN_TOKENS": "1024", "FP4FUSE_LOG_LEVEL": "info",
           "FP4FUSE_ENABLE_BF16_ASYNC_TP": "off", "UNRELATED": "x"}
    cfg = FusionConfig.from_env(env)
    assert cfg == FusionConfig(enable_async_tp=True, min_tokens=1024, log_level="INFO")


def test_env_empty_and_unset_keep_defaults():
    assert FusionConfig.from_env({}) == FusionConfig()
    assert FusionConfig.from_env({"FP4FUSE_MIN_TOKENS": "", "FP4FUSE_ENABLE_SP": "  "}) == FusionConfig()


def test_env_reads_os_environ_and_overrides_win(monkeypatch):
    monkeypatch.setenv("FP4FUSE_MIN_TOKENS", "7")
    monkeypatch.setenv("FP4FUSE_ENABLE_SP", "1")
    assert FusionConfig.from_env().min_tokens == 7
    assert FusionConfig.from_env(min_tokens=9) == FusionConfig(enable_sequence_parallelism=True, min_tokens=9)


@pytest.mark.parametrize("var, raw, accepted", [
    ("FP4FUSE_ENABLE_SP", "maybe", "1/true/yes/on"),
    ("FP4FUSE_ENABLE_ASYNC_TP", "2", "0/false/no/off"),
    ("FP4FUSE_MIN_TOKENS", "-3", "an integer >= 0"),
    ("FP4FUSE_MIN_TOKENS", "1e3", "an integer >= 0"),
    ("FP4FUSE_LOG_LEVEL", "verbose", "DEBUG, INFO"),
    ("FP4FUSE_LOWER_KERNELS", "sometimes", "1/true/yes/on"),
])
def test_env_errors_name_variable_and_accepted_values(var, raw, accepted):
    with pytest.raises(ValueError) as err:
        FusionConfig.from_env({var: raw})
    assert var in str(err.value) and repr(raw) in str(err.value) and accepted in str(err.value)


def test_every_field_has_an_env_var():
    assert set(ENV_VARS) == {f.name for f in dataclasses.fields(FusionConfig)}
    assert {"FP4FUSE_ENABLE_SP", "FP4FUSE_ENABLE_ASYNC_TP", "FP4FUSE_MIN_TOKENS"} <= set(ENV_VARS.values())


def test_hash_key_stable_and_distinct():
    a = FusionConfig(enable_async_tp=True, min_tokens=64)
    assert a.hash_key() == FusionConfig(enable_async_tp=True, min_tokens=64).hash_key()
    assert FusionConfig().hash_key() == FusionConfig.from_env({}).hash_key()
    keys = {c.hash_key() for c in (
        FusionConfig(), FusionConfig(enable_sequence_parallelism=True), a,
        FusionConfig(enable_async_tp=True, min_tokens=65), FusionConfig(enable_bf16_async_tp=True),
        FusionConfig(lower_kernels=False), FusionConfig(enable_norm_quant_fusion=False),
        FusionConfig(enable_symm_all_reduce=False),
    )}
    assert len(keys) == 8
    assert a.to_json() == ('{"enable_async_tp":true,"enable_bf16_async_tp":false,"enable_norm_quant_fusion":true,'
                           '"enable_sequence_parallelism":true,"enable_symm_all_reduce":true,"log_level":null,'
                           '"lower_kernels":true,"min_tokens":64,"rank_check":"first"}')


def test_lower_kernels_defaults_on_and_reads_the_env():
    assert FusionConfig().lower_kernels and FusionConfig.from_env({}).lower_kernels
    assert not FusionConfig.from_env({"FP4FUSE_LOWER_KERNELS": "off"}).lower_kernels


def test_norm_quant_fusion_defaults_on_and_reads_the_env():
    assert FusionConfig().enable_norm_quant_fusion and FusionConfig.from_env({}).enable_norm_quant_fusion
    assert not FusionConfig.from_env({"FP4FUSE_ENABLE_NORM_QUANT": "0"}).enable_norm_quant_fusion
    with pytest.raises(TypeError, match="enable_norm_quant_fusion must be a bool"):
        FusionConfig(enable_norm_quant_fusion="yes")


def test_symm_all_reduce_defaults_on_and_reads_the_env():
    assert FusionConfig().enable_symm_all_reduce and FusionConfig.from_env({}).enable_symm_all_reduce
    assert not FusionConfig.from_env({"FP4FUSE_ENABLE_SYMM_ALL_REDUCE": "off"}).enable_symm_all_reduce
    with pytest.raises(TypeError, match="enable_symm_all_reduce must be a bool"):
        FusionConfig(enable_symm_all_reduce=1)


def test_rank_check_mode():
    assert FusionConfig().rank_check is RankCheck.FIRST
    assert FusionConfig(rank_check="Always").rank_check is RankCheck.ALWAYS
    assert FusionConfig.from_env({"FP4FUSE_RANK_CHECK": "off"}).rank_check is RankCheck.OFF
    keys = {FusionConfig(rank_check=m).hash_key() for m in RankCheck}
    assert len(keys) == len(RankCheck)  # each mode compiles a different graph
    with pytest.raises(ValueError, match="rank_check must be a RankCheck or one of first, always, off"):
        FusionConfig(rank_check="sometimes")
    with pytest.raises(ValueError, match="FP4FUSE_RANK_CHECK='never' is not valid; accepted values: first, always, off"):
        FusionConfig.from_env({"FP4FUSE_RANK_CHECK": "never"})
