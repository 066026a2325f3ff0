"""What a new user sees: log lines when a level is asked for (and only then, and once), fusion
counts of a graph served from the FX graph cache, and no warning from fp4fuse's own tracing."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache
from torch._subclasses.fake_tensor import FakeTensorMode

from fp4fuse.config import FusionConfig
from fp4fuse.passes import FusionPass
from fp4fuse.passes.log_handler import PACKAGE_LOGGER, UnconfiguredStderrHandler
from fp4fuse.passes.sequence_parallel import SequenceParallelismPass
from fp4fuse.patterns.base import aot_trace
from test_fusion_pass import BOTH, ag_mm_rs, real_inputs, traced
from test_sp_patterns import NORM_WEIGHTS, as_model_state, three_layers, torch_functional_norm

REPO = Path(__file__).resolve().parent.parent
SUMMARY = "fp4fuse: replaced 2 patterns: async_tp.all_gather_mm_fp4=1, async_tp.mm_fp4_reduce_scatter=1"

# a 2-rank fake process group (tests/conftest.py): graphs with collectives trace without ranks
pytestmark = pytest.mark.usefixtures("fake_group")


# --------------------------------------------------------------------------- logging


@pytest.fixture
def package_logger():
    """The ``fp4fuse`` logger, its level and handlers restored afterwards."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    level, handlers = logger.level, list(logger.handlers)
    logger.handlers = [h for h in handlers if not isinstance(h, UnconfiguredStderrHandler)]
    yield logger
    logger.setLevel(level)
    logger.handlers = handlers


def _run_pass(config: FusionConfig) -> None:
    FusionPass(config)(traced().graph)


def test_a_level_attaches_one_handler_that_writes_while_logging_is_unconfigured(package_logger, capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as in a script that never configured logging
    _run_pass(FusionConfig(enable_async_tp=True))
    assert capsys.readouterr().err == ""  # no level asked for: fp4fuse stays quiet
    assert not any(isinstance(h, UnconfiguredStderrHandler) for h in package_logger.handlers)

    _run_pass(FusionConfig(enable_async_tp=True, log_level="INFO"))
    _run_pass(FusionConfig(enable_async_tp=True, log_level="INFO"))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith(f"INFO fp4fuse.passes.manager: {SUMMARY}") for line in lines)
    assert sum(isinstance(h, UnconfiguredStderrHandler) for h in package_logger.handlers) == 1


def test_handler_is_silent_once_the_application_configures_logging(package_logger, capsys, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="fp4fuse.passes.manager")  # pytest's handler on the root logger
    _run_pass(FusionConfig(enable_async_tp=True, log_level="INFO"))
    assert capsys.readouterr().err == ""
    assert [r.getMessage() for r in caplog.records if r.name == "fp4fuse.passes.manager"][0].startswith(SUMMARY)


def test_environment_level_reaches_stderr_of_a_fresh_interpreter_once():
    """A fresh interpreter (no pytest handlers): nothing without FP4FUSE_LOG_LEVEL; with it, one line
    per graph on stderr; after logging.basicConfig still one line per graph (the root handler's)."""
    script = textwrap.dedent("""
        import logging, os, sys, torch
        from fp4fuse.config import FusionConfig
        from fp4fuse.passes import FusionPass
        graph = lambda: torch.fx.symbolic_trace(lambda x: x + 1).graph
        FusionPass(FusionConfig.from_env())(graph())
        print("--- level set", file=sys.stderr, flush=True)
        os.environ["FP4FUSE_LOG_LEVEL"] = "info"
        FusionPass(FusionConfig.from_env())(graph())
        print("--- logging configured", file=sys.stderr, flush=True)
        logging.basicConfig(format="root: %(message)s")
        FusionPass(FusionConfig.from_env())(graph())
    """)
    env = {k: v for k, v in os.environ.items() if k != "FP4FUSE_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    unset, level_set, configured = done.stderr.split("--- ")
    summary = ("fp4fuse: replaced 0 patterns (0 skipped, 0 no-op views removed, 0 all-reduces through symmetric memory, 0 repeated computations merged, "
               "0 op calls lowered to kernels)")
    assert unset == ""
    assert level_set.splitlines()[1:] == [f"INFO fp4fuse.passes.manager: {summary}"]
    assert configured.splitlines()[1:] == [f"root: {summary}"]


# --------------------------------------------------------------------------- FX graph cache


def _compile_and_run(fusion: FusionPass) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(ag_mm_rs, fullgraph=True, options={"post_grad_custom_post_pass": fusion})
    compiled(*real_inputs())


def test_graph_served_from_the_fx_cache_reports_the_counts_recorded_at_compile_time(caplog):
    caplog.set_level(logging.INFO, logger="fp4fuse.passes.manager")
    with fresh_cache():
        first = FusionPass(FusionConfig(enable_async_tp=True))
        _compile_and_run(first)
        assert first.calls == 1 and first.match_counts == BOTH and first.cached_graphs == 0

        counters.clear()  # as in a fresh process
        caplog.clear()
        second = FusionPass(FusionConfig(enable_async_tp=True))
        _compile_and_run(second)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1 and second.calls == 0  # the passes did not run
        # logged by the end of the compile, before anything reads the counts
        assert [r.getMessage() for r in caplog.records] == [
            "fp4fuse: served 1 graph(s) from the FX graph cache (the passes did not run again): 2 fusions "
            "recorded at compile time: async_tp.all_gather_mm_fp4=1, async_tp.mm_fp4_reduce_scatter=1 "
            "(0 skipped, 0 no-op views removed, 0 all-reduces through symmetric memory, 0 repeated computations merged, 0 op calls lowered to kernels)"]
        assert second.match_counts == BOTH and second.fusion_counts == BOTH
        assert second.cached_match_counts == BOTH and second.cached_graphs == 1

        other = FusionPass(FusionConfig(enable_async_tp=True, min_tokens=10 ** 6))  # another cache key
        _compile_and_run(other)
        assert other.calls == 1 and other.cached_graphs == 0 and other.match_counts == {}
    assert first.cached_graphs == 0  # a hit is counted for the pass that was compiling, not for every pass


def test_recording_adds_nothing_to_the_graph():
    """The counts travel in Inductor's counters, not in the graph: a pass that fuses nothing leaves
    the graph's code as it was, so a compiled call costs nothing extra."""
    gm = traced()
    code = gm.code
    FusionPass(FusionConfig(lower_kernels=False))(gm.graph)
    gm.recompile()
    assert gm.code == code


# --------------------------------------------------------------------------- warnings


@pytest.fixture
def torch_warns_every_time():
    """TORCH_WARN_ONCE warns every time (so a warning seen earlier in the process still shows)."""
    before = torch._C._get_warnAlways()
    torch._C._set_warnAlways(True)
    yield
    torch._C._set_warnAlways(before)


def test_no_warning_from_fp4fuse_tracing_a_bf16_model_with_fp32_norm_weights(torch_warns_every_time):
    """F.rms_norm with bf16 activations and fp32 weights: tracing the model itself warns (the
    user's call), fp4fuse's pattern registration and replacement tracing must not."""
    with FakeTensorMode():
        args = [torch.empty(8, 64, dtype=torch.bfloat16) for _ in range(3)] + [torch.empty(64) for _ in range(3)]
    with warnings.catch_warnings(record=True) as user_side:
        warnings.simplefilter("always")
        gm = as_model_state(aot_trace(three_layers(torch_functional_norm), args), NORM_WEIGHTS)
    assert any("Mismatch dtype between input and weight" in str(w.message) for w in user_side)

    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        sp(gm.graph)
    assert {k: v for k, v in sp.match_counts.items() if ".torch_functional" in k} == {
        "sequence_parallel.first.torch_functional": 1, "sequence_parallel.middle.torch_functional": 1,
        "sequence_parallel.last.torch_functional": 1}
