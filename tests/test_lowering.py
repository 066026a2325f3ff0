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


def _assert_lowered_and_bitwise_equal(fusion: fp4fuse.FusionPass, eager: tuple, got: tuple) -> None:
    # the norm + quant pass turns rms_norm -> scaled_fp4_quant (one static scale) into the fused op,
    # whose one-kernel launch must give the two eager ops' bits
    assert fusion.match_counts == {"lowering.mm_fp4": 2, "lowering.fused_add_rms_norm": 1,
                                   "norm_quant.rms_norm_fp4_quant": 1, "lowering.rms_norm_fp4_quant": 1}
    for e, g in zip(eager, got):
        assert g.dtype == e.dtype and torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                                                  e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e)


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


def test_dynamic_sizes_keep_the_op_call(monkeypatch):
    """A call with a symbolic size is not lowered (its launch configuration depends on the size),
    and the skip says so. Traced symbolically on CPU, with the pass told the tensors are on a Triton
    CUDA device (no GPU needed: the skip happens before any kernel is traced)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import fp4fuse.passes.lowering as lowering
    from fp4fuse.ops.backend import Backend

    monkeypatch.setattr(lowering, "_on_cuda", lambda node: True)
    monkeypatch.setattr(lowering, "backend_for", lambda t: Backend.TRITON)

    def fn(a, b, sa, sb, alpha):
        return fp4.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16)

    gen = torch.Generator().manual_seed(0)
    a, sa, ga = _quantized(6, 32, gen, "cpu")
    b, sb, gb = _quantized(5, 32, gen, "cpu")
    gm = make_fx(fn, tracing_mode="symbolic")(a, b, sa, sb, (1.0 / (ga * gb)).reshape(1))
    lowering_pass = KernelLoweringPass(FusionConfig())
    assert lowering_pass(gm.graph) == 0
    assert [s.reason for s in lowering_pass.skips] == [
        "a dynamic size: the op keeps choosing its launch configuration per call (only static shapes are lowered)"]
    assert any(n.target is fp4.mm_fp4.default for n in gm.graph.nodes)
