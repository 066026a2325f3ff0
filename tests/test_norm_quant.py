"""Fused RMSNorm + NVFP4 quantization: the ops ``fp4fuse::rms_norm_fp4_quant`` /
``fused_add_rms_norm_fp4_quant`` and the NormQuantFusionPass that writes them into compiled graphs.

Ops on CPU: equal to the references in fp4fuse/nvfp4/norms.py and to an independent composition
(the norm against float64 math, the quantization of the norm output by tests/nvfp4_oracle.py's
rules); argument errors name the argument and the rule. Pass: exact counts, bitwise equal to the
graph compiled without it, and the skips (other readers, dynamic scale, several scales, torch-form
norms) with their reasons. Sequence parallelism + this pass at TP=2: tests/e2e/test_sp_e2e.py."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fp4fuse
import nvfp4_oracle as oracle
from fp4fuse.config import FusionConfig
from fp4fuse.nvfp4.norms import (
    fused_add_rms_norm_fp4_quant_reference, fused_add_rms_norm_reference, rms_norm_fp4_quant_reference,
)
from fp4fuse.passes.norm_quant import NormQuantFusionPass
from fp4fuse.patterns.base import aot_trace

ops = torch.ops.fp4fuse
T, H = 37, 80  # tokens not a multiple of 16, hidden a multiple of 16 but not a power of two
EPS = 1e-5


def _inputs(dtype: torch.dtype, seed: int = 0, tokens: int = T, hidden: int = H) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen) * torch.rand(tokens, 1, generator=gen).add(0.1)).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    return x, residual, weight, torch.tensor([11.0])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same(got, expected) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(_bits(g), _bits(e))


# --------------------------------------------------------------------------- ops


def test_opcheck():
    x, r, w, gs = _inputs(torch.bfloat16)
    torch.library.opcheck(ops.rms_norm_fp4_quant, (x, w, EPS, gs))
    torch.library.opcheck(ops.fused_add_rms_norm_fp4_quant, (x, r, w, EPS, gs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ops_equal_the_references_and_the_two_ops(dtype):
    x, r, w, gs = _inputs(dtype)
    q, s = ops.rms_norm_fp4_quant(x, w, EPS, gs)
    _assert_same((q, s), rms_norm_fp4_quant_reference(x, w, EPS, gs))
    _assert_same((q, s), ops.scaled_fp4_quant(ops.rms_norm(x, w, EPS), gs))
    fused = ops.fused_add_rms_norm_fp4_quant(x, r, w, EPS, gs)
    _assert_same(fused, fused_add_rms_norm_fp4_quant_reference(x, r, w, EPS, gs))
    out, residual_out = ops.fused_add_rms_norm(x, r, w, EPS)
    _assert_same(fused, (*ops.scaled_fp4_quant(out, gs), residual_out))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ops_are_the_format_rules_applied_to_the_norm(dtype):
    """Independent composition: the norm output (residual sum first) is within a unit of the
    float64 norm (a few for fp32 output), and q, s are the oracle's quantization of it."""
    x, r, w, gs = _inputs(dtype, seed=1)
    q, s, residual_out = ops.fused_add_rms_norm_fp4_quant(x, r, w, EPS, gs)
    assert torch.equal(residual_out, (x.double() + r.double()).to(dtype))
    out, _ = fused_add_rms_norm_reference(x, r, w, EPS)
    exact = residual_out.double() * torch.rsqrt(residual_out.double().pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    # one rounding to a 16-bit dtype dominates; fp32 output carries fp32 math's few ulps
    units = 8 if dtype == torch.float32 else 1
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert bool(((out.double() - exact).abs() <= units * ulp).all())
    oracle.assert_quantized_by_the_rules(out, gs, q, s)


def test_empty_rows():
    x, r, w, gs = _inputs(torch.bfloat16, tokens=0)
    q, s, residual_out = ops.fused_add_rms_norm_fp4_quant(x, r, w, EPS, gs)
    assert q.shape == (0, H // 2) and s.shape == (0, H // 16) and residual_out.shape == (0, H)


def _bad_cases():
    x, r, w, gs = _inputs(torch.bfloat16)
    return [
        ((x, w, EPS, torch.tensor([1.0, 2.0])), r"global_scale must hold exactly one element"),
        ((x, w, EPS, torch.tensor([1.0], dtype=torch.float64)), r"global_scale must be float32"),
        ((x, w, EPS, gs.to("meta")), r"global_scale is on meta but x is on cpu"),
        ((x, w, math.nan, gs), r"eps must be a finite float >= 0"),
        ((x, w, -1e-6, gs), r"eps must be a finite float >= 0"),
        ((x, w.to(torch.int32), EPS, gs), r"weight must have dtype in \(bfloat16, float16, float32\)"),
        ((x, w[:-1], EPS, gs), r"weight must be 1-D of length hidden = 80"),
        ((x[:, :24].contiguous(), w[:24], EPS, gs), r"K = 24 must be a multiple of 16"),
        ((x.reshape(1, T, H), w, EPS, gs), r"x must be 2-D"),
    ]


@pytest.mark.parametrize("args,msg", _bad_cases())
def test_ops_reject_bad_input_eagerly_and_at_trace_time(args, msg):
    x, w, eps, gs = args
    residual = torch.zeros_like(x)
    calls = [("rms_norm_fp4_quant", lambda *a: ops.rms_norm_fp4_quant(a[0], *a[2:])),
             ("fused_add_rms_norm_fp4_quant", ops.fused_add_rms_norm_fp4_quant)]
    for name, call in calls:
        with pytest.raises(ValueError, match=rf"fp4fuse\.{name}: .*{msg}|fp4fuse\.{name}: {msg}"):
            call(x, residual, w, eps, gs)
    if gs.device.type != "meta":
        with FakeTensorMode() as mode:
            fx_, fr, fw, fgs = (mode.from_tensor(t) for t in (x, residual, w, gs))
            with pytest.raises(ValueError, match=msg):
                ops.fused_add_rms_norm_fp4_quant(fx_, fr, fw, eps, fgs)


# --------------------------------------------------------------------------- the pass


def _norm_quant_graph(x, r, w, gs, gs2):
    """Each case the pass distinguishes, in one graph (so one compile covers them all)."""
    plain = ops.scaled_fp4_quant(ops.rms_norm(x, w, EPS), gs)                      # fused
    summed, res = ops.fused_add_rms_norm(x, r, w, EPS)
    added = ops.scaled_fp4_quant(summed, gs)                                       # fused (add variant)
    shared = ops.rms_norm(res, w, 1e-6)
    twice = ops.scaled_fp4_quant(shared, gs), ops.scaled_fp4_quant(shared, gs)     # one fused op for both
    kept = ops.rms_norm(x, w, 1e-3)
    other_reader = ops.scaled_fp4_quant(kept, gs), kept * 2                         # skip: another reader
    dyn = ops.rms_norm(r, w, EPS)
    dynamic = ops.scaled_fp4_quant(dyn, (2688.0 / dyn.abs().amax().float()).reshape(1))  # skip: dynamic scale
    scales = ops.rms_norm(res, w, 1e-4)
    two_scales = ops.scaled_fp4_quant(scales, gs), ops.scaled_fp4_quant(scales, gs2)  # skip: two scales
    late = ops.rms_norm(x, w, 1e-2)
    late_scale = ops.scaled_fp4_quant(late, torch.full((1,), 3.0))                 # fused at the quant's place
    return plain, added, res, twice, other_reader, dynamic, two_scales, late_scale


EXPECTED_COUNTS = {"norm_quant.rms_norm_fp4_quant": 3, "norm_quant.fused_add_rms_norm_fp4_quant": 1}
EXPECTED_SKIPS = ("is also read by", "computed from the norm output (a dynamic scale", "2 different global-scale nodes")


# the skips are read from the pass's last run: a graph served from the FX graph cache has none
@torch._inductor.config.patch(fx_graph_cache=False)
def test_pass_fuses_exactly_and_records_the_skips():
    torch._dynamo.reset()
    x, r, w, gs = _inputs(torch.bfloat16, seed=2)
    args = (x, r, w, gs, torch.tensor([5.0]))
    fusion = fp4fuse.FusionPass(FusionConfig())
    unfused = fp4fuse.FusionPass(FusionConfig(enable_norm_quant_fusion=False))
    assert "norm_quant" in fusion.pass_names and "norm_quant" not in unfused.pass_names
    got = torch.compile(_norm_quant_graph, fullgraph=True, options={"post_grad_custom_post_pass": fusion})(*args)
    ref = torch.compile(_norm_quant_graph, fullgraph=True, options={"post_grad_custom_post_pass": unfused})(*args)
    assert fusion.fusion_counts == EXPECTED_COUNTS and unfused.fusion_counts == {}
    reasons = [s.reason for s in fusion.last_skips if s.key == "norm_quant.fused_norm_quant"]
    assert len(reasons) == len(EXPECTED_SKIPS) and all(any(e in r for r in reasons) for e in EXPECTED_SKIPS), reasons
    flat = lambda t: [v for item in t for v in (flat(item) if isinstance(item, tuple) else [item])]  # noqa: E731
    _assert_same(flat(got), flat(ref))
    _assert_same(flat(ref), flat(_norm_quant_graph(*args)))


def test_torch_form_norms_are_not_fused_and_say_why():
    """Hugging Face's LlamaRMSNorm on ``[batch, seq, hidden]``, viewed as rows for a linear's quant:
    Inductor's own norm code, not fp4fuse's, so no fusion; the skip names the form."""
    def hf_norm_then_quant(x, w, gs):
        xf = x.float()
        out = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
        return ops.scaled_fp4_quant(out.reshape(-1, x.shape[-1]), gs)

    x, _, w, gs = _inputs(torch.bfloat16, tokens=3 * 5)
    real = (x.reshape(3, 5, H), w, gs)
    with FakeTensorMode() as mode:
        gm = aot_trace(hf_norm_then_quant, [mode.from_tensor(t) for t in real])
    norm_quant = NormQuantFusionPass(FusionConfig())
    assert norm_quant(gm.graph) == 0
    (skip,) = norm_quant.skips
    assert skip.key == "norm_quant.torch_norm" and "torch_fp32" in skip.reason and "not be bitwise" in skip.reason
    copy.deepcopy(norm_quant)  # Inductor deep-copies its config per compile: the pass holds no graph state


@torch._inductor.config.patch(fx_graph_cache=False)
def test_demo_model_with_static_scales_fuses_every_quantized_norm(fake_group):
    """fp4fuse's Llama-style decoder (fp4fuse norms, static activation scale), compiled without
    sequence parallelism on the 2-rank fake group: layer 0's input norm and every add + norm before
    a GEMM fuse (2L - 1 of them; the final norm is not quantized); bitwise equal to the graph
    compiled without the pass."""
    from fp4fuse.tp import LlamaConfig, TPGroup, TPLlamaModel

    torch._dynamo.reset()
    layers = 2
    model = TPLlamaModel(LlamaConfig(num_layers=layers, hidden_size=64, intermediate_size=96, act_global_scale=8.0),
                         TPGroup.from_process_group())
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(0))
    fusion = fp4fuse.FusionPass(FusionConfig())
    unfused = fp4fuse.FusionPass(FusionConfig(enable_norm_quant_fusion=False))
    with torch.no_grad():
        got = torch.compile(model, dynamic=False, options={"post_grad_custom_post_pass": fusion})(ids)
        ref = torch.compile(model, dynamic=False, options={"post_grad_custom_post_pass": unfused})(ids)
    assert fusion.fusion_counts == {"norm_quant.rms_norm_fp4_quant": 1,
                                    "norm_quant.fused_add_rms_norm_fp4_quant": 2 * layers - 1}
    assert fusion.last_skips == []
    assert torch.equal(got, ref)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_cuda_fused_ops_equal_the_two_ops_and_lower():
    """On a Triton GPU the fused kernels give the bits of the norm kernel then the quant kernel,
    and a compiled graph lowers the fused op to its launch with the same result."""
    x, r, w, gs = (t.cuda() for t in _inputs(torch.bfloat16, seed=3, tokens=203, hidden=208))
    fused = ops.fused_add_rms_norm_fp4_quant(x, r, w, EPS, gs)
    out, residual_out = ops.fused_add_rms_norm(x, r, w, EPS)
    _assert_same(fused, (*ops.scaled_fp4_quant(out, gs), residual_out))
    _assert_same(ops.rms_norm_fp4_quant(x, w, EPS, gs), ops.scaled_fp4_quant(ops.rms_norm(x, w, EPS), gs))

    def graph(x, r, w, gs):
        summed, res = ops.fused_add_rms_norm(x, r, w, EPS)
        return (*ops.scaled_fp4_quant(summed, gs), res)

    torch._dynamo.reset()
    fusion = fp4fuse.FusionPass(FusionConfig())
    got = torch.compile(graph, fullgraph=True, options={"post_grad_custom_post_pass": fusion})(x, r, w, gs)
    assert fusion.match_counts == {"norm_quant.fused_add_rms_norm_fp4_quant": 1,
                                   "lowering.fused_add_rms_norm_fp4_quant": 1}
    _assert_same(got, fused)
