"""FusionPass: pipeline order, uuid / FX graph cache, counts and logging, no-op view cleanup, and a
real 2-rank gloo compile whose fused output equals the eager unfused output bit for bit."""
from __future__ import annotations

import collections
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import fwd_only
from torch._subclasses.fake_tensor import FakeTensorMode

import fp4fuse
from dist_utils import run_on_ranks
from fp4fuse.config import FusionConfig
from fp4fuse.passes import FusionPass, GraphPass, process_group_fingerprint
from fp4fuse.passes.cleanup import NoOpViewCleanupPass

W, M, K, N = 2, 8, 64, 32
U8, F8, BF16 = torch.uint8, torch.float8_e4m3fn, torch.bfloat16
fc = torch.ops._c10d_functional
fp4 = torch.ops.fp4fuse
PACKAGE = Path(fp4fuse.__file__).resolve().parent


# a 2-rank fake process group (tests/conftest.py): graphs with collectives trace without ranks
pytestmark = pytest.mark.usefixtures("fake_group")


def ag_mm_rs_of(q, s, b, bs, alpha, q_rs, s_rs):
    """A gathered GEMM of the shard ``(q, s)`` and a reduce-scattered GEMM of ``(q_rs, s_rs)``:
    one rewrite of each AsyncTP family."""
    group = dist.group.WORLD.group_name
    qa = fc.wait_tensor(fc.all_gather_into_tensor(q, W, group))
    sa = fc.wait_tensor(fc.all_gather_into_tensor(s.view(U8), W, group)).view(F8)
    gathered = fp4.mm_fp4(qa, b, sa, bs, alpha, BF16)
    partial = fp4.mm_fp4(q_rs, b, s_rs, bs, alpha, BF16)
    return gathered, fc.wait_tensor(fc.reduce_scatter_tensor(partial, "sum", W, group))


def ag_mm_rs(q, s, b, bs, alpha):
    """:func:`ag_mm_rs_of` with the shard itself reduce-scattered."""
    return ag_mm_rs_of(q, s, b, bs, alpha, q, s)


def real_inputs(rows: int = M) -> list[torch.Tensor]:
    return [torch.zeros(rows, K // 2, dtype=U8), torch.zeros(rows, K // 16, dtype=F8),
            torch.zeros(N, K // 2, dtype=U8), torch.zeros(N, K // 16, dtype=F8), torch.ones(1)]


def traced(fn=ag_mm_rs) -> torch.fx.GraphModule:
    with FakeTensorMode() as mode:
        return fwd_only(fn, [mode.from_tensor(t) for t in real_inputs()])


BOTH = {"async_tp.all_gather_mm_fp4": 1, "async_tp.mm_fp4_reduce_scatter": 1}


# --------------------------------------------------------------------------- pipeline


def test_is_a_custom_graph_pass_with_documented_order():
    assert isinstance(FusionPass(), CustomGraphPass)
    assert FusionPass().pass_names == ["cleanup", "all_reduce", "cse", "norm_quant", "lowering"]
    unfused = FusionConfig(lower_kernels=False, enable_norm_quant_fusion=False, enable_symm_all_reduce=False)
    assert FusionPass(unfused).pass_names == ["cleanup", "cse"]
    assert FusionPass(FusionConfig(enable_sequence_parallelism=True)).pass_names == [
        "cleanup", "sequence_parallel", "all_reduce", "cse", "norm_quant", "lowering"]
    assert FusionPass(FusionConfig(enable_async_tp=True)).pass_names == [
        "cleanup", "sequence_parallel", "async_tp", "all_reduce", "cse", "norm_quant", "lowering"]


def test_counts_cumulative_and_last_and_one_summary_line(caplog):
    caplog.set_level(logging.INFO, logger="fp4fuse.passes")
    fusion = FusionPass(FusionConfig(enable_async_tp=True))
    for call in (1, 2):
        gm = traced()
        fusion(gm.graph)
        gm.graph.lint()
        assert fusion.last_match_counts == BOTH and fusion.calls == call
        assert fusion.match_counts == {k: call * v for k, v in BOTH.items()}
    summaries = [r for r in caplog.records if r.name == "fp4fuse.passes.manager"]
    assert len(summaries) == 2 and all(r.levelno == logging.INFO for r in summaries)
    assert summaries[0].getMessage() == ("fp4fuse: replaced 2 patterns: async_tp.all_gather_mm_fp4=1, "
                                         "async_tp.mm_fp4_reduce_scatter=1 (0 skipped, 0 no-op views removed, "
                                         "0 all-reduces through symmetric memory, 0 repeated computations merged, 0 op calls lowered to kernels)")


def test_disabled_pipeline_leaves_graph_alone(caplog):
    caplog.set_level(logging.INFO, logger="fp4fuse.passes")
    gm = traced()
    code = gm.code
    fusion = FusionPass()
    fusion(gm.graph)
    gm.recompile()
    assert gm.code == code and fusion.last_match_counts == {}
    assert caplog.records[-1].getMessage() == ("fp4fuse: replaced 0 patterns (0 skipped, 0 no-op views removed, "
                                               "0 all-reduces through symmetric memory, 0 repeated computations merged, 0 op calls lowered to kernels)")


# --------------------------------------------------------------------------- uuid and the FX cache


def test_uuid_stable_and_config_sensitive():
    base = FusionPass(FusionConfig(enable_async_tp=True)).uuid()
    assert base == FusionPass(FusionConfig(enable_async_tp=True)).uuid()
    assert base == FusionPass(FusionConfig(enable_async_tp=True, log_level="DEBUG")).uuid()
    others = [FusionPass(c).uuid() for c in (
        FusionConfig(), FusionConfig(enable_sequence_parallelism=True), FusionConfig(lower_kernels=False),
        FusionConfig(enable_async_tp=True, min_tokens=1), FusionConfig(enable_bf16_async_tp=True))]
    assert len({base, *others}) == 6


def test_uuid_covers_the_switches_the_passes_read_while_compiling(monkeypatch):
    """``FP4FUSE_OVERLAP_MIN_ROWS`` (the collective GEMMs' and sequence parallelism's thresholds),
    ``FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES`` (the all-reduce rewrite's size rule), ``FP4FUSE_BACKEND``
    and ``FP4FUSE_DISABLE_GLUON`` (which kernels a lowered call takes) decide what a compiled graph
    holds: a warm FX graph cache must not serve a graph compiled under other values. A switch only
    the ops read at run time (``FP4FUSE_AG_SCHEDULE``) leaves the uuid alone."""
    compiled = ("FP4FUSE_OVERLAP_MIN_ROWS", "FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES", "FP4FUSE_BACKEND",
                "FP4FUSE_DISABLE_GLUON")
    for var in (*compiled, "FP4FUSE_AG_SCHEDULE"):
        monkeypatch.delenv(var, raising=False)
    fusion = FusionPass(FusionConfig(enable_async_tp=True))
    base = fusion.uuid()
    changed = {}
    for var, value in (("FP4FUSE_OVERLAP_MIN_ROWS", "0"), ("FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES", "4096"),
                       ("FP4FUSE_BACKEND", "reference"), ("FP4FUSE_DISABLE_GLUON", "1"),
                       ("FP4FUSE_AG_SCHEDULE", "per-shard")):
        monkeypatch.setenv(var, value)
        changed[var] = fusion.uuid()
        monkeypatch.delenv(var)
    assert fusion.uuid() == base
    assert len({base, *(changed[var] for var in compiled)}) == 1 + len(compiled)
    assert changed["FP4FUSE_AG_SCHEDULE"] == base


def _module_of(module: str, name: str) -> str:
    """The module ``from module import name`` reads: ``module.name`` where that is a submodule."""
    import importlib.util

    try:
        return f"{module}.{name}" if importlib.util.find_spec(f"{module}.{name}") else module
    except ModuleNotFoundError:  # module is not a package
        return module


def test_every_pass_hashes_the_rewrite_modules_it_imports():
    """A pass's uuid (Inductor's FX-cache key) covers every fp4fuse pattern or pass module its own
    module imports: those decide the graphs it writes, and one left out would let the cache serve a
    graph a changed matcher would not write (the lowering's ``dynamic_scale`` matcher, say)."""
    import ast
    import importlib

    for graph_pass in FusionPass(FusionConfig(enable_async_tp=True, enable_bf16_async_tp=True)).passes:
        module = importlib.import_module(type(graph_pass).__module__)
        tree = ast.parse(Path(module.__file__).read_text())
        imported = set()
        for node in tree.body:
            rewrites = ("fp4fuse.passes", "fp4fuse.patterns")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(rewrites):
                for alias in node.names:
                    imported.add(_module_of(node.module, alias.name))
        files = set(map(Path, graph_pass.source_files()))
        for name in imported:
            path = Path(importlib.util.find_spec(name).origin)
            if path.name != "__init__.py":
                assert path in files, f"{graph_pass.name}: {name} is not in its uuid's sources"


def test_uuid_covers_every_module_of_the_package(tmp_path, monkeypatch):
    """The passes trace and decide with code no pass imports directly (the collective GEMMs'
    thresholds in ``distributed/symm_mem/policy.py``, the row gather of ``distributed/groups.py``,
    the launchers' tracing switch): a change to any module of the package -- an upgrade, with the
    cache directory kept -- changes the uuid, here on a copy of the package."""
    import shutil

    from fp4fuse.passes import manager

    installed = manager.package_sources_digest()
    copy = tmp_path / "fp4fuse"
    shutil.copytree(manager.PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert manager.package_sources_digest(copy) == installed
    fusion = FusionPass(FusionConfig())
    before = fusion.uuid()
    monkeypatch.setattr(manager, "PACKAGE_ROOT", copy)
    assert fusion.uuid() == before  # an identical copy: the same key
    policy = copy / "distributed" / "symm_mem" / "policy.py"
    policy.write_text(policy.read_text() + "\n# another threshold\n")
    assert manager.package_sources_digest() != installed
    assert fusion.uuid() != before


def test_uuid_is_composed_of_each_pass_uuid_over_its_patterns_and_ops(tmp_path, monkeypatch):
    fusion = FusionPass(FusionConfig(enable_async_tp=True))
    files = {p.name: set(map(Path, p.source_files())) for p in fusion.passes}
    assert {PACKAGE / "patterns" / "async_tp_fp4.py", PACKAGE / "patterns" / "collectives.py",
            PACKAGE / "ops" / "collective_ops.py", PACKAGE / "passes" / "async_tp.py"} <= files["async_tp"]
    assert {PACKAGE / "patterns" / "sequence_parallel.py", PACKAGE / "patterns" / "quant_before_gather.py",
            PACKAGE / "ops" / "sp_ops.py", PACKAGE / "passes" / "base.py"} <= files["sequence_parallel"]
    # the launchers the lowering traces: their configuration choices decide the graph
    triton_dir = PACKAGE / "kernels" / "triton"
    assert {triton_dir / "alpha.py", triton_dir / "mm.py", triton_dir / "mm_decode.py", triton_dir / "quant.py"} <= files["lowering"]
    async_tp = fusion.passes[-1]
    extra = tmp_path / "extra_pattern.py"
    extra.write_text("A = 1\n")
    monkeypatch.setattr(type(async_tp), "source_files", lambda self: [str(extra)])
    before, pass_before = fusion.uuid(), async_tp.uuid()
    extra.write_text("A = 2\n")
    assert async_tp.uuid() != pass_before and fusion.uuid() != before


class _ReadsGroups(GraphPass):
    name = "reads_groups"
    reads_process_groups = True

    def __call__(self, graph: torch.fx.Graph) -> int:
        return 0


def test_process_group_layout_in_uuid_only_for_passes_that_read_it():
    assert process_group_fingerprint() == {"rank": 0, "world_size": W, "groups": [("0", W, [0, 1])]}
    plain = FusionPass(FusionConfig(lower_kernels=False, enable_symm_all_reduce=False))
    reading = FusionPass(FusionConfig(lower_kernels=False, enable_symm_all_reduce=False))
    reading.passes.append(_ReadsGroups(reading.config))
    plain_uuid, reading_uuid = plain.uuid(), reading.uuid()
    dist.new_group([0, 1])
    assert plain.uuid() == plain_uuid
    assert reading.uuid() != reading_uuid


def _compile_and_run(fusion: FusionPass) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(ag_mm_rs, fullgraph=True, options={"post_grad_custom_post_pass": fusion})
    compiled(*real_inputs())


def test_fx_graph_cache_hit_in_fresh_dynamo_state_and_miss_under_other_config():
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        counters.clear()
        first = FusionPass(FusionConfig(enable_async_tp=True))
        _compile_and_run(first)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1 and first.last_match_counts == BOTH

        counters.clear()
        same = FusionPass(FusionConfig(enable_async_tp=True))
        _compile_and_run(same)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1 and counters["inductor"]["fxgraph_cache_miss"] == 0
        assert same.calls == 0  # served from the cache: the passes did not run again

        counters.clear()
        other = FusionPass(FusionConfig(enable_async_tp=True, min_tokens=10 ** 6))
        assert other.uuid() != first.uuid()
        _compile_and_run(other)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1 and counters["inductor"]["fxgraph_cache_hit"] == 0
        assert other.last_match_counts == {}
        assert sorted(s.key for s in other.last_skips) == sorted(BOTH)
        assert all("below min_tokens=1000000" in s.reason for s in other.last_skips)


class _Signed(torch.nn.Module):
    """One module class whose instances differ only in a Python attribute the forward branches on."""

    def __init__(self, negate: bool) -> None:
        super().__init__()
        self.negate = negate
        self.weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return -y if self.negate else y


def test_each_fusion_pass_keeps_its_model_apart_without_module_guards():
    """README "Use", Guards: without Dynamo's module guards (``skip_guard_on_all_nn_modules_unsafe``)
    two models of one class compiled with equal options share a compiled graph. Each model given its
    own FusionPass compiles with options of its own (a FusionPass is equal only to itself), so the
    second model runs its own graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    first, second = _Signed(negate=False), _Signed(negate=True)

    def compiled(model):
        return torch.compile(model, options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                                             "post_grad_custom_post_pass": FusionPass(FusionConfig())})

    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(first)(x), x @ first.weight, rtol=0, atol=0)
        torch.testing.assert_close(compiled(second)(x), -(x @ second.weight), rtol=0, atol=0)
    assert FusionPass(FusionConfig()) != FusionPass(FusionConfig())


# --------------------------------------------------------------------------- cleanup


def test_cleanup_removes_round_trip_views_but_keeps_outputs():
    def fn(q, s, b, bs, alpha):
        s_rt = s.view(U8).view(F8)
        q_rt = q.view(2, -1).view(M, K // 2)
        return fp4.mm_fp4(q_rt, b, s_rt, bs, alpha, BF16), s.view(U8).view(F8)

    gm = traced(fn)
    ops = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    assert ops["aten.view.dtype"] == 4 and ops["aten.view.default"] == 2
    cleanup = NoOpViewCleanupPass(FusionConfig())
    assert cleanup(gm.graph) == 2 and cleanup.match_counts == {"cleanup.noop_view": 2}
    gm.graph.lint()
    mm = next(n for n in gm.graph.nodes if n.target == fp4.mm_fp4.default)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert mm.args[0] is placeholders[0] and mm.args[2] is placeholders[1]
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0][1]
    assert output.target == torch.ops.aten.view.dtype  # a graph output keeps its own node


# --------------------------------------------------------------------------- real ranks


def _nvfp4(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fp4.scaled_fp4_quant(x.contiguous(), gs)


def _fused_equals_eager_on_rank() -> dict:
    """gloo rank: the same tiny graph eager (unfused) and compiled with FusionPass."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1234 + rank)
    gs = torch.tensor([448.0 * 6.0 / 4.0])  # one global scale for every rank: amax bound 4
    x = torch.randn(M // W, K, generator=gen).clamp(-4, 4).to(BF16)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(99)).clamp(-4, 4).to(BF16)
    x_full = torch.randn(M, K, generator=gen).clamp(-4, 4).to(BF16)
    (q, s), (b, bs), (qf, sf) = _nvfp4(x, gs), _nvfp4(w, gs), _nvfp4(x_full, gs)
    alpha = 1.0 / (gs * gs)

    args = (q, s, b, bs, alpha, qf, sf)
    eager = ag_mm_rs_of(*args)
    fusion = FusionPass(FusionConfig(enable_async_tp=True))
    torch._inductor.config.force_disable_caches = True  # a fresh process per rank: the passes must run
    compiled = torch.compile(ag_mm_rs_of, fullgraph=True, options={"post_grad_custom_post_pass": fusion})
    fused = compiled(*args)
    return {"equal": [torch.equal(e, f) for e, f in zip(eager, fused, strict=True)],
            "shapes": [tuple(f.shape) for f in fused], "counts": dict(fusion.match_counts),
            "nonzero": bool(eager[0].abs().sum() > 0)}


def test_two_gloo_ranks_fused_output_equals_eager_bitwise():
    results = run_on_ranks(_fused_equals_eager_on_rank, W, timeout=300)
    for r in results:
        assert r["counts"] == BOTH
        assert r["shapes"] == [(M, N), (M // W, N)]
        assert r["equal"] == [True, True] and r["nonzero"]


def test_log_level_applies_to_the_fp4fuse_logger():
    root = logging.getLogger("fp4fuse")
    saved = root.level
    try:
        FusionPass(FusionConfig(log_level="DEBUG"))
        assert root.level == logging.DEBUG
        root.setLevel(logging.WARNING)
        FusionPass(FusionConfig())
        assert root.level == logging.WARNING  # None leaves logging configuration alone
    finally:
        root.setLevel(saved)
