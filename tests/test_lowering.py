"""KernelLoweringPass: fp4fuse op calls on CUDA become their Triton launches in the compiled graph.

CPU: op calls stay (their reference kernels), ``shard_rows`` becomes a slice at the rank's offset.
CUDA: the compiled code launches fp4fuse's kernels itself (no ``torch.ops.fp4fuse`` call left) and
computes what the eager ops compute, bit for bit (the same launches, traced from the same
functions)."""
from __future__ import annotations

import pytest
import torch
from torch._inductor.pattern_matcher import fwd_only
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

import fp4fuse
from fp4fuse.config import FusionConfig
from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.passes.lowering import KernelLoweringPass

fp4 = torch.ops.fp4fuse


def _quantized(rows: int, k: int, gen: torch.Generator, device: str) -> tuple[torch.Tensor, ...]:
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen).add(0.1)
    gs = nvfp4.global_scale_from_amax(x.abs().amax()).reshape(1)
    q, s = nvfp4.quantize_reference(x, gs)
    return q.to(device), s.to(device), gs.to(device)


def test_cpu_op_calls_stay_and_shard_rows_becomes_the_rank_slice(fake_group):
    def fn(x, res, w):
        out = fp4.rms_norm(x, w, 1e-6)
        return out, fp4.shard_rows(res, fake_group)

    with FakeTensorMode() as mode:
        inputs = [mode.from_tensor(torch.empty(6, 32)), mode.from_tensor(torch.empty(6, 32)),
                  mode.from_tensor(torch.empty(32))]
        gm = fwd_only(fn, inputs)
    lowering = KernelLoweringPass(FusionConfig())
    assert lowering(gm.graph) == 1 and lowering.match_counts == {"lowering.shard_rows": 1}
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert fp4.rms_norm.default in targets and fp4.shard_rows.default not in targets
    (slice_node,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.slice.Tensor]
    assert slice_node.args[1:] == (0, 0, 3)  # the fake group's rank is 0 of 2
    x, res, w = torch.randn(6, 32), torch.randn(6, 32), torch.rand(32) + 0.5
    out, shard = gm(x, res, w)
    assert torch.equal(shard, res[:3]) and torch.equal(out, fp4.rms_norm(x, w, 1e-6))
    assert KernelLoweringPass.reads_process_groups


def _ops_graph(a, b, sa, sb, alpha, x, r, w, gs):
    out16 = fp4.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16)
    out32 = fp4.mm_fp4(a, b, sa, sb, alpha, torch.float32)
    normed, summed = fp4.fused_add_rms_norm(x, r, w, 1e-5)
    q, s = fp4.scaled_fp4_quant(fp4.rms_norm(normed, w, 1e-6), gs)
    return out16, out32, summed, q, s


def _cuda_ops_graph_args(m: int, n: int = 96, k: int = 208) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(m)
    a, sa, ga = _quantized(m, k, gen, "cuda")
    b, sb, gb = _quantized(n, k, gen, "cuda")
    alpha = (1.0 / (ga * gb)).reshape(1)
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    r = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.rand(k, generator=gen) + 0.5).to("cuda", torch.bfloat16)
    gs = torch.tensor([7.5], device="cuda")
    return a, b, sa, sb, alpha, x, r, w, gs


#: What FusionPass does to one graph of ``_ops_graph``. The norm + quant pass turns rms_norm ->
#: scaled_fp4_quant (one static scale) into the fused op, whose one-kernel launch must give the two
#: eager ops' bits.
_OPS_GRAPH_COUNTS = {"lowering.mm_fp4": 2, "lowering.fused_add_rms_norm": 1, "norm_quant.rms_norm_fp4_quant": 1,
                     "lowering.rms_norm_fp4_quant": 1}


def _assert_bitwise_equal(eager: tuple, got: tuple) -> None:
    for e, g in zip(eager, got):
        assert g.dtype == e.dtype and torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                                                  e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e)


def _assert_lowered_and_bitwise_equal(fusion: fp4fuse.FusionPass, eager: tuple, got: tuple) -> None:
    assert fusion.match_counts == _OPS_GRAPH_COUNTS
    _assert_bitwise_equal(eager, got)


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(3, 96, 208), (5, 4096, 4096), (17, 96, 208), (200, 96, 208), (300, 96, 208)])
def test_cuda_compiled_graph_launches_kernels_and_matches_the_eager_ops(m, n, k):
    """m = 3, 17: the decode GEMM with the activation decoded in the kernel; 5 x 4096 x 4096: the same
    on its 256-element K steps, where the eager call loads the activation's scales as words and the
    traced one cannot (mm_decode, ``scale_words``); 200: pre-decoded; 300: the bf16 GEMM through
    dequantize + cuBLAS (fp32 through the tiled kernel)."""
    torch._dynamo.reset()
    args = _cuda_ops_graph_args(m, n, k)
    eager = _ops_graph(*args)
    fusion = fp4fuse.FusionPass(FusionConfig())
    compiled = torch.compile(_ops_graph, fullgraph=True, options={"post_grad_custom_post_pass": fusion})
    got, (code, *_) = run_and_get_code(compiled, *args)
    assert "torch.ops.fp4fuse" not in code and "fp4fuse.mm_fp4" not in code
    _assert_lowered_and_bitwise_equal(fusion, eager, got)


@pytest.mark.cuda
def test_cuda_dynamic_batch_is_lowered_and_bitwise_the_eager_ops_in_every_range():
    """A dynamic row count (``mark_dynamic``) is lowered too: one graph per range of the launchers'
    choices (up to 16, 32, 64, 128, 256 rows, above), each compiled at its first count, reused for
    the others of its range, and bitwise the eager ops at every count. A graph that served a count
    outside its range would launch another configuration (or a grid too small for the rows) and
    fail the comparison."""
    torch._dynamo.reset()
    fusion = fp4fuse.FusionPass(FusionConfig())
    compiled = torch.compile(_ops_graph, options={"post_grad_custom_post_pass": fusion})
    compiled_at = []
    for m in (5, 12, 20, 100, 200, 130, 300, 701):
        args = _cuda_ops_graph_args(m)
        a, _, sa, _, _, x, r, *_ = args
        for t in (a, sa, x, r):
            torch._dynamo.mark_dynamic(t, 0)
        eager = _ops_graph(*args)
        graphs_before = fusion.match_counts["lowering.mm_fp4"] // _OPS_GRAPH_COUNTS["lowering.mm_fp4"]
        got = compiled(*args)
        _assert_bitwise_equal(eager, got)
        graphs = fusion.match_counts["lowering.mm_fp4"] // _OPS_GRAPH_COUNTS["lowering.mm_fp4"]
        if graphs > graphs_before:  # a compile (the pass's counts add up over graphs): every op lowered
            compiled_at.append(m)
            assert fusion.match_counts == {key: graphs * count for key, count in _OPS_GRAPH_COUNTS.items()}
    assert compiled_at == [5, 20, 100, 200, 300]


@pytest.mark.cuda
@pytest.mark.parametrize("m", [17, 300])
def test_cuda_cpp_wrapper_runs_the_lowered_kernels_bitwise(m):
    """Inductor's C++ wrapper (README, Troubleshooting: less host time without CUDA graphs) launches
    the lowered kernels and gives the eager ops' bits."""
    torch._dynamo.reset()
    args = _cuda_ops_graph_args(m)
    eager = _ops_graph(*args)
    fusion = fp4fuse.FusionPass(FusionConfig())
    compiled = torch.compile(_ops_graph, fullgraph=True,
                             options={"cpp_wrapper": True, "post_grad_custom_post_pass": fusion})
    _assert_lowered_and_bitwise_equal(fusion, eager, compiled(*args))


@pytest.fixture
def triton_cuda_target(monkeypatch):
    """The lowering pass told its tensors are on a Triton CUDA device, and Triton's frontend given a
    CUDA target, so that torch's analysis of which tensors a kernel writes (Triton IR, no GPU
    needed) runs on a CPU machine; without a target it assumes every argument is written."""
    import triton
    from triton.backends.compiler import GPUTarget

    import fp4fuse.passes.lowering as lowering
    from fp4fuse.ops.backend import Backend

    class _Target:
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(lowering, "_on_cuda", lambda node: True)
    monkeypatch.setattr(lowering, "backend_for", lambda t: Backend.TRITON)
    if not torch.cuda.is_available():
        monkeypatch.setattr(triton.runtime.driver, "_active", _Target())


def _mm_norm_quant(_rows, a, b, sa, sb, alpha, x, w, gs):
    out = fp4.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16)
    q, s = fp4.scaled_fp4_quant(fp4.rms_norm(x, w, 1e-6), gs)
    return out, q, s


def _dynamic_rows_graph(rows_hint: int, n: int = 48, k: int = 64):
    """``_mm_norm_quant`` the way Dynamo hands a graph with a dynamic batch to Inductor: the row
    count a symbolic size (its hint ``rows_hint``) of every activation, the weights static."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fp4fuse.patterns.base import aot_trace

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.empty(rows_hint, k, dtype=torch.bfloat16), symbolic_context=ctx)
    rows = x.shape[0]
    with mode:
        a = x.new_empty(rows, k // 2, dtype=torch.uint8)
        sa = x.new_empty(rows, k // 16, dtype=torch.float8_e4m3fn)
        b = torch.empty(n, k // 2, dtype=torch.uint8)
        sb = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn)
        alpha, gs, w = torch.empty(1), torch.empty(1), torch.empty(k, dtype=torch.bfloat16)
    gm = aot_trace(_mm_norm_quant, [rows, a, b, sa, sb, alpha, x, w, gs])
    return shape_env, str(rows.node.expr), gm


@pytest.mark.parametrize("rows_hint,guards,gemm", [
    (5, {"s <= 256", "s <= 16"}, "decode"),
    (20, {"s <= 256", "s > 16", "s <= 32"}, "decode"),
    (100, {"s <= 256", "s > 16", "s > 32", "s > 64", "s <= 128"}, "predecode"),
    (300, {"s > 256", "4*s <= 2146435072"}, "dequantize + cuBLAS"),
])
def test_dynamic_row_count_is_lowered_under_the_guards_of_its_range(triton_cuda_target, rows_hint, guards, gemm):
    """A dynamic batch is lowered: the launchers' choices on the row count become guards on the
    range of its size hint (``mm_decode.config_rows``: the graph then serves only counts that make
    the same choices; others recompile), and the grids and allocations stay symbolic. The norm
    chooses nothing by rows; the quantization only checks its int32 block index (``4*s``: blocks
    of 16 in 64 columns), implied by the GEMM's guards up to 256 rows."""
    shape_env, symbol, gm = _dynamic_rows_graph(rows_hint)
    lowering = KernelLoweringPass(FusionConfig())
    assert lowering(gm.graph) == 3, [s.reason for s in lowering.skips]
    assert lowering.match_counts == {"lowering.mm_fp4": 1, "lowering.rms_norm": 1, "lowering.scaled_fp4_quant": 1}
    assert {str(g.expr).replace(str(symbol), "s") for g in shape_env.guards} == guards
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if str(t).startswith("fp4fuse.")]
    launches = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    kernels = [n.kwargs["kwargs"] for n in launches]
    assert (torch.ops.aten.mm.default in targets) == (gemm == "dequantize + cuBLAS")
    assert any("PREDECODED" in k and k["PREDECODED"] for k in kernels) == (gemm == "predecode")
    grids = [n.kwargs["grid"] for n in launches]
    # every launch covers the activation's rows (cuBLAS path: one launch dequantizes it and the weight)
    assert all(isinstance(grid[0][0], torch.fx.Node) for grid in grids), grids


def test_other_dynamic_sizes_keep_the_op_call(triton_cuda_target):
    """A dynamic size other than the row count (here every size is symbolic) would change the tile
    shapes: the op call stays, and the skip names the size and the rule. No guard is added."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(a, b, sa, sb, alpha):
        return fp4.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16)

    gen = torch.Generator().manual_seed(0)
    a, sa, ga = _quantized(6, 32, gen, "cpu")
    b, sb, gb = _quantized(5, 32, gen, "cpu")
    gm = make_fx(fn, tracing_mode="symbolic")(a, b, sa, sb, (1.0 / (ga * gb)).reshape(1))
    shape_env = torch._guards.detect_fake_mode([n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]).shape_env
    guards_before = len(shape_env.guards)
    lowering_pass = KernelLoweringPass(FusionConfig())
    assert lowering_pass(gm.graph) == 0
    (reason,) = [s.reason for s in lowering_pass.skips]
    assert "in dim 1" in reason and "only a dynamic row count (dim 0) is lowered" in reason
    assert any(n.target is fp4.mm_fp4.default for n in gm.graph.nodes)
    assert len(shape_env.guards) == guards_before
