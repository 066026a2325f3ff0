"""NVFP4 written down again from the format tables, for tests: an oracle that shares no code with
``fp4fuse.nvfp4.format`` (which is what the tests check).

* e2m1: a literal 16-entry table (code bit 3 = sign, bits 2..0 index the magnitudes).
* e4m3fn: decoded from its bit fields (1 sign, 4 exponent with bias 7, 3 mantissa; exponent 0 is
  subnormal ``m/8 * 2**-6``; ``S.1111.111`` is NaN; no infinities), with Python arithmetic.
* Element ``2j`` of a row sits in the low nibble of byte ``j``; one e4m3 scale per 16 elements.
* The quantization rule as stated in docs/design.md, evaluated by searching the tables for the
  nearest value (ties to the even code) instead of by thresholds:
  ``s = e4m3(min(block_amax / 6 * gs, 448))`` in fp32, ``q = e2m1(x * gs / s)`` (fp32 IEEE
  division, saturating at 6), ``s == 0`` -> every code 0, NaN in a block -> scale NaN, codes 0;
  a global scale outside ``(0, inf)`` -> every scale NaN, every code 0.
"""
from __future__ import annotations

import math

import torch

BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E4M3_NAN_BITS = 0x7F
E4M3_MAX_BITS = 0x7E  # 448


def e4m3_value(bits: int) -> float:
    """The value of one e4m3fn byte."""
    sign = -1.0 if bits & 0x80 else 1.0
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * (mantissa / 8) * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3_VALUES = tuple(e4m3_value(b) for b in range(256))


def scale_bits(s: torch.Tensor) -> torch.Tensor:
    """Raw bytes of an e4m3 tensor as int64."""
    return s.view(torch.uint8).long()


def codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[M, K/2]`` -> int64 e2m1 codes ``[M, K]``, element 2j from the low nibble."""
    low, high = q.long() & 0xF, q.long() >> 4
    return torch.stack((low, high), dim=-1).reshape(q.shape[0], 2 * q.shape[1])


def decode_scales(s: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[M, K/16]`` -> float64."""
    return torch.tensor(E4M3_VALUES, dtype=torch.float64)[scale_bits(s)]


def decode(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``q * s`` as float64 ``[M, K]`` (no global scale)."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes(q)]
    return values * decode_scales(s).repeat_interleave(BLOCK, dim=1)


def _nearest(values: torch.Tensor, candidates: torch.Tensor, candidate_codes: torch.Tensor) -> torch.Tensor:
    """For each of ``values`` (float64, >= 0), the code of the nearest candidate; ties go to the
    even code."""
    distance = (values.unsqueeze(-1) - candidates).abs()
    best = distance.min(dim=-1, keepdim=True).values
    is_best = distance == best
    # among the nearest, prefer an even code, then the smaller one
    preference = torch.where(is_best, candidate_codes % 2 * 1000 + candidate_codes, 10**6)
    return candidate_codes[preference.argmin(dim=-1)]


def e4m3_round_bits(v: torch.Tensor) -> torch.Tensor:
    """Round non-negative values (any float dtype, inf allowed, NaN -> 0x7F) to e4m3 bits,
    saturating at 448, ties to the even code."""
    finite_positive = torch.arange(0, E4M3_MAX_BITS + 1)
    candidates = torch.tensor(E4M3_VALUES[:E4M3_MAX_BITS + 1], dtype=torch.float64)
    flat = v.double().reshape(-1).clamp(max=448.0)
    bits = _nearest(torch.nan_to_num(flat, nan=0.0), candidates, finite_positive)
    return torch.where(torch.isnan(flat), E4M3_NAN_BITS, bits).reshape(v.shape)


def e2m1_round_codes(y: torch.Tensor) -> torch.Tensor:
    """Round values to e2m1 codes (nearest magnitude, ties to the even code, saturating at 6; the
    sign bit is the value's; NaN -> 0)."""
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64)
    flat = y.double().reshape(-1)
    mag = _nearest(torch.nan_to_num(flat.abs(), nan=0.0).clamp(max=6.0), magnitudes, torch.arange(8))
    sign = torch.signbit(flat).long() * 8
    return torch.where(torch.isnan(flat), 0, mag + sign).reshape(y.shape)


def expected_quantization(x: torch.Tensor, global_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K], scale bits [M, K/16])`` that the rule gives for ``x [M, K]``."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    gs = torch.tensor(global_scale, dtype=torch.float32)
    if not (global_scale > 0 and math.isfinite(global_scale)):
        return torch.zeros(m, k, dtype=torch.long), torch.full((m, k // BLOCK), E4M3_NAN_BITS)
    amax = blocks.abs().max(dim=-1).values
    amax = torch.where(torch.isnan(blocks).any(dim=-1), torch.tensor(math.nan), amax)
    bits = e4m3_round_bits((amax / 6.0) * gs)  # fp32 arithmetic, as the rule states
    s = torch.tensor(E4M3_VALUES, dtype=torch.float32)[bits].unsqueeze(-1)
    q = e2m1_round_codes((blocks * gs) / s)  # fp32 IEEE division
    dead = (s == 0) | torch.isnan(s)
    q = torch.where(dead, 0, q)
    return q.reshape(m, k), bits


def assert_quantized_by_the_rules(x: torch.Tensor, global_scale: float, q: torch.Tensor, s: torch.Tensor) -> None:
    """``(q, s)`` is exactly what the rule gives for ``x`` (every code and every scale byte)."""
    want_codes, want_bits = expected_quantization(x, global_scale)
    got_bits = scale_bits(s)
    bad_scales = (got_bits != want_bits).nonzero()
    assert bad_scales.numel() == 0, f"{len(bad_scales)} scales differ, first at {bad_scales[0].tolist()}: " \
        f"{got_bits[tuple(bad_scales[0])].item():#04x} vs {want_bits[tuple(bad_scales[0])].item():#04x}"
    got_codes = codes(q)
    bad_codes = (got_codes != want_codes).nonzero()
    assert bad_codes.numel() == 0, f"{len(bad_codes)} codes differ, first at {bad_codes[0].tolist()}: " \
        f"{got_codes[tuple(bad_codes[0])].item()} vs {want_codes[tuple(bad_codes[0])].item()}"
