"""torch.ops.fp4fuse.* on CPU: opcheck, numerics against float64, and input validation."""
import pytest
import torch

import fp4fuse  # noqa: F401
from fp4fuse.nvfp4 import format as nvfp4

ops = torch.ops.fp4fuse
# torch's schema check compares inputs with allclose, which has no float8 kernel on CPU.
FP8_SAFE_OPCHECKS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def _quantized(m: int, k: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    gs = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    q, s = ops.scaled_fp4_quant(x, gs)
    return x, q, s, gs


def test_opcheck_scaled_fp4_quant():
    x = torch.randn(37, 80, dtype=torch.bfloat16)
    gs = torch.tensor([11.5])
    torch.library.opcheck(ops.scaled_fp4_quant, (x, gs))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_opcheck_mm_fp4(out_dtype):
    _, a, sa, ga = _quantized(13, 48, 0)
    _, b, sb, gb = _quantized(21, 48, 1)
    alpha = 1.0 / (ga * gb)
    torch.library.opcheck(ops.mm_fp4, (a, b, sa, sb, alpha, out_dtype), test_utils=FP8_SAFE_OPCHECKS)


def test_opcheck_norms():
    x = torch.randn(9, 40, dtype=torch.bfloat16)
    r = torch.randn(9, 40, dtype=torch.bfloat16)
    w = torch.randn(40, dtype=torch.bfloat16)
    torch.library.opcheck(ops.rms_norm, (x, w, 1e-6))
    torch.library.opcheck(ops.fused_add_rms_norm, (x, r, w, 1e-6))


def test_quant_op_equals_reference():
    x, q, s, gs = _quantized(65, 272, 3, torch.float16)
    rq, rs = nvfp4.quantize_reference(x, gs)
    assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))


@pytest.mark.parametrize("m,n,k", [(1, 5, 16), (3, 423, 208), (130, 37, 1024), (257, 64, 48)])
def test_mm_fp4_matches_float64_decode(m, n, k):
    _, a, sa, ga = _quantized(m, k, 10 + m)
    _, b, sb, gb = _quantized(n, k, 20 + n)
    alpha = 1.0 / (ga * gb)
    out = ops.mm_fp4(a, b, sa, sb, alpha, torch.float32)
    da = nvfp4.dequantize_reference(a, sa).double()
    db = nvfp4.dequantize_reference(b, sb).double()
    ref = (da @ db.t()) * alpha.double()
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel <= 1e-5, rel
    assert out.shape == (m, n) and out.dtype == torch.float32


def test_mm_fp4_approximates_the_float_matmul():
    x, a, sa, ga = _quantized(64, 256, 5)
    w, b, sb, gb = _quantized(48, 256, 6)
    out = ops.mm_fp4(a, b, sa, sb, 1.0 / (ga * gb), torch.bfloat16)
    ref = x.float() @ w.float().t()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.15  # 4-bit data: ~10% per element


def test_mm_fp4_rows_are_independent():
    """Per-shard GEMMs must reproduce the full GEMM bit for bit (the fused collectives rely on it)."""
    _, a, sa, ga = _quantized(96, 128, 7)
    _, b, sb, gb = _quantized(40, 128, 8)
    alpha = 1.0 / (ga * gb)
    full = ops.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16)
    parts = [ops.mm_fp4(a[i:i + 40], b, sa[i:i + 40], sb, alpha, torch.bfloat16) for i in (0, 40, 80)]
    assert torch.equal(full, torch.cat(parts))


def test_norms_match_torch():
    x = torch.randn(11, 72, dtype=torch.bfloat16)
    r = torch.randn(11, 72, dtype=torch.bfloat16)
    w = torch.randn(72, dtype=torch.bfloat16)
    ref = torch.nn.functional.rms_norm(x.float(), (72,), w.float(), 1e-5).to(torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), ref)
    out, res = ops.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(res, x + r)
    assert torch.equal(out, ops.rms_norm(x + r, w, 1e-5))


def _bad_quant_cases():
    good = torch.randn(4, 32)
    gs = torch.tensor([1.0])
    return [
        ((torch.randn(4, 24), gs), r"K = 24 must be a multiple of 16"),
        ((torch.randn(2, 4, 32), gs), r"x must be 2-D"),
        ((torch.randint(0, 5, (4, 32)), gs), r"x must have dtype in"),
        ((torch.randn(32, 4).t(), gs), r"x must be contiguous"),
        ((good, torch.tensor([1.0, 2.0])), r"global_scale must hold exactly one element"),
        ((good, torch.tensor([1.0], dtype=torch.float64)), r"global_scale must be float32"),
    ]


@pytest.mark.parametrize("args,msg", _bad_quant_cases())
def test_quant_rejects_bad_input(args, msg):
    with pytest.raises(ValueError, match=msg):
        ops.scaled_fp4_quant(*args)


def _bad_mm_cases():
    _, a, sa, ga = _quantized(5, 64, 1)
    _, b, sb, gb = _quantized(7, 64, 2)
    _, b32, sb32, _ = _quantized(7, 32, 3)
    alpha = 1.0 / (ga * gb)
    return [
        ((a, b32, sa, sb32, alpha, torch.bfloat16), r"must share K/2"),
        ((a, b, sa[:, :3].contiguous(), sb, alpha, torch.bfloat16), r"a_scale must have shape \[rows, K/16\]"),
        ((a, b, sa.float(), sb, alpha, torch.bfloat16), r"a_scale must have dtype in \(float8_e4m3fn\)"),
        ((a.to(torch.int8), b, sa, sb, alpha, torch.bfloat16), r"a must have dtype in \(uint8\)"),
        ((a[:, :3].contiguous(), b, sa, sb, alpha, torch.bfloat16), r"K = 6 must be a multiple of 16"),
        ((a, b, sa, sb, torch.tensor([1.0, 1.0]), torch.bfloat16), r"alpha must hold exactly one element"),
        ((a, b, sa, sb, alpha, torch.int32), r"out_dtype must be one of"),
        ((a, b.t(), sa, sb, alpha, torch.bfloat16), r"b must be contiguous|must share K/2"),
        ((a, b, sa, sb, alpha.to("meta"), torch.bfloat16), r"alpha is on meta but a is on cpu"),
    ]


@pytest.mark.parametrize("args,msg", _bad_mm_cases())
def test_mm_rejects_bad_input(args, msg):
    with pytest.raises(ValueError, match=msg):
        ops.mm_fp4(*args)


def test_norm_rejects_bad_input():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="weight must be 1-D of length hidden = 32"):
        ops.rms_norm(x, torch.randn(31), 1e-6)
    with pytest.raises(ValueError, match="residual must match x"):
        ops.fused_add_rms_norm(x, torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(32), 1e-6)
