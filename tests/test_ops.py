"""torch.ops.fp4fuse.* on CPU: opcheck, numerics, defined special cases, input validation.

Expected values come from tests/nvfp4_oracle.py (the format written down again from its tables,
no code shared with fp4fuse.nvfp4.format, which is what the CPU ops run), float64 math, or torch
itself (norms)."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fp4fuse  # noqa: F401
import nvfp4_oracle as oracle
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


def _block_spread(m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows whose 16-element blocks span ~6 orders of magnitude (normal and subnormal
    block scales), never all zero."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.rand(m, k // 16, generator=g).pow(8).repeat_interleave(16, 1) + 1e-6
    return (torch.randn(m, k, generator=g) * spread * 5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 16), (37, 208), (130, 48)])
def test_quant_follows_the_format_rules(dtype, m, k):
    """Every code and scale byte is what the rule gives, evaluated by the independent oracle,
    with NaN, +-inf, -0.0 and an all-zero block in the data."""
    x = _block_spread(m, k, m * k, dtype)
    x[0, 3] = float("nan")
    x[-1, -1] = -0.0
    if m > 2:
        x[1, 5] = float("inf")
        x[1, 20] = float("-inf")
        x[2, :16] = 0
    amax = x.float().nan_to_num(0, 0, 0).abs().amax().item()
    for gs in (448 * 6 / amax, 3.0):
        q, s = ops.scaled_fp4_quant(x, torch.tensor([gs]))
        assert q.shape == (m, k // 2) and q.dtype == torch.uint8
        assert s.shape == (m, k // 16) and s.dtype == torch.float8_e4m3fn
        oracle.assert_quantized_by_the_rules(x, gs, q, s)


def test_quant_round_trip_is_within_one_step():
    x = _block_spread(23, 96, 5, torch.float32)
    gs = 448 * 6 / x.abs().amax().item()
    q, s = ops.scaled_fp4_quant(x, torch.tensor([gs]))
    decoded = oracle.dequantize(q, s, gs)
    scale = oracle.decode_e4m3(s).repeat_interleave(16, 1) / gs
    # e2m1 steps are at most 2 (between 4 and 6), so |error| <= s; rounding s to e4m3 (at most
    # 2**-4 relative for normal scales, 2**-10 absolute for subnormal or flushed ones) can leave
    # the block amax up to 6 times that above the saturation point 6 s
    scale_rounding = torch.maximum(scale * 2 ** -4, torch.full_like(scale, 2 ** -10 / gs))
    assert bool(((decoded - x.double()).abs() <= scale + 6 * scale_rounding).all())


@pytest.mark.parametrize("value", [0.0, -0.0, -2.5, math.inf, -math.inf, math.nan])
def test_global_scale_outside_positive_finite_poisons_everything(value):
    """Defined on every backend (format.py): every block scale is e4m3 NaN (0x7F), every code 0,
    so the whole tensor decodes to NaN."""
    x = _block_spread(9, 80, 7, torch.bfloat16)
    q, s = ops.scaled_fp4_quant(x, torch.tensor([value]))
    assert bool((oracle.scale_bits(s) == oracle.E4M3_NAN_BITS).all())
    assert bool((q == 0).all())
    assert bool(oracle.dequantize(q, s).isnan().all())


def test_huge_global_scale_saturates():
    """gs = 1e30 is finite: blocks with a nonzero element get scale 448, nonzero elements +-6,
    zero elements code 0 (+0) or 8 (-0), an all-zero block scale 0."""
    x = _block_spread(6, 64, 8, torch.float32)
    x[1, 16:32] = 0
    x[2, 3] = -0.0
    q, s = ops.scaled_fp4_quant(x, torch.tensor([1e30]))
    nonzero_block = (x != 0).reshape(6, 4, 16).any(-1)
    assert torch.equal(oracle.scale_bits(s), torch.where(nonzero_block, oracle.E4M3_MAX_BITS, 0))
    expected = torch.where(x != 0, 7, 0) + 8 * torch.signbit(x).long()
    assert torch.equal(oracle.codes(q), expected)
    oracle.assert_quantized_by_the_rules(x, 1e30, q, s)


@pytest.mark.parametrize("m,n,k", [(1, 5, 16), (3, 423, 208), (130, 37, 1024), (257, 64, 48)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_mm_fp4_is_float64_math_on_decoded_values(m, n, k, out_dtype):
    """out = alpha * A @ B^T with A, B decoded by the oracle, in float64, rounded once: within
    half a unit in the last place of out_dtype, element by element."""
    _, a, sa, ga = _quantized(m, k, 10 + m)
    _, b, sb, gb = _quantized(n, k, 20 + n)
    alpha = 1.0 / (ga * gb)
    out = ops.mm_fp4(a, b, sa, sb, alpha, out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    exact = (oracle.dequantize(a, sa) @ oracle.dequantize(b, sb).t()) * alpha.double().item()
    half_ulp = torch.finfo(out_dtype).eps / 2 * exact.abs() + torch.finfo(out_dtype).tiny
    assert bool(((out.double() - exact).abs() <= half_ulp * 1.0001).all())


@pytest.mark.parametrize("m,n,k", [(0, 5, 32), (4, 0, 32), (0, 0, 48), (3, 5, 0)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_mm_fp4_empty_operands(m, n, k, out_dtype):
    """M = 0 or N = 0: the empty [M, N]; K = 0: an empty sum, alpha * 0 = 0."""
    a, sa = ops.scaled_fp4_quant(torch.randn(m, k) + 0.5, torch.tensor([3.0]))
    b, sb = ops.scaled_fp4_quant(torch.randn(n, k) + 0.5, torch.tensor([3.0]))
    assert a.shape == (m, k // 2) and sa.shape == (m, k // 16)
    out = ops.mm_fp4(a, b, sa, sb, torch.tensor([0.7]), out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert torch.equal(out, torch.zeros(m, n, dtype=out_dtype))


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
    res_ref = (x.float() + r.float()).to(torch.bfloat16)
    assert torch.equal(res, res_ref)
    assert torch.equal(out, torch.nn.functional.rms_norm(res_ref.float(), (72,), w.float(), 1e-5).to(torch.bfloat16))


def test_norm_accepts_a_weight_of_another_float_dtype():
    x = torch.randn(5, 48, dtype=torch.bfloat16)
    w = torch.rand(48, dtype=torch.float32) + 0.5
    expected = torch.nn.functional.rms_norm(x.float(), (48,), w, 0.0).to(torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, w, 0.0), expected)


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


def _norm_calls(x, w, eps):
    r = torch.ones_like(x)
    return (lambda: ops.rms_norm(x, w, eps)), (lambda: ops.fused_add_rms_norm(x, r, w, eps))


@pytest.mark.parametrize("eps", [math.nan, -1e-6, math.inf, -math.inf])
def test_norm_rejects_bad_eps(eps):
    for call in _norm_calls(torch.randn(4, 32), torch.randn(32), eps):
        with pytest.raises(ValueError, match=r"fp4fuse\.(fused_add_)?rms_norm: eps must be a finite float >= 0"):
            call()


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float64])
def test_norm_rejects_weight_dtype_also_at_trace_time(dtype):
    """Checked in validation, so the fake impls (what torch.compile traces) reject it too."""
    w = torch.ones(32, dtype=dtype)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    for call in _norm_calls(x, w, 1e-6):
        with pytest.raises(ValueError, match=r"weight must have dtype in \(bfloat16, float16, float32\)"):
            call()
    with FakeTensorMode() as mode:
        fake_x, fake_w = mode.from_tensor(x), mode.from_tensor(w)
        for call in _norm_calls(fake_x, fake_w, 1e-6):
            with pytest.raises(ValueError, match="weight must have dtype in"):
                call()


def test_compute_ops_register_plain_cuda_kernels():
    """The compute ops' CUDA kernels sit on the dispatcher's CUDA key directly
    (fp4fuse/ops/registration.py), not behind ``custom_op.register_kernel``'s per-call Python layers,
    which cost an eager decode step host time (benchmarks/results/2026-11-25-decode-host-cse-h100.md);
    the fake and CPU implementations stay ``custom_op``'s."""
    for name in ("scaled_fp4_quant", "mm_fp4", "rms_norm", "fused_add_rms_norm", "rms_norm_fp4_quant",
                 "fused_add_rms_norm_fp4_quant"):
        table = {line.split(":", 1)[0]: line for line in torch._C._dispatch_dump(f"fp4fuse::{name}").splitlines()}
        assert "fp4fuse/ops/registration.py" in table["CUDA"], (name, table.get("CUDA"))
        assert "custom_ops.py" in table["CompositeExplicitAutograd[alias]"], name
        assert "custom_ops.py" in table["Meta"], name
