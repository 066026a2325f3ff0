"""``python -m fp4fuse.selfcheck``: each figure printed beside its expected value, ok / FAIL per line."""
from __future__ import annotations

import re

import torch

from fp4fuse import selfcheck


def test_every_line_states_its_expectation_and_passes_on_this_device(capsys):
    assert selfcheck.main(["--m", "64", "--n", "96", "--k", "128"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^  (\S.*?) {2,}(\S+) {3}(\S.*?) +(ok|FAIL|-)$", out, re.M)
    assert [r[0] for r in rows] == [
        "scaled_fp4_quant vs float64 reference", "mm_fp4 vs float64 GEMM of the same codes",
        "NVFP4 rounding error of x (rel. RMS)", "NVFP4 rounding error of w (rel. RMS)",
        "mm_fp4 vs float64 matmul of x, w (rel. error)"]
    reference = not torch.cuda.is_available()  # on CPU the ops are the reference they would be compared with
    kernel_rows, format_rows = rows[:2], rows[2:]
    if reference:
        assert all(r[3] == "-" and r[2].startswith("not checked") for r in kernel_rows), out
        assert out.rstrip().endswith("selfcheck: OK (kernels not checked: the reference backend)")
    else:
        assert all(r[3] == "ok" for r in kernel_rows), out
        assert out.rstrip().endswith("selfcheck: OK")
    assert all(r[3] == "ok" for r in format_rows), out
    assert "0.095 +-10% (N(0, 1) data)" in rows[2][2]


def test_a_figure_off_its_expected_value_fails_and_a_small_sample_is_not_checked():
    assert selfcheck._format_line("x", 0.2, 0.095, "N(0, 1) data", 10 ** 6).ok is False
    assert selfcheck._format_line("x", 0.1, 0.095, "N(0, 1) data", 10 ** 6).ok is True
    assert selfcheck._format_line("x", 0.2, 0.095, "N(0, 1) data", 100).ok is None
