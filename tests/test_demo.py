"""``python -m fp4fuse.demo``: bad flags are one-line errors before any rank starts; the pass/fail
criterion counts real fusions only; one real TP=2 gloo run makes exactly the expected fusions."""
from __future__ import annotations

import dataclasses
import re
import time

import pytest
import torch

from fp4fuse import demo
from fp4fuse.config import FusionConfig


def _no_ranks(*_args, **_kwargs):
    raise AssertionError("the demo started ranks although a flag was bad")


def _cuda_flag_case() -> tuple[list[str], str]:
    if torch.version.cuda is None:
        return ["--device", "cuda"], "--device cuda: this torch (" + torch.__version__ + ") is built without CUDA"
    return ["--device", "cuda", "--tp", str(max(2, torch.cuda.device_count() + 1))], "GPUs (one per rank)"


BAD_FLAGS = [
    (["--tp", "1"], "--tp 1: must be at least 2"),
    (["--tp", "3", "--hidden", "100"], "--hidden 100: must be a positive multiple of 16 x --tp = 48"),
    (["--hidden", "100"], "--hidden 100: must be a positive multiple of 16 x --tp = 32"),
    (["--hidden", "0"], "--hidden 0: must be a positive multiple of 16 x --tp = 32"),
    (["--layers", "0"], "--layers 0: must be at least 1"),
    (["--iters", "0"], "--iters 0: must be at least 1"),
    (["--tokens-per-rank", "0"], "--tokens-per-rank 0: must be at least 1"),
    (["--tp", "two"], "argument --tp: invalid int value: 'two'"),
    _cuda_flag_case(),
]


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_on_stderr_and_exit_2_before_any_rank(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(demo, "run_on_ranks", _no_ranks)
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    assert time.perf_counter() - start < 5.0
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("python -m fp4fuse.demo: error: ") and err.count("\n") == 1, err
    assert message in err


@pytest.mark.parametrize(("value", "message"), [
    ("abc", "FP4FUSE_MIN_TOKENS='abc' is not valid; accepted values: an integer >= 0"),
    ("1000", "FP4FUSE_MIN_TOKENS=1000: the demo runs 128 tokens"),
])
def test_bad_environment_is_one_line_and_exit_2(value, message, capsys, monkeypatch):
    monkeypatch.setattr(demo, "run_on_ranks", _no_ranks)
    monkeypatch.setenv("FP4FUSE_MIN_TOKENS", value)
    with pytest.raises(SystemExit) as exit_info:
        demo.main([])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err


def test_any_tp_size_that_divides_the_model_passes_the_checks():
    args = demo.DemoArgs(demo.Device.CPU, tp=3, layers=1, hidden=48, tokens_per_rank=4, iters=1)
    assert demo.flag_problem(args) is None
    cfg = args.llama_config()
    assert (cfg.vocab_size % 3, cfg.num_heads % 3, cfg.num_kv_heads % 3, (cfg.hidden_size // 3) % 16) == (0, 0, 0, 0)


def _rank_result(fusions: dict[str, int], not_fusions: dict[str, int] | None = None,
                 vs_eager: demo.Comparison = demo.Comparison(True, 0.0, 0.0)) -> dict:
    return {"fusions": fusions, "not_fusions": not_fusions or {}, "cached_graphs": 0,
            "vs": {"eager": dataclasses.asdict(vs_eager), "compiled": dataclasses.asdict(vs_eager)},
            "ms": {"eager": 1.0, "compiled": 1.0, "compiled + fp4fuse": 1.0}, "device_name": "cpu"}


ONE_LAYER = {"sequence_parallel.first.fp4fuse": 1, "sequence_parallel.middle.fp4fuse": 1,
             "sequence_parallel.last.fp4fuse": 1, "sequence_parallel.quant_before_gather.dynamic_scale": 2,
             "async_tp.all_gather_mm_fp4": 2, "async_tp.mm_fp4_reduce_scatter": 2}


def test_ok_needs_the_expected_fusions_not_a_removed_view_and_equal_outputs(capsys):
    args = demo.DemoArgs(demo.Device.CPU, tp=2, layers=1, hidden=64, tokens_per_rank=8, iters=1)
    cfg = FusionConfig(enable_async_tp=True)
    assert demo.report(args, cfg, [_rank_result(ONE_LAYER)] * 2)
    assert capsys.readouterr().out.rstrip().endswith("demo: OK")
    only_cleanup = _rank_result({}, not_fusions={"cleanup.noop_view": 3})
    assert not demo.report(args, cfg, [only_cleanup] * 2)
    out = capsys.readouterr().out
    assert "not fusions (cleanup, kernel lowering): cleanup.noop_view=3" in out
    assert "demo: FAILED (fusions as expected: False, outputs equal: True)" in out
    one_short = {**ONE_LAYER, "async_tp.all_gather_mm_fp4": 1}
    assert not demo.report(args, cfg, [_rank_result(ONE_LAYER), _rank_result(one_short)])
    last_bit = demo.Comparison(False, 0.44, 9.8e-2)  # as a TP=3 run measured: fp32 vs bf16 partial sums
    assert not demo.report(args, cfg, [_rank_result(ONE_LAYER, vs_eager=last_bit)] * 2)  # TP=2: bitwise
    tp3 = dataclasses.replace(args, tp=3, hidden=96)
    assert demo.report(tp3, cfg, [_rank_result(ONE_LAYER, vs_eager=last_bit)] * 3)
    far = demo.Comparison(False, 1.0, 0.5)
    assert not demo.report(tp3, cfg, [_rank_result(ONE_LAYER, vs_eager=far)] * 3)


def test_demo_runs_makes_exactly_the_expected_fusions_and_matches_eager(capfd, monkeypatch, rank_inductor_cache):
    """One spawn of 2 gloo ranks, 1 layer, 16 tokens; the session's Inductor cache for spawned ranks
    (tests/conftest.py, fresh each session, where no other test compiles the demo's graphs), so the
    passes run."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", rank_inductor_cache)
    assert demo.main(["--layers", "1", "--hidden", "64", "--tokens-per-rank", "8", "--iters", "1"]) == 0
    out, err = capfd.readouterr()
    made = {m[1]: int(m[2]) for m in re.finditer(r"^  ([a-z_.0-9]+\.[a-z_.0-9]+) +(\d+) +(\d+)$", out, re.M)}
    assert made == ONE_LAYER, out
    assert re.search(r"^  total +9 +9$", out, re.M), out
    assert re.search(r"^  fused vs eager +True +0\.000e\+00 +0\.00e\+00$", out, re.M), out
    assert out.rstrip().endswith("demo: OK")
    assert "benchmarks/results/" in out and "nothing overlaps" in out
    for step in ("starting 2 ranks", "eager forward", "compiled with fp4fuse: ready after", "timing 1 forward"):
        assert step in err, err
