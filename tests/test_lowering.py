"""KernelLoweringPass: fp4fuse op calls on CUDA become their Triton launches in the compiled graph.

CPU: op calls stay (their reference kernels), ``shard_rows`` becomes a slice at the rank's offset.
CUDA: the compiled code launches fp4fuse's kernels itself (no ``torch.ops.fp4fuse`` call left) and
computes what the eager ops compute, bit for bit (the same launches, traced from the same
functions)."""
from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from torch._inductor.pattern_matcher import fwd_only
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

import fp4fuse
from fp4fuse.config import FusionConfig
from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.nvfp4.quantizer import NVFP4Quantizer
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


def _assert_lowered_and_bitwise_equal(fusion: fp4fuse.FusionPass, eager: tuple, got: tuple,
                                      shared_counters: int = 0) -> None:
    shared = {"lowering.split_k_counters_shared": shared_counters} if shared_counters else {}
    assert fusion.match_counts == {**_OPS_GRAPH_COUNTS, **shared}
    _assert_bitwise_equal(eager, got)


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(3, 96, 208), (5, 4096, 4096), (17, 96, 208), (200, 96, 208), (300, 96, 208)])
def test_cuda_compiled_graph_launches_kernels_and_matches_the_eager_ops(m, n, k):
    """m = 3, 17: the decode GEMM with the activation decoded in the kernel; 5 x 4096 x 4096: the same
    on its 256-element K steps, where the eager call loads the activation's scales as words and the
    traced one cannot (mm_decode, ``scale_words``), and where both GEMMs split K and so share one
    zeroed counters buffer (K = 208 is at most 2 K steps: no split); 200: pre-decoded; 300: the bf16
    GEMM through dequantize + cuBLAS (fp32 through the tiled kernel)."""
    torch._dynamo.reset()
    args = _cuda_ops_graph_args(m, n, k)
    eager = _ops_graph(*args)
    fusion = fp4fuse.FusionPass(FusionConfig())
    compiled = torch.compile(_ops_graph, fullgraph=True, options={"post_grad_custom_post_pass": fusion})
    got, (code, *_) = run_and_get_code(compiled, *args)
    assert "torch.ops.fp4fuse" not in code and "fp4fuse.mm_fp4" not in code
    _assert_lowered_and_bitwise_equal(fusion, eager, got, shared_counters=int(k == 4096))


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


@pytest.fixture
def predecoded_mid_rows(monkeypatch):
    """65-128 rows of the tests' small weights pre-decoded, as larger weights are
    (``mm_decode.MID_INKERNEL_MAX_WEIGHT`` 0; the in-kernel decode serves them otherwise), so that
    both paths of that range are lowered at 100 rows."""
    from fp4fuse.kernels.triton import mm_decode

    monkeypatch.setattr(mm_decode, "MID_INKERNEL_MAX_WEIGHT", 0)
    mm_decode.decode_config_for.cache_clear()
    yield
    mm_decode.decode_config_for.cache_clear()


@pytest.mark.parametrize("rows_hint,guards,gemm", [
    (5, {"s <= 256", "s <= 16"}, "decode"),
    (20, {"s <= 256", "s > 16", "s <= 32"}, "decode"),
    (100, {"s <= 256", "s > 16", "s > 32", "s > 64", "s <= 128"}, "decode"),
    (100, {"s <= 256", "s > 16", "s > 32", "s > 64", "s <= 128"}, "predecode"),
    (300, {"s > 256", "4*s <= 2146435072"}, "dequantize + cuBLAS"),
])
def test_dynamic_row_count_is_lowered_under_the_guards_of_its_range(triton_cuda_target, request, rows_hint, guards,
                                                                     gemm):
    """A dynamic batch is lowered: the launchers' choices on the row count become guards on the
    range of its size hint (``mm_decode.config_rows``: the graph then serves only counts that make
    the same choices; others recompile), and the grids and allocations stay symbolic. The norm
    chooses nothing by rows; the quantization only checks its int32 block index (``4*s``: blocks
    of 16 in 64 columns), implied by the GEMM's guards up to 256 rows. At 100 rows both paths of the
    range: the activation decoded in the GEMM (small weights) and pre-decoded."""
    if gemm == "predecode":
        request.getfixturevalue("predecoded_mid_rows")
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


@pytest.mark.parametrize("rows_hint,autotune,lowered", [
    (300, {"max_autotune": True}, False),
    (300, {"max_autotune_gemm": True}, False),
    (300, {"max_autotune": True, "max_autotune_gemm_backends": "ATEN"}, True),
    (100, {"max_autotune": True}, True),
    (300, {}, True),
])
def test_gemm_autotuning_keeps_the_dequantize_cublas_product_an_op_call(triton_cuda_target, rows_hint, autotune,
                                                                         lowered):
    """Above 256 rows a bf16 product may be dequantize + cuBLAS, whose traced ``aten.mm`` Inductor's
    GEMM autotuning could compile as a Triton template (other bits than the op's cuBLAS call): under
    autotuning with a backend besides ATen the call stays, with the reason; below, the row-range
    guards keep the graph off that path, and it is lowered."""
    _, _, gm = _dynamic_rows_graph(rows_hint)
    lowering = KernelLoweringPass(FusionConfig())
    with torch._inductor.config.patch(autotune):
        lowering(gm.graph)
    assert lowering.match_counts.get("lowering.mm_fp4", 0) == int(lowered)
    assert lowering.match_counts["lowering.scaled_fp4_quant"] == 1
    reasons = [s.reason for s in lowering.skips]
    assert any("max_autotune" in r for r in reasons) == (not lowered), reasons
    mm_calls = gm.graph.find_nodes(op="call_function", target=torch.ops.fp4fuse.mm_fp4.default)
    assert len(mm_calls) == int(not lowered)


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


def test_a_gemm_the_hopper_kernel_serves_becomes_its_decode_launch_and_launch_op(triton_cuda_target, monkeypatch):
    """Where ``mm_fp4_triton`` would launch the Hopper Gluon GEMM (whose TMA descriptors Inductor
    cannot build), the lowering traces the activation's decode as a Triton launch and the Gluon
    launch as one call of the internal op ``fp4fuse::_mm_fp4_hopper`` (which checks the weight's
    alignment per call, as the eager op does); no ``mm_fp4`` call is left. (On this CPU machine the
    fake tensors are not on an sm_90 GPU, so the kernel module's own answer is forced;
    tests/test_mm_hopper.py runs the GPU side, bitwise against the eager op.)"""
    pytest.importorskip("fp4fuse.kernels.triton.mm_hopper")  # needs Triton's Gluon
    from fp4fuse.kernels.triton import mm as triton_mm

    seen = []
    monkeypatch.setattr(triton_mm, "hopper_serves", lambda m, n, k, out_dtype, device: seen.append((m, n, k)) or True)
    _, _, gm = _dynamic_rows_graph(300)
    lowering = KernelLoweringPass(FusionConfig())
    assert lowering(gm.graph) == 3, [s.reason for s in lowering.skips]
    assert lowering.match_counts == {"lowering.mm_fp4": 1, "lowering.rms_norm": 1, "lowering.scaled_fp4_quant": 1}
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert fp4.mm_fp4.default not in targets
    (launch,) = [n for n in gm.graph.nodes if n.target is torch.ops.fp4fuse._mm_fp4_hopper.default]
    a, a_scale, xlo, xhi, b = launch.args[:5]
    decode = xlo.args[0]  # getitem of the decode launch's outputs
    assert decode.target is torch.ops.higher_order.triton_kernel_wrapper_functional
    assert decode.kwargs["kwargs"]["q_ptr"] is a and decode.kwargs["kwargs"]["s_ptr"] is a_scale
    assert xhi.args[0] is decode
    assert launch.args[-1] == torch.bfloat16 and not launch.args[-3]  # alpha a graph input here: not folded
    assert {(n, k) for _, n, k in seen} == {(48, 64)}


def _static_graph(fn, *shapes_dtypes):
    with FakeTensorMode() as mode:
        inputs = [mode.from_tensor(torch.empty(shape, dtype=dtype)) for shape, dtype in shapes_dtypes]
        return fwd_only(fn, inputs)


_GEMM_OPERANDS = (((6, 32), torch.uint8), ((40, 32), torch.uint8), ((6, 4), torch.float8_e4m3fn),
                  ((40, 4), torch.float8_e4m3fn))


def _launch_of(gm) -> dict:
    (launch,) = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    return launch.kwargs["kwargs"]


@pytest.mark.parametrize("scale_shapes", [((1,), (1,)), ((), (1,))])
def test_alpha_of_two_global_scales_is_computed_in_the_gemm_epilogue(triton_cuda_target, scale_shapes):
    """``alpha = reciprocal(gs_a * gs_b)`` (how an NVFP4 linear forms it) is not a kernel of its own
    once lowered: the GEMM launch reads the two scales and computes it with the division Inductor
    would have generated; the graph's product and reciprocal are gone, one still read elsewhere stays."""
    from fp4fuse.passes.lowering import _inductor_divides_rn

    def fn(a, b, sa, sb, ga, gb):
        return fp4.mm_fp4(a, b, sa, sb, torch.reciprocal(ga * gb), torch.bfloat16)

    def fn_alpha_also_returned(a, b, sa, sb, ga, gb):
        alpha = torch.reciprocal(ga * gb)
        return fp4.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16), alpha

    scales = [(shape, torch.float32) for shape in scale_shapes]
    product_and_reciprocal = {torch.ops.aten.reciprocal.default, torch.ops.aten.mul.Tensor}
    for graph_fn, left in ((fn, set()), (fn_alpha_also_returned, product_and_reciprocal)):
        gm = _static_graph(graph_fn, *_GEMM_OPERANDS, *scales)
        lowering = KernelLoweringPass(FusionConfig())
        assert lowering(gm.graph) == 2
        assert lowering.match_counts == {"lowering.mm_fp4": 1, "lowering.alpha_from_global_scales": 1}
        targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        assert targets & product_and_reciprocal == left
        kwargs = _launch_of(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert (kwargs["alpha_ptr"], kwargs["alpha_b_ptr"]) == (placeholders[4], placeholders[5])
        assert kwargs["ALPHA_FROM_SCALES"] is True and kwargs["ALPHA_DIV_RN"] is _inductor_divides_rn()


@pytest.mark.parametrize("alpha_of", ["input", "scalar factor", "one factor"])
def test_other_alphas_are_read_as_they_are(triton_cuda_target, alpha_of):
    """An alpha that is not ``reciprocal`` of a product of exactly two one-element fp32 tensors is
    passed to the GEMM as the tensor it is."""
    def fn(a, b, sa, sb, ga, gb):
        alpha = {"input": lambda: ga, "scalar factor": lambda: torch.reciprocal(ga * 3.0),
                 "one factor": lambda: torch.reciprocal(ga)}[alpha_of]()
        return fp4.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16)

    gm = _static_graph(fn, *_GEMM_OPERANDS, ((1,), torch.float32), ((1,), torch.float32))
    lowering = KernelLoweringPass(FusionConfig())
    assert lowering(gm.graph) == 1 and lowering.match_counts == {"lowering.mm_fp4": 1}
    kwargs = _launch_of(gm)
    assert kwargs["ALPHA_FROM_SCALES"] is False and kwargs["alpha_ptr"] is kwargs["alpha_b_ptr"]


def _edge_and_random_scales(count: int, gen: torch.Generator) -> torch.Tensor:
    """``[count + 8, 2]`` fp32 pairs: random over 80 binades, then zero, inf, NaN, products that are
    subnormal or overflow, and exact powers of two."""
    pairs = torch.exp2(torch.rand(count, 2, generator=gen) * 80 - 40) * (1 + torch.rand(count, 2, generator=gen))
    edges = torch.tensor([[0.0, 3.0], [float("inf"), 2.0], [float("nan"), 1.0], [1e-30, 1e-15], [3e-39, 0.7],
                          [1e30, 1e15], [0.5, 4.0], [2688.0, 1 / 2688.0]])
    return torch.cat((pairs, edges)).cuda()


def _assert_same_bits_and_nans(got: torch.Tensor, want: torch.Tensor, what: Any) -> None:
    """Bitwise equal, except that a NaN need only be a NaN (its payload is not compared)."""
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[want.dtype]
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), what
    assert torch.equal(got.view(as_int)[~nan], want.view(as_int)[~nan]), what


@pytest.mark.cuda
def test_cuda_division_of_the_folded_alpha_is_inductors():
    """The epilogue's alpha (``load_alpha``) with the rounding the pass picks is bitwise what
    Inductor's generated code computes for ``reciprocal(x * y)``, and with IEEE rounding what eager
    computes, over 65536 random pairs and the edge values."""
    import triton
    import triton.language as tl

    from fp4fuse.kernels.triton.alpha import load_alpha
    from fp4fuse.passes.lowering import _inductor_divides_rn

    @triton.jit
    def probe(x_ptr, y_ptr, out_ptr, DIV_RN: tl.constexpr):
        i = tl.program_id(0)
        tl.store(out_ptr + i, load_alpha(x_ptr + i, y_ptr + i, True, DIV_RN))

    pairs = _edge_and_random_scales(65536, torch.Generator().manual_seed(0))
    x, y = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
    torch._dynamo.reset()
    references = {_inductor_divides_rn(): torch.compile(lambda x, y: torch.reciprocal(x * y))(x, y),
                  True: torch.reciprocal(x * y)}
    for div_rn, want in references.items():
        got = torch.empty_like(x)
        probe[(x.numel(),)](x, y, got, DIV_RN=div_rn)
        _assert_same_bits_and_nans(got, want, f"div_rn={div_rn}")


@pytest.mark.cuda
@pytest.mark.parametrize("m,out_dtype", [(5, torch.float32), (300, torch.bfloat16), (300, torch.float32)])
def test_cuda_alpha_from_global_scales_is_bitwise_the_graph_without_the_pass(m, out_dtype):
    """A linear's GEMM with ``alpha = reciprocal(gs_a * gs_b)`` in the graph, compiled with and
    without FusionPass: the lowered GEMM computes alpha in its epilogue (decode kernel; dequantize +
    cuBLAS and its scale kernel; tiled kernel) and gives the bits of Inductor's alpha kernel + op
    call, for random and edge-value scales, with no recompile between them."""
    def linear(a, b, sa, sb, ga, gb):
        return fp4.mm_fp4(a, b, sa, sb, torch.reciprocal(ga * gb), out_dtype)

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(m)
    a, sa, _ = _quantized(m, 208, gen, "cuda")
    b, sb, _ = _quantized(96, 208, gen, "cuda")
    fusion = fp4fuse.FusionPass(FusionConfig())
    lowered = torch.compile(linear, fullgraph=True, options={"post_grad_custom_post_pass": fusion})
    unlowered = torch.compile(linear, fullgraph=True)
    for ga, gb in _edge_and_random_scales(24, gen):
        ga, gb = ga.reshape(1).clone(), gb.reshape(1).clone()
        got, want = lowered(a, b, sa, sb, ga, gb), unlowered(a, b, sa, sb, ga, gb)
        _assert_same_bits_and_nans(got, want, (ga, gb))
    assert fusion.match_counts == {"lowering.mm_fp4": 1, "lowering.alpha_from_global_scales": 1}


def _kernels_launched(gm) -> list[tuple[str, dict]]:
    """(kernel name, launch kwargs) of every Triton launch in ``gm``, in graph order."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    launches = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    return [(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__, n.kwargs["kwargs"]) for n in launches]


def _qkv(x, ga, bq, sq, gq, bk, sk, gk, bv, sv, gv):
    """A decoder layer's q/k/v projections as NVFP4 linears form them: one quantized activation,
    each GEMM's alpha the reciprocal product of the activation's and its weight's global scale."""
    a, sa = fp4.scaled_fp4_quant(x, ga)
    return tuple(fp4.mm_fp4(a, b, sa, sb, torch.reciprocal(ga * gb), torch.bfloat16)
                 for b, sb, gb in ((bq, sq, gq), (bk, sk, gk), (bv, sv, gv)))


def _qkv_operands(rows: int, k: int = 64, ns: tuple[int, ...] = (96, 32, 32)) -> list[tuple]:
    scale = ((1,), torch.float32)
    activation = [((rows, k), torch.bfloat16), scale]
    return activation + [x for n in ns for x in (((n, k // 2), torch.uint8), ((n, k // 16), torch.float8_e4m3fn),
                                                  scale)]


def test_sibling_gemms_of_one_activation_share_one_launch(triton_cuda_target):
    """q/k/v GEMMs on one activation: one launch of the grouped decode kernel (its weights, alphas
    and outputs per segment), each output read where its GEMM's was; the three alphas folded."""
    gm = _static_graph(_qkv, *_qkv_operands(6))
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    gm.graph.lint()  # every value defined before it is read
    assert lowering.match_counts == {"lowering.mm_fp4": 3, "lowering.alpha_from_global_scales": 3,
                                     "lowering.mm_fp4_siblings": 1, "lowering.scaled_fp4_quant": 1}
    ((name, kwargs),) = [k for k in _kernels_launched(gm) if k[0].startswith("_mm_decode")]
    assert name == "_mm_decode_group_kernel" and kwargs["SEGMENTS"] == 3 and kwargs["ALPHA_FROM_SCALES"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [kwargs[f"b{i}_ptr"] for i in range(3)] == placeholders[2::3]
    assert [kwargs[f"alb{i}_ptr"] for i in range(3)] == placeholders[4::3]
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    assert [out.args[1] for out in outputs] == ["out0_ptr", "out1_ptr", "out2_ptr"]  # the launch's, in order
    assert [tuple(out.meta["val"].shape) for out in outputs] == [(6, 96), (6, 32), (6, 32)]
    assert not [n for n in gm.graph.nodes if n.target is fp4.mm_fp4.default]


def test_sibling_gemms_above_the_decode_rows_dequantize_their_activation_once(triton_cuda_target):
    """q/k/v GEMMs of 300 rows (dequantize + cuBLAS): one launch dequantizes the activation and
    the three weights, three cuBLAS products, one launch applies the three alphas."""
    gm = _static_graph(_qkv, *_qkv_operands(300))
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    gm.graph.lint()
    assert lowering.match_counts["lowering.mm_fp4_siblings"] == 1
    launched = _kernels_launched(gm)
    assert [name for name, _ in launched] == ["_quant_kernel", "_dequant_group_kernel", "_scale_group_kernel"]
    assert launched[1][1]["SEGMENTS"] == 4 and launched[2][1]["SEGMENTS"] == 3 and launched[2][1]["ALPHA_FROM_SCALES"]
    assert len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default)) == 3
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    assert [tuple(out.meta["val"].shape) for out in outputs] == [(300, 96), (300, 32), (300, 32)]


def test_a_sibling_input_computed_later_moves_before_the_shared_launch(triton_cuda_target):
    """A factor of the k GEMM's alpha is computed in the graph after the q GEMM; it is side-effect
    free, so it moves before q's place and the three share a launch."""
    def fn(x, ga, bq, sq, gq, bk, sk, gk, bv, sv, gv):
        a, sa = fp4.scaled_fp4_quant(x, ga)
        q = fp4.mm_fp4(a, bq, sa, sq, torch.reciprocal(ga * gq), torch.bfloat16)
        k = fp4.mm_fp4(a, bk, sa, sk, torch.reciprocal(ga * (gk * 3.0)), torch.bfloat16)
        v = fp4.mm_fp4(a, bv, sa, sv, torch.reciprocal(ga * gv), torch.bfloat16)
        return q, k, v

    gm = _static_graph(fn, *_qkv_operands(6))
    late = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor and n.args[1] == 3.0]
    first_gemm = next(n for n in gm.graph.nodes if n.target is fp4.mm_fp4.default)
    assert len(late) == 1 and first_gemm < late[0]  # the case: computed after the first GEMM
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    gm.graph.lint()
    assert lowering.match_counts == {"lowering.mm_fp4": 3, "lowering.alpha_from_global_scales": 3,
                                     "lowering.mm_fp4_siblings": 1, "lowering.scaled_fp4_quant": 1}
    assert not lowering.skips
    names = [(name, kwargs.get("SEGMENTS")) for name, kwargs in _kernels_launched(gm) if name.startswith("_mm_decode")]
    assert names == [("_mm_decode_group_kernel", 3)]


def test_a_sibling_whose_input_needs_the_first_gemm_is_lowered_on_its_own(triton_cuda_target):
    """The k GEMM's alpha is computed from the q GEMM's output, so no launch at q's place can
    compute k: q and v share a launch, k gets its own, with the reason."""
    def fn(x, ga, bq, sq, gq, bk, sk, gk, bv, sv, gv):
        a, sa = fp4.scaled_fp4_quant(x, ga)
        q = fp4.mm_fp4(a, bq, sa, sq, torch.reciprocal(ga * gq), torch.bfloat16)
        k = fp4.mm_fp4(a, bk, sa, sk, torch.reciprocal(ga * q.float().abs().amax().reshape(1)), torch.bfloat16)
        v = fp4.mm_fp4(a, bv, sa, sv, torch.reciprocal(ga * gv), torch.bfloat16)
        return q, k, v

    gm = _static_graph(fn, *_qkv_operands(6))
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    gm.graph.lint()
    assert lowering.match_counts == {"lowering.mm_fp4": 3, "lowering.alpha_from_global_scales": 3,
                                     "lowering.mm_fp4_siblings": 1, "lowering.scaled_fp4_quant": 1}
    (skip,) = lowering.skips
    assert skip.key.endswith("mm_fp4_siblings") and "cannot move" in skip.reason and "lowered on its own" in skip.reason
    names = [(name, kwargs.get("SEGMENTS")) for name, kwargs in _kernels_launched(gm) if name.startswith("_mm_decode")]
    assert sorted(names, key=str) == sorted([("_mm_decode_group_kernel", 2), ("_mm_decode_kernel", None)], key=str)


def _qkv_static(x, bq, sq, gq, aq, bk, sk, gk, ak, bv, sv, gv, av):
    """q/k/v projections with a checkpoint's static activation scales: one input quantized once per
    projection, each with its own scale buffer (``aq``, ``ak``, ``av``), as NVFP4 linears do."""
    outs = []
    for b, sb, gb, ga in ((bq, sq, gq, aq), (bk, sk, gk, ak), (bv, sv, gv, av)):
        a, sa = fp4.scaled_fp4_quant(x, ga)
        outs.append(fp4.mm_fp4(a, b, sa, sb, torch.reciprocal(ga * gb), torch.bfloat16))
    return tuple(outs)


def _qkv_static_operands(rows: int, k: int = 64, ns: tuple[int, ...] = (96, 32, 32)) -> list[tuple]:
    scale = ((1,), torch.float32)
    return [((rows, k), torch.bfloat16)] + [
        x for n in ns for x in (((n, k // 2), torch.uint8), ((n, k // 16), torch.float8_e4m3fn), scale, scale)]


@pytest.mark.parametrize("rows,gemm,predecoded", [(6, "_mm_decode_group_kernel", False),
                                                  (100, "_mm_decode_group_kernel", False),
                                                  (100, "_mm_decode_group_kernel", True), (300, None, False)])
def test_static_scale_siblings_share_a_quantization_launch_and_a_gemm_launch(triton_cuda_target, request, rows, gemm,
                                                                           predecoded):
    """Static activation scales: the three quantizations of one input (each its own scale) become one
    launch of the grouped quantization kernel at the first one's place, and the three GEMMs one
    grouped decode launch reading one activation per segment (at 100 rows, where pre-decoded, the
    three pre-decoded in one launch);
    above the decode GEMM's rows each GEMM keeps its own launches."""
    if predecoded:
        request.getfixturevalue("predecoded_mid_rows")
    gm = _static_graph(_qkv_static, *_qkv_static_operands(rows))
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    gm.graph.lint()
    assert not lowering.skips
    assert lowering.match_counts == {"lowering.scaled_fp4_quant": 3, "lowering.scaled_fp4_quant_siblings": 1,
                                     "lowering.mm_fp4": 3, "lowering.mm_fp4_siblings": 1,
                                     "lowering.alpha_from_global_scales": 3}
    kernels = _kernels_launched(gm)
    (quant,) = [kwargs for name, kwargs in kernels if name.startswith("_quant")]
    (quant_launch,) = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional
                       and n.kwargs["kwargs"] is not None and "gs0_ptr" in n.kwargs["kwargs"]]

    def written_by_quant(node: Any, name: str) -> bool:
        # an output of the grouped launch: Triton's store analysis found every segment's outputs
        return node.target is operator.getitem and node.args == (quant_launch, name)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # each segment's global scale: its own scale buffer (through the launcher's reshape to [1])
    scales = [quant[f"gs{i}_ptr"] for i in range(3)]
    scales = [n.args[0] if n.op == "call_function" and n.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default)
              else n for n in scales]
    assert quant["SEGMENTS"] == 3 and scales == placeholders[4::4]
    gemms = [(name, kwargs) for name, kwargs in kernels if name.startswith("_mm_decode")]
    predecodes = [kwargs for name, kwargs in kernels if name == "_predecode_kernel"]
    if gemm is None:
        assert not gemms and not predecodes
        return
    ((name, kwargs),) = gemms
    assert name == gemm and kwargs["SEGMENTS"] == 3
    activations = [kwargs[f"a{i}_ptr"] for i in range(3)] + [kwargs[f"as{i}_ptr"] for i in range(3)]
    assert len(set(activations)) == 6  # each segment reads its own activation
    # pre-decoded: the three activations in one launch
    assert [kw["SEGMENTS"] for kw in predecodes] == ([3] if predecoded else [])
    reader = predecodes[0] if predecodes else kwargs
    codes, scales = ("q{}_ptr", "s{}_ptr") if predecodes else ("a{}_ptr", "as{}_ptr")
    for i in range(3):
        assert written_by_quant(reader[codes.format(i)], f"q{i}_ptr"), reader[codes.format(i)]
        assert written_by_quant(reader[scales.format(i)], f"s{i}_ptr"), reader[scales.format(i)]


def _dynamic_rows_trace(fn, operands: list[tuple]):
    """``fn`` traced the way Dynamo hands a graph with a dynamic batch to Inductor: the first
    operand's row count a symbolic size (its hint the given shape's), every other operand static.
    Returns ``(shape_env, the row symbol's name, graph module)``."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fp4fuse.patterns.base import aot_trace

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    (shape, dtype), *rest_operands = operands
    x = mode.from_tensor(torch.empty(shape, dtype=dtype), symbolic_context=ctx)
    with mode:
        rest = [torch.empty(s, dtype=d) for s, d in rest_operands]
    return shape_env, str(x.shape[0].node.expr), aot_trace(fn, [x, *rest])


@pytest.mark.parametrize("rows_hint,guards,kernel", [
    (20, {"s <= 256", "s > 16", "s <= 32"}, "_mm_decode_group_kernel"),
    (300, {"s > 256", "4*s <= 2146435072"}, None),
])
def test_sibling_gemms_with_a_dynamic_row_count(triton_cuda_target, rows_hint, guards, kernel):
    """A dynamic batch: the siblings' shared launch is traced with the symbolic row count under the
    guards of its range, as one GEMM's is; above the decode GEMM's rows each keeps its own GEMM."""
    shape_env, symbol, gm = _dynamic_rows_trace(_qkv, _qkv_operands(rows_hint))
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    gm.graph.lint()
    assert lowering.match_counts["lowering.mm_fp4"] == 3 and lowering.match_counts["lowering.mm_fp4_siblings"] == 1
    assert {str(g.expr).replace(symbol, "s") for g in shape_env.guards} == guards
    names = {name for name, _ in _kernels_launched(gm)}
    assert (kernel in names) if kernel else not any(n.startswith("_mm_decode") for n in names)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [5, 20, 100, 300])
def test_cuda_sibling_gemms_are_bitwise_the_graph_without_the_pass(m):
    """The q/k/v GEMMs of a TP=2 Llama-3-8B rank (2048, 512, 512 x 4096) compiled with FusionPass
    (one grouped launch up to 256 rows: in-kernel decode at 5 and 20 rows, the pre-decoded
    activation at 100; each its own GEMM at 300) and without: the same bits, call after call (the
    shared split-K counters are left at zero)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 4096, generator=gen).to("cuda", torch.bfloat16)
    ga = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    weights = [t for n in (2048, 512, 512) for t in _quantized(n, 4096, gen, "cuda")]
    fusion = fp4fuse.FusionPass(FusionConfig())
    lowered = torch.compile(_qkv, fullgraph=True, options={"post_grad_custom_post_pass": fusion})
    unlowered = torch.compile(_qkv, fullgraph=True)
    want = unlowered(x, ga, *weights)
    got, (code, *_) = run_and_get_code(lowered, x, ga, *weights)
    assert ("_mm_decode_group_kernel" in code) == (m <= 256)
    for _ in range(2):
        for g, w in zip(got, want):
            _assert_same_bits_and_nans(g, w, m)
        got = lowered(x, ga, *weights)
    assert fusion.match_counts["lowering.mm_fp4_siblings"] == 1


@pytest.mark.parametrize("rows_hint,guards,predecoded", [
    (20, {"4*s <= 2146435072", "s <= 256", "s > 16", "s <= 32"}, False),
    (100, {"4*s <= 2146435072", "s <= 256", "s > 16", "s > 32", "s > 64", "s <= 128"}, False),
    (100, {"4*s <= 2146435072", "s <= 256", "s > 16", "s > 32", "s > 64", "s <= 128"}, True),
])
def test_static_scale_siblings_with_a_dynamic_row_count(triton_cuda_target, request, rows_hint, guards, predecoded):
    """A dynamic batch with static scales: the grouped quantization and the grouped GEMM (its
    activations, where pre-decoded, in one launch) are traced with the symbolic row count under
    the guards of its range -- those one GEMM of that range adds -- and the quantization's int32
    block-index bound (lowered first, before the GEMM's range implies it)."""
    if predecoded:
        request.getfixturevalue("predecoded_mid_rows")
    shape_env, symbol, gm = _dynamic_rows_trace(_qkv_static, _qkv_static_operands(rows_hint))
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    gm.graph.lint()
    assert lowering.match_counts["lowering.scaled_fp4_quant_siblings"] == 1
    assert lowering.match_counts["lowering.mm_fp4_siblings"] == 1
    assert {str(g.expr).replace(symbol, "s") for g in shape_env.guards} == guards
    launches = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    assert all(isinstance(n.kwargs["grid"][0][0], torch.fx.Node) for n in launches)  # symbolic grids
    names = [name for name, _ in _kernels_launched(gm)]
    assert names.count("_quant_group_kernel") == 1 and names.count("_mm_decode_group_kernel") == 1
    assert names.count("_predecode_kernel") == (1 if predecoded else 0)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [5, 20, 100, 300])
def test_cuda_static_scale_siblings_are_bitwise_the_graph_without_the_pass(m):
    """The q/k/v projections of a TP=2 Llama-3-8B rank with static activation scales (three
    different scales of one input) compiled with FusionPass -- one grouped quantization launch, and
    up to 256 rows one grouped GEMM launch with an activation per segment -- and without: the same
    bits, call after call on fresh inputs."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(100 + m)
    k = 4096
    operands = []
    for n in (2048, 512, 512):
        b, sb, gb = _quantized(n, k, gen, "cuda")
        amax = torch.rand((), generator=gen).item() * 4 + 1
        operands += [b, sb, gb, nvfp4.global_scale_from_amax(torch.tensor(amax)).reshape(1).cuda()]
    fusion = fp4fuse.FusionPass(FusionConfig())
    lowered = torch.compile(_qkv_static, fullgraph=True, options={"post_grad_custom_post_pass": fusion})
    unlowered = torch.compile(_qkv_static, fullgraph=True)
    for call in range(3):
        x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
        want = unlowered(x, *operands)
        if call == 0:
            got, (code, *_) = run_and_get_code(lowered, x, *operands)
            assert "_quant_group_kernel" in code
            assert ("_mm_decode_group_kernel" in code) == (m <= 256)
        else:
            got = lowered(x, *operands)
        for g, w in zip(got, want):
            _assert_same_bits_and_nans(g, w, m)
    assert fusion.match_counts["lowering.scaled_fp4_quant_siblings"] == 1
    assert fusion.match_counts["lowering.mm_fp4_siblings"] == 1


def _qkv_twice(x, ga, bq, sq, gq, bk, sk, gk, bv, sv, gv, y, gy):
    """Two layers' q/k/v launches in one graph (the second on another activation)."""
    return (*_qkv(x, ga, bq, sq, gq, bk, sk, gk, bv, sv, gv), *_qkv(y, gy, bq, sq, gq, bk, sk, gk, bv, sv, gv))


def _counters_fills(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.full.default)
            if n.kwargs.get("dtype") == torch.int32 and n.args[1] == 0]


@pytest.mark.parametrize("dynamic", [False, True])
def test_split_k_counters_are_zeroed_once_per_graph(triton_cuda_target, dynamic):
    """Two split-K decode launches (K = 2048: several K splits) share one zeroed counters buffer,
    threaded from the first launch's ``count_ptr`` output to the second, sized for the larger; with
    a dynamic row count the size is the bound of its guarded range (rows <= 32 at a hint of 20)."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fp4fuse.patterns.base import aot_trace

    rows, k = 20, 2048
    operands = _qkv_operands(rows, k=k) + [((rows, k), torch.bfloat16), ((1,), torch.float32)]
    mode = FakeTensorMode(shape_env=ShapeEnv()) if dynamic else FakeTensorMode()
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.empty(operands[0][0], dtype=torch.bfloat16), symbolic_context=ctx if dynamic else None)
    with mode:
        rest = [torch.empty(shape, dtype=dtype) for shape, dtype in operands[1:]]
        rest[-2] = x.new_empty(x.shape)  # y: the same (symbolic) row count
    gm = aot_trace(_qkv_twice, [x, *rest])
    before = _counters_fills(gm)
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    gm.graph.lint()
    assert before == [] and lowering.match_counts["lowering.split_k_counters_shared"] == 1
    (fill,) = _counters_fills(gm)
    launches = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional
                and "count_ptr" in n.kwargs["kwargs"]]
    assert len(launches) == 2 and all(n.kwargs["kwargs"]["n_split" if "n_split" in n.kwargs["kwargs"] else "split0"] > 1
                                      for n in launches)
    first, second = (n.kwargs["kwargs"]["count_ptr"] for n in launches)
    assert first is fill and second.target is operator.getitem and second.args == (launches[0], "count_ptr")
    size = fill.args[0][0]
    assert isinstance(size, int) and size >= 1, size
    # Inductor's reinplacing (after the custom passes) must make every launch use the buffer in place:
    # a launch that still clones its counters would cost a copy kernel per launch instead of a fill
    from torch._dispatch.python import enable_python_dispatcher
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops_core

    with enable_python_dispatcher():
        reinplace_inplaceable_ops_core(gm.graph)
    assert [n.kwargs["tensors_to_clone"] for n in launches] == [[], []]


@pytest.mark.cuda
@pytest.mark.parametrize("m", [5, 20, 100])
def test_cuda_shared_split_k_counters_are_bitwise_the_graph_without_the_pass(m):
    """Two layers' q/k/v launches of a TP=2 Llama-3-8B rank in one compiled graph share one counters
    buffer; call after call on fresh inputs their outputs are bitwise the graph without the pass (a
    counter a launch left non-zero would make the next launch reduce too early or never)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(100 + m)
    weights = [t for n in (2048, 512, 512) for t in _quantized(n, 4096, gen, "cuda")]
    fusion = fp4fuse.FusionPass(FusionConfig())
    lowered = torch.compile(_qkv_twice, fullgraph=True, options={"post_grad_custom_post_pass": fusion})
    unlowered = torch.compile(_qkv_twice, fullgraph=True)
    for call in range(3):
        acts = []
        for _ in range(2):
            x = torch.randn(m, 4096, generator=gen).to("cuda", torch.bfloat16)
            acts += [x, nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)]
        args = (*acts[:2], *weights, *acts[2:])
        for g, w in zip(lowered(*args), unlowered(*args)):
            _assert_same_bits_and_nans(g, w, (m, call))
    assert fusion.match_counts["lowering.split_k_counters_shared"] == 1


# ----------------------------------------------------------------- one tensor written through two arguments


@triton.jit
def _store_through(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, offs.to(tl.float32), mask=offs < n)


@triton.jit
def _pick_out(pid, end0, v0, v1, v2, v3):
    v = v0
    if pid >= end0:
        v = v1
    return v


@triton.jit
def _helper_picked_group_kernel(out0_ptr, out1_ptr, out2_ptr, out3_ptr, n, end0, end1, end2, BLOCK: tl.constexpr):
    """Two segments' stores with the output picked by a helper that takes all four slots: the form
    of the grouped kernels that made the compiled graph read a copy no kernel wrote (mm.py's note
    above ``_dequant_group_kernel``)."""
    pid = tl.program_id(0)
    _store_through(_pick_out(pid, end0, out0_ptr, out1_ptr, out2_ptr, out3_ptr), n, BLOCK)


@triton.jit
def _guard_picked_group_kernel(out0_ptr, out1_ptr, out2_ptr, out3_ptr, n, end0, end1, end2,
                               SEGMENTS: tl.constexpr, BLOCK: tl.constexpr):
    """The same with the output picked at the kernel's top level under ``SEGMENTS`` guards."""
    pid = tl.program_id(0)
    out_ptr = out0_ptr
    if SEGMENTS > 1:
        if pid >= end0:
            out_ptr = out1_ptr
    if SEGMENTS > 2:
        if pid >= end1:
            out_ptr = out2_ptr
    if SEGMENTS > 3:
        if pid >= end2:
            out_ptr = out3_ptr
    _store_through(out_ptr, n, BLOCK)


@triton.jit
def _helper_picked_dequant_group_kernel(q0_ptr, s0_ptr, out0_ptr, n0_blocks, q1_ptr, s1_ptr, out1_ptr, n1_blocks,
                                        q2_ptr, s2_ptr, out2_ptr, n2_blocks, q3_ptr, s3_ptr, out3_ptr, n3_blocks,
                                        end0, end1, end2, SEGMENTS: tl.constexpr, BLOCKS: tl.constexpr):
    """``mm._dequant_group_kernel``'s signature with its output picked by a helper taking all four
    slots (only traced, never run)."""
    pid = tl.program_id(0)
    _store_through(_pick_out(pid, end0, out0_ptr, out1_ptr, out2_ptr, out3_ptr), n0_blocks, BLOCKS)


def _two_segment_launch(kernel, **meta):
    """A launcher of two 32-element segments with the unused slots 2 and 3 filled with segment 1's
    output, as ``mm._launch_grouped`` fills them."""
    from fp4fuse.kernels.triton.launch import traceable

    def launch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out0, out1 = torch.empty_like(x), torch.empty_like(x)
        traceable(kernel)[(2,)](out0, out1, out1, out1, x.numel(), 1, 2, 2, BLOCK=32, **meta)
        return out0, out1

    return launch


def _graph_with_input():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(32)
    return graph, x


def test_a_launch_writing_one_tensor_through_two_arguments_is_refused(triton_cuda_target):
    """torch's analysis of which arguments a launch writes counts the four slots passed into the
    helper as written, so the slots that alias segment 1's output would each get their own copy:
    ``insert_traced`` refuses the trace, naming the kernel and two of those arguments, and inserts
    nothing. With the pick under constexpr guards only the two used slots are written."""
    from fp4fuse.patterns.base import AliasedWrites, insert_traced

    graph, x = _graph_with_input()
    with pytest.raises(AliasedWrites, match=r"_helper_picked_group_kernel would write one tensor through both "
                                            r"out1_ptr and out2_ptr"):
        insert_traced(graph, _two_segment_launch(_helper_picked_group_kernel), [x])
    assert [n.op for n in graph.nodes] == ["placeholder"]
    outputs = insert_traced(graph, _two_segment_launch(_guard_picked_group_kernel, SEGMENTS=2), [x])
    ((name, _),) = _kernels_launched(torch.fx.GraphModule({}, graph))
    (launch,) = graph.find_nodes(op="call_function", target=torch.ops.higher_order.triton_kernel_wrapper_functional)
    assert name == "_guard_picked_group_kernel"
    assert sorted(launch.kwargs["tensors_to_clone"]) == ["out0_ptr", "out1_ptr"]
    assert len(outputs) == 2


@pytest.mark.parametrize("rows", [5, 20, 100, 300])
def test_grouped_launches_write_only_their_segments_outputs(triton_cuda_target, rows):
    """Every lowered launch writes each tensor through one argument, and a grouped launch writes only
    its segments' outputs, not the unused slots the launcher fills with the last segment's tensors
    (at 300 rows: the dequantize launch of activation and weight, 2 of 4 slots, and the alpha
    launch, 1 of 3)."""
    _, _, gm = _dynamic_rows_graph(rows)
    lowering = KernelLoweringPass(FusionConfig())
    assert lowering(gm.graph) == 3, [s.reason for s in lowering.skips]
    launches = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.triton_kernel_wrapper_functional)
    grouped = {"_dequant_group_kernel": ("out{}_ptr", 4), "_scale_group_kernel": ("x{}_ptr", 3)}
    seen = set()
    for launch, (name, kwargs) in zip(launches, _kernels_launched(gm)):
        written = launch.kwargs["tensors_to_clone"]
        assert len({kwargs[arg] for arg in written}) == len(written), (name, written)
        if name in grouped:
            slot, slots = grouped[name]
            assert sorted(written) == [slot.format(i) for i in range(kwargs["SEGMENTS"])], (name, written)
            assert kwargs["SEGMENTS"] < slots  # the launch has unused slots to fill
            seen.add(name)
    assert seen == (set(grouped) if rows > 256 else set())


def test_the_pass_keeps_the_op_call_where_a_launch_would_write_one_tensor_twice(triton_cuda_target, monkeypatch):
    """A grouped dequantize kernel of the helper form (monkeypatched in; the form that miscompiled)
    leaves the GEMM an op call, with the reason, instead of a graph that reads an unwritten copy."""
    from fp4fuse.kernels.triton import mm as triton_mm

    monkeypatch.setattr(triton_mm, "_dequant_group_kernel", _helper_picked_dequant_group_kernel)
    _, _, gm = _dynamic_rows_graph(300)
    lowering = KernelLoweringPass(FusionConfig())
    assert lowering(gm.graph) == 2
    assert lowering.match_counts == {"lowering.rms_norm": 1, "lowering.scaled_fp4_quant": 1}
    (skip,) = lowering.skips
    assert ("_helper_picked_dequant_group_kernel would write one tensor through both out1_ptr and out2_ptr"
            in skip.reason)
    assert "the op call stays" in skip.reason
    assert any(n.target is fp4.mm_fp4.default for n in gm.graph.nodes)


def _every_lowerable_op(x, r, w, gs, ga, b1, s1, g1, b2, s2, g2, b3, s3, g3):
    """Each lowerable op once, the single GEMM with both output dtypes, q/k/v-like and gate/up-like
    siblings on one quantized activation, and a linear with a dynamic scale."""
    normed = fp4.rms_norm(x, w, 1e-6)
    normed2, summed = fp4.fused_add_rms_norm(x, r, w, 1e-6)
    q1, s_1 = fp4.rms_norm_fp4_quant(x, w, 1e-6, gs)
    q2, s_2, summed2 = fp4.fused_add_rms_norm_fp4_quant(x, r, w, 1e-6, gs)
    a, sa = fp4.scaled_fp4_quant(normed2, ga)
    single = (fp4.mm_fp4(q1, b1, s_1, s1, torch.reciprocal(gs * g1), torch.bfloat16),
              fp4.mm_fp4(q2, b1, s_2, s1, torch.reciprocal(gs * g1), torch.float32))
    siblings3 = tuple(fp4.mm_fp4(a, b, sa, sb, torch.reciprocal(ga * gb), torch.bfloat16)
                      for b, sb, gb in ((b1, s1, g1), (b2, s2, g2), (b3, s3, g3)))
    a2, sa2 = fp4.scaled_fp4_quant(normed, ga)
    siblings2 = tuple(fp4.mm_fp4(a2, b, sa2, sb, torch.reciprocal(ga * gb), torch.bfloat16)
                      for b, sb, gb in ((b1, s1, g1), (b2, s2, g2)))
    a3, sa3, g_dyn = NVFP4Quantizer().quantize(summed)  # a dynamic scale
    dynamic = fp4.mm_fp4(a3, b3, sa3, s3, torch.reciprocal(g_dyn * g3), torch.bfloat16)
    return single + siblings3 + siblings2 + (dynamic, summed, summed2)


def _every_lowerable_op_operands(rows: int, k: int) -> list[tuple]:
    scale = ((1,), torch.float32)
    act = ((rows, k), torch.bfloat16)
    weights = [x for n in (96, 40, 40)
               for x in (((n, k // 2), torch.uint8), ((n, k // 16), torch.float8_e4m3fn), scale)]
    return [act, act, ((k,), torch.bfloat16), scale, scale, *weights]


def _written_by(name: str, meta: dict) -> set[str]:
    """The arguments a launch of kernel ``name`` with constexprs ``meta`` must report as written (the
    outputs its launcher reads back), and only those: torch's analysis decides which tensors the
    lowered graph copies before the launch and which copies it reads after."""
    segments = range(meta.get("SEGMENTS") or 1)
    partial = {"part_ptr", "count_ptr"}
    residual = {"res_out_ptr"} if meta.get("HAS_RESIDUAL") else set()
    table = {
        "_quant_kernel": {"q_ptr", "s_ptr"},
        "_quant_of_maxima_kernel": {"gs_ptr", "q_ptr", "s_ptr"},
        "_quant_group_kernel": {f"{p}{i}_ptr" for i in segments for p in "qs"},
        "_rms_norm_kernel": {"out_ptr"} | residual | ({"amax_ptr"} if meta.get("AMAX") else set()),
        "_norm_quant_kernel": {"q_ptr", "s_ptr"} | residual,
        "_mm_decode_kernel": {"out_ptr"} | (partial if meta.get("PARTIAL") else set()),
        "_mm_decode_group_kernel": {f"out{i}_ptr" for i in segments} | partial,
        "_predecode_kernel": {f"{p}{i}_ptr" for i in segments for p in ("lo", "hi")},
        "_dequant_group_kernel": {f"out{i}_ptr" for i in segments},
        "_scale_group_kernel": {f"x{i}_ptr" for i in segments},
        "_decode_halves_kernel": {"lo_ptr", "hi_ptr"},
        "_mm_fp4_kernel": {"out_ptr"},
    }
    return table[name]


@pytest.mark.parametrize("rows,k,predecoded", [(5, 64, False), (5, 4096, False), (20, 64, False), (50, 64, False),
                                               (100, 64, False), (100, 64, True), (200, 64, True), (300, 64, False)])
def test_every_lowered_launch_is_analysed_as_writing_exactly_its_outputs(triton_cuda_target, request, rows, k,
                                                                          predecoded):
    """The lowered graph's correctness rests on torch's analysis of which arguments a launch writes:
    a written argument it misses is not copied (and may be a buffer Inductor reuses), one it adds
    gets a copy of its own that the graph may read. Over every lowerable op, both output dtypes,
    siblings of three and two, a dynamic scale, every row range (5 x 4096: the decode GEMM's split
    K; at 100 rows the activation decoded in the GEMM and pre-decoded), each launch must be reported
    as writing exactly what its launcher reads back."""
    if predecoded and rows <= 128:
        request.getfixturevalue("predecoded_mid_rows")
    gm = _static_graph(_every_lowerable_op, *_every_lowerable_op_operands(rows, k))
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    assert not lowering.skips, [s.reason for s in lowering.skips]
    assert not [n for n in gm.graph.nodes if str(n.target).startswith("fp4fuse.")]
    launches = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.triton_kernel_wrapper_functional)
    names = set()
    for launch, (name, kwargs) in zip(launches, _kernels_launched(gm)):
        written = launch.kwargs["tensors_to_clone"]
        assert set(written) == _written_by(name, kwargs), (name, written)
        names.add((name, bool(kwargs.get("PARTIAL"))))
    kernels = {name for name, _ in names}
    assert {"_quant_kernel", "_rms_norm_kernel", "_norm_quant_kernel"} <= kernels
    assert ("_dequant_group_kernel" in kernels) == (rows > 256)
    assert ("_predecode_kernel" in kernels) == predecoded
    assert ("_quant_of_maxima_kernel" in kernels) == (rows <= 256)  # the dynamic scale's, in its launch
    assert (("_mm_decode_kernel", True) in names) == (k == 4096)


def _dynamic_linear(x, w, b, sb, gb):
    """An NVFP4 linear with a dynamic activation scale (fp4fuse's quantizer) on ``silu(x) * w`` (w a row)."""
    q, s, gs = NVFP4Quantizer().quantize(torch.nn.functional.silu(x) * w)
    return fp4.mm_fp4(q, b, s, sb, torch.reciprocal(gs * gb), torch.bfloat16)


def _dynamic_linear_operands(rows: int, k: int = 64, n: int = 40) -> list[tuple]:
    return [((rows, k), torch.bfloat16), ((k,), torch.bfloat16), ((n, k // 2), torch.uint8),
            ((n, k // 16), torch.float8_e4m3fn), ((1,), torch.float32)]


@pytest.mark.parametrize("rows", [16, 256, 257])
def test_a_dynamic_scale_is_computed_in_the_quantization_launch(triton_cuda_target, rows):
    """Up to 256 rows the scale's nodes (Inductor's kernel for them) go: the quantization launch reads
    the row maxima, and the GEMM's epilogue reads the scale that launch writes. Above, the scale stays."""
    gm = _static_graph(_dynamic_linear, *_dynamic_linear_operands(rows))
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    gm.graph.lint()
    folded = rows <= 256
    assert lowering.match_counts == {"lowering.scaled_fp4_quant": 1, "lowering.mm_fp4": 1,
                                     "lowering.alpha_from_global_scales": 1,
                                     **({"lowering.global_scale_of_maxima": 1} if folded else {})}
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert (torch.ops.aten.reciprocal.default in targets) != folded
    assert (torch.ops.aten.isnan.default in targets) != folded
    launches = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.triton_kernel_wrapper_functional)
    kernels = dict(zip([name for name, _ in _kernels_launched(gm)], launches))
    if not folded:
        assert "_quant_kernel" in kernels and "_quant_of_maxima_kernel" not in kernels
        return
    quant = kernels["_quant_of_maxima_kernel"]
    maxima = quant.kwargs["kwargs"]["m_ptr"]
    while maxima.target is torch.ops.aten.reshape.default:
        maxima = maxima.args[0]
    assert maxima.target is torch.ops.aten.amax.default and maxima.args[1] == [-1]
    gemm = next(node for name, node in kernels.items() if name.startswith("_mm_decode"))
    alpha = gemm.kwargs["kwargs"]["alpha_ptr"]
    assert alpha.args == (quant, "gs_ptr")


def test_a_dynamic_scale_with_a_dynamic_row_count_is_guarded_to_256_rows(triton_cuda_target):
    """A dynamic batch: computing the scale in the launch guards the row count to at most 256 (the
    decode GEMM's own top range, so no new recompile boundary)."""
    def quantize(x, w):
        return NVFP4Quantizer().quantize(torch.nn.functional.silu(x) * w)  # the scale is an output too

    for rows, guard in ((20, "s <= 256"), (300, "s > 256")):
        shape_env, symbol, gm = _dynamic_rows_trace(quantize, _dynamic_linear_operands(rows)[:2])
        lowering = KernelLoweringPass(FusionConfig())
        lowering(gm.graph)
        assert lowering.match_counts.get("lowering.global_scale_of_maxima", 0) == int(rows <= 256)
        assert guard in {str(g.expr).replace(symbol, "s") for g in shape_env.guards}


def test_sibling_gemms_read_the_scale_the_quantization_launch_writes(triton_cuda_target):
    """q/k/v on one dynamically quantized activation: one quantization launch computes the scale,
    the grouped GEMM launch folds it into each segment's alpha."""
    def qkv(x, w, bq, sq, gq, bk, sk, gk, bv, sv, gv):
        q, s, gs = NVFP4Quantizer().quantize(x * w)
        return tuple(fp4.mm_fp4(q, b, s, sb, torch.reciprocal(gs * gb), torch.bfloat16)
                     for b, sb, gb in ((bq, sq, gq), (bk, sk, gk), (bv, sv, gv)))

    scale = ((1,), torch.float32)
    weights = [x for n in (96, 32, 32) for x in (((n, 32), torch.uint8), ((n, 4), torch.float8_e4m3fn), scale)]
    gm = _static_graph(qkv, ((6, 64), torch.bfloat16), ((6, 64), torch.bfloat16), *weights)
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    gm.graph.lint()
    assert lowering.match_counts["lowering.global_scale_of_maxima"] == 1
    assert lowering.match_counts["lowering.mm_fp4_siblings"] == 1
    launches = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.triton_kernel_wrapper_functional)
    named = dict(zip([name for name, _ in _kernels_launched(gm)], launches))
    quant, gemm = named["_quant_of_maxima_kernel"], named["_mm_decode_group_kernel"]
    assert [gemm.kwargs["kwargs"][f"al{i}_ptr"].args for i in range(3)] == [(quant, "gs_ptr")] * 3


@pytest.mark.cuda
@pytest.mark.parametrize("rows,case", [(16, "random"), (5, "zeros"), (16, "nan"), (200, "random"), (300, "random")])
def test_cuda_a_dynamic_scale_in_the_launch_is_bitwise_the_graph_without_the_pass(rows, case):
    """The scale computed in the quantization launch has the bits of Inductor's kernel for it (the
    same operations and division), so the linear's output does too: at 16 and 200 rows (folded;
    all-zero input: scale 1; a NaN: scale NaN) and 300 (not folded)."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 208, generator=gen) * 3).to("cuda", torch.bfloat16)
    w = torch.rand(208, generator=gen).to("cuda", torch.bfloat16)
    if case == "zeros":
        x.zero_()
    elif case == "nan":
        x[3, 7] = float("nan")
    b, sb, gb = _quantized(96, 208, gen, "cuda")
    torch._dynamo.reset()
    plain = torch.compile(_dynamic_linear, fullgraph=True)(x, w, b, sb, gb)
    torch._dynamo.reset()
    fusion = fp4fuse.FusionPass(FusionConfig())
    compiled = torch.compile(_dynamic_linear, fullgraph=True, options={"post_grad_custom_post_pass": fusion})
    lowered = compiled(x, w, b, sb, gb)
    assert fusion.match_counts.get("lowering.global_scale_of_maxima", 0) == int(rows <= 256)
    assert torch.equal(plain.view(torch.int16), lowered.view(torch.int16))


@pytest.mark.parametrize("shape", [(1,), (), (1, 1)])
def test_a_dynamic_scale_of_another_shape_keeps_its_shape(triton_cuda_target, shape):
    """A one-element dynamic scale that is not ``[1]`` (0-d, ``[1, 1]``) keeps Inductor's kernel:
    the quantization launch writes the scale as ``[1]``, and the scale's readers (here the graph's
    outputs) would otherwise return another shape than the graph computes."""
    def fn(x):
        a = x.abs().amax(dim=-1).amax().float().reshape(shape)
        gs = nvfp4.global_scale_from_amax(torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a))
        q, s = fp4.scaled_fp4_quant(x, gs)
        return q, s, gs, gs * 2

    gm = _static_graph(fn, ((16, 64), torch.bfloat16))
    (out,) = gm.graph.find_nodes(op="output")
    lowering = KernelLoweringPass(FusionConfig())
    lowering(gm.graph)
    gm.graph.lint()
    assert lowering.match_counts.get("lowering.global_scale_of_maxima", 0) == int(shape == (1,))
    assert [tuple(n.meta["val"].shape) for n in out.args[0]] == [(16, 32), (16, 4), shape, shape]


@pytest.mark.parametrize("rows", [5, 300])
def test_a_dynamic_weight_row_count_keeps_the_op_call(triton_cuda_target, rows):
    """A weight whose row count N is symbolic (automatic dynamic shapes on a function compiled for
    several weights) is not the activation's row count the launchers' ranges guard: their
    configurations are chosen for a concrete N (at decode rows the launcher could not even be
    traced). The op call stays, with the reason; no guard is added."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fp4fuse.patterns.base import aot_trace

    def fn(a, b, sa, sb, alpha):
        return fp4.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16)

    k = 64
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    b = mode.from_tensor(torch.empty(48, k // 2, dtype=torch.uint8), symbolic_context=ctx)
    with mode:
        a = torch.empty(rows, k // 2, dtype=torch.uint8)
        sa = torch.empty(rows, k // 16, dtype=torch.float8_e4m3fn)
        sb = b.new_empty(b.shape[0], k // 16, dtype=torch.float8_e4m3fn)
        alpha = torch.empty(1)
    gm = aot_trace(fn, [a, b, sa, sb, alpha])
    lowering = KernelLoweringPass(FusionConfig())
    assert lowering(gm.graph) == 0
    (reason,) = [s.reason for s in lowering.skips]
    assert "in dim 0" in reason and "not the activation's row count" in reason
    assert any(n.target is fp4.mm_fp4.default for n in gm.graph.nodes)
    assert not shape_env.guards
