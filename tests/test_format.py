"""The NVFP4 reference format: e2m1 rounding, packing, scales, swizzle, special values, torchao parity."""
import math
import warnings

import numpy as np
import pytest
import torch

import nvfp4_oracle as oracle
from fp4fuse.nvfp4 import format as nvfp4

GRID = torch.tensor(nvfp4.E2M1_VALUES)


def test_e2m1_encode_grid_points_roundtrip():
    vals = torch.cat([GRID, -GRID])
    codes = nvfp4.e2m1_encode(vals)
    assert torch.equal(nvfp4.e2m1_decode(codes), vals)
    assert codes[:8].tolist() == list(range(8))
    assert codes[9:].tolist() == list(range(9, 16))  # -0.0 keeps its sign bit (code 8)


@pytest.mark.parametrize("tie,expected", [
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)])
def test_e2m1_ties_round_to_even_code(tie, expected):
    for sign in (1.0, -1.0):
        got = nvfp4.e2m1_decode(nvfp4.e2m1_encode(torch.tensor([sign * tie])))
        assert got.item() == sign * expected


def test_e2m1_encode_is_nearest_on_random_values():
    v = torch.empty(20000).uniform_(-7, 7)
    dec = nvfp4.e2m1_decode(nvfp4.e2m1_encode(v))
    clamped = v.clamp(-6, 6)
    err = (dec - clamped).abs()
    best = (clamped.abs().unsqueeze(-1) - GRID).abs().min(dim=-1).values
    assert torch.all(err <= best + 1e-7)


def test_pack_unpack_roundtrip_low_nibble_first():
    codes = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    packed = nvfp4.pack_nibbles(codes)
    assert packed.shape == (5, 16)
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0])
    assert torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(nvfp4.unpack_nibbles(packed), codes)


def test_global_scale_from_amax():
    amax = torch.tensor([3.5, 0.0, float("inf"), float("nan")])
    gs = nvfp4.global_scale_from_amax(amax)
    assert gs[0].item() == pytest.approx(448 * 6 / 3.5)
    assert gs[1].item() == 1.0
    assert math.isnan(gs[2].item()) and math.isnan(gs[3].item())


def test_global_scale_is_torchs_value_of_448_times_6_over_amax():
    """``gs`` is what ``448 * 6 / amax`` gives for an fp32 tensor ``amax`` in torch (as a caller of
    vLLM's or flashinfer's quantization writes it): the IEEE fp32 reciprocal times 2688, rounded
    (numpy's fp32 arithmetic as the reference). About a quarter of amaxes give a value 1 ulp from
    the IEEE quotient ``2688 / amax``, which TransformerEngine's kernel computes."""
    rng = np.random.default_rng(7)
    amax = rng.lognormal(0.0, 4.0, 4096).astype(np.float32)
    expected = (np.float32(1.0) / amax) * np.float32(2688.0)
    gs = nvfp4.global_scale_from_amax(torch.from_numpy(amax)).numpy()
    assert np.array_equal(gs, expected)
    off_quotient = np.mean(gs != np.float32(2688.0) / amax)
    assert 0.1 < off_quotient < 0.5, off_quotient


def _swizzle_offset(r: int, c: int, cols: int) -> int:
    return ((r // 128 * -(-cols // 4) + c // 4) * 32 + r % 32) * 16 + (r % 128) // 32 * 4 + c % 4


@pytest.mark.parametrize("rows,cols", [(1, 1), (130, 7), (256, 8), (37, 33)])
def test_swizzle_matches_documented_offsets(rows, cols):
    s = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    sw = nvfp4.swizzle_scales(s)
    assert sw.shape == nvfp4.swizzled_shape(rows, cols)
    flat = sw.flatten()
    for r in range(rows):
        for c in range(cols):
            assert flat[_swizzle_offset(r, c, cols)] == s[r, c]
    # padding is zero: exactly rows*cols nonzero entries
    assert int((flat != 0).sum()) == rows * cols
    back = nvfp4.unswizzle_scales(sw, rows, cols)
    assert torch.equal(back, s)


def test_swizzle_roundtrip_fp8():
    s = torch.rand(200, 12).to(torch.float8_e4m3fn)
    back = nvfp4.unswizzle_scales(nvfp4.swizzle_scales(s), 200, 12)
    assert back.dtype == torch.float8_e4m3fn
    assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))


def _quant(x, gs=None):
    if gs is None:
        gs = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    q, s = nvfp4.quantize_reference(x, gs)
    return q, s, gs


def test_quantize_error_is_bounded_by_half_step():
    x = torch.randn(19, 160)
    q, s, gs = _quant(x)
    deq = nvfp4.dequantize_reference(q, s, gs)
    # Per element the e2m1 step is at most 2 (between 4 and 6) in scaled units: |err| <= s/gs.
    bound = (s.float() / gs).repeat_interleave(16, dim=1)
    # e4m3 rounding of the scale can push values up to (1+2^-4) beyond 6*s before clamping.
    assert torch.all((deq - x).abs() <= bound * 1.07 + 1e-6)


def test_all_zero_blocks_give_zero_codes_and_scales():
    x = torch.randn(3, 64)
    x[1, 16:32] = 0
    q, s, _ = _quant(x)
    assert s[1, 1].float().item() == 0
    assert torch.all(nvfp4.unpack_nibbles(q)[1, 16:32] == 0)
    x = torch.zeros(2, 32)
    q, s, gs = _quant(x)
    assert gs.item() == 1.0 and torch.all(q == 0) and torch.all(s.float() == 0)


def test_values_far_beyond_range_saturate():
    x = torch.randn(4, 32)
    gs = torch.tensor([1000.0])  # static scale far too large for this data
    x[0, 0] = 1e6
    q, s, _ = _quant(x, gs)
    assert torch.all(s.float() <= 448)
    deq = nvfp4.dequantize_reference(q, s, gs)
    assert deq[0, 0].item() == pytest.approx(6 * 448 / 1000.0)


def test_tiny_blocks_keep_subnormal_block_scales():
    """Blocks far below the tensor's amax get subnormal e4m3 scales (exponent field 0, mantissa
    j: j * 2**-9), rounded to the nearest step; only a block below half a step flushes to 0.
    Each tiny block's amax is set so that amax / 6 * gs lands on a chosen multiple of 2**-9."""
    g = torch.Generator().manual_seed(3)
    steps = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 2.6, 5.4, 7.4, 0.4)
    expected_bits = [1, 2, 3, 4, 5, 6, 7, 3, 5, 7, 0]
    x = torch.randn(2, 16 * len(steps), generator=g)
    x[0, 0] = 40.0  # the tensor's amax
    gs = nvfp4.global_scale_from_amax(torch.tensor(40.0)).reshape(1)
    for i, step in enumerate(steps):
        block = torch.randn(16, generator=g)
        x[1, 16 * i:16 * (i + 1)] = block / block.abs().max() * (step * 2.0 ** -9 * 6 / gs)
    q, s = nvfp4.quantize_reference(x, gs)
    assert oracle.scale_bits(s)[1].tolist() == expected_bits
    oracle.assert_quantized_by_the_rules(x, gs.item(), q, s)
    # decoded (independently) to within half the largest e2m1 step of the block's scale
    decoded = oracle.dequantize(q, s, gs)[1]
    scale = oracle.decode_e4m3(s)[1].repeat_interleave(16) / gs.double()
    tiny = x[1].double()
    kept = scale > 0
    assert bool(((decoded - tiny).abs()[kept] <= scale[kept] * 1.01).all())
    assert bool((decoded[~kept] == 0).all()) and int(kept.sum()) == 16 * (len(steps) - 1)


def test_nan_encodes_as_plus_zero_whatever_its_sign():
    codes = nvfp4.e2m1_encode(torch.tensor([float("nan"), -float("nan"), 0.0 * float("inf")]))
    assert codes.tolist() == [0, 0, 0]


def test_nan_poisons_block_scale_and_inf_saturates():
    x = torch.randn(2, 48)
    x[0, 3] = float("nan")
    x[1, 20] = float("inf")
    x[1, 40] = float("-inf")
    gs = torch.tensor([2.0])
    q, s, _ = _quant(x, gs)
    codes = nvfp4.unpack_nibbles(q)
    assert math.isnan(s[0, 0].float().item())
    assert codes[0, 3].item() == 0
    assert not math.isnan(s[0, 1].float().item())
    assert s[1, 1].float().item() == 448 and s[1, 2].float().item() == 448
    assert codes[1, 20].item() == 7 and codes[1, 40].item() == 15
    deq = nvfp4.dequantize_reference(q, s, gs)
    assert torch.all(torch.isnan(deq[0, :16])) and torch.all(torch.isfinite(deq[0, 16:]))


@pytest.mark.parametrize("m,k", [(1, 16), (7, 48), (130, 256), (33, 1040)])
@pytest.mark.parametrize("spread", [1e-3, 1.0, 300.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_torchao(m, k, spread, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
    # A rate needs enough elements: stack rows up to ~128k elements (rows quantize independently).
    m = max(m, -(-131072 // k))
    g = torch.Generator().manual_seed(int(m * k + spread * 1000) + (dtype == torch.bfloat16))
    block_spread = torch.rand(m, k // 16, generator=g).repeat_interleave(16, 1)
    x = (torch.randn(m, k, generator=g) * spread * block_spread).to(dtype)
    q, s, gs = _quant(x)
    ao_s, ao_q = nvfp4_quantize(x, 16, per_tensor_scale=1.0 / gs)
    # torchao clamps block scales up to the smallest normal e4m3 (2^-6) and fp4fuse keeps
    # subnormal ones (format.py), so blocks with a subnormal scale differ by design.
    normal = s.float() >= 2.0 ** -6
    codes_differ = nvfp4.unpack_nibbles(q) != nvfp4.unpack_nibbles(ao_q)
    code_mismatch = codes_differ[normal.repeat_interleave(16, 1)].float().mean().item()
    scale_mismatch = (s.view(torch.uint8) != ao_s.view(torch.uint8))[normal].float().mean().item()
    assert normal.float().mean() > 0.5
    assert code_mismatch <= 1e-3, code_mismatch
    assert scale_mismatch <= 1e-3, scale_mismatch


@pytest.mark.parametrize("value", [0.0, -0.0, -2.5, math.inf, -math.inf, math.nan, 1e-30, 3.5, 1e30])
def test_poison_unless_valid_global_scale(value):
    """What a third-party quantization kernel returned (random bytes here) passes unchanged under a
    global scale in (0, inf), and becomes all codes 0, all scales e4m3 NaN (0x7F) under any other."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 256, (7, 40), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (7, 5), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    q2, s2 = nvfp4.poison_unless_valid_global_scale(q, s, torch.tensor([value]))
    assert q2.dtype == torch.uint8 and s2.dtype == torch.float8_e4m3fn
    if 0 < value < math.inf:
        assert torch.equal(q2, q) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
    else:
        assert bool((q2 == 0).all()) and bool((oracle.scale_bits(s2) == oracle.E4M3_NAN_BITS).all())
