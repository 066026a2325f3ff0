"""NVFP4 written down again from its tables (docs/design.md, "The NVFP4 format"), for tests: the one
independent reference every test checks fp4fuse against.

Contract:

* Independent: this module imports only ``math`` and ``torch`` and shares no code with
  ``fp4fuse.nvfp4.format`` or the ops under test; it does not use torch's float8 casts either (an
  e4m3 tensor is only read as its bytes). Expected values come from here, never from fp4fuse.
* One table, one decoder, one rule:

  - e2m1: the literal 16-entry table ``E2M1_VALUES`` indexed by the code (bit 3 sign, bits 2..0
    index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6); packed two per byte, element ``2j`` of a
    row in the low nibble of byte ``j`` (``codes``).
  - e4m3fn: decoded from its bit fields by ``decode_e4m3`` (bit 7 sign, bits 6..3 exponent with
    bias 7, bits 2..0 mantissa; exponent 0 is subnormal ``m/8 * 2**-6``; ``S.1111.111`` is NaN;
    no infinities). Every other e4m3 value here (the rounding candidates, ``representable``'s
    block scales) comes from that decoder.
  - dequantize: ``code * block_scale / gs`` in float64, one e4m3 scale per ``BLOCK`` = 16
    elements (``dequantize``; ``fake_quantize`` is the rule followed by it).
  - quantize, the rule in fp32 with the global scale taken as fp32 (``expected_quantization``):
    ``s = e4m3(min(block_amax / 6 * gs, 448))``, ``q = e2m1(x * gs / s)`` (fp32 IEEE division,
    saturating at 6, +-inf included), both rounded by searching the tables for the nearest value,
    ties to the even code, instead of by thresholds; the code's sign bit is the value's (``-0.0``
    -> code 8). ``s == 0`` -> every code of the block 0; NaN in a block -> its scale NaN (0x7F),
    its codes 0; a global scale outside ``(0, inf)`` -> every scale NaN, every code 0.

* Outputs: decoded values are float64 (``dequantize``, ``decode_e4m3``, ``fake_quantize``,
  ``representable``); codes and scale bytes are int64 (``codes``, ``scale_bits``,
  ``expected_quantization``). A NaN scale decodes its whole block to NaN.
* ``representable`` draws tensors that NVFP4 with a dynamic global scale holds exactly (its
  docstring states the guarantees); ``encode_gs`` is the encode-convention global scale.
"""
from __future__ import annotations

import math

import torch

BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E4M3_NAN_BITS = 0x7F
E4M3_MAX_BITS = 0x7E  # 448


# --------------------------------------------------------------------------- decoding


def codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., C]`` -> int64 e2m1 codes ``[..., 2C]``, element 2j from the low nibble."""
    low, high = q.long() & 0xF, q.long() >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def scale_bits(s: torch.Tensor) -> torch.Tensor:
    """Raw bytes of an e4m3 tensor (or of its uint8 view) as int64."""
    return s.view(torch.uint8).long()


def decode_e4m3(s: torch.Tensor) -> torch.Tensor:
    """e4m3fn values -> float64, from the bit fields. ``s`` is a float8_e4m3fn tensor, its uint8
    bytes, or byte values in any integer dtype (e.g. ``scale_bits`` or ``expected_quantization``'s
    scale bits)."""
    bits = scale_bits(s) if s.dtype == torch.float8_e4m3fn else s.long()
    sign = torch.where(bits & 0x80 != 0, -1.0, 1.0).to(torch.float64)
    exponent, mantissa = (bits >> 3) & 0xF, (bits & 0x7).to(torch.float64)
    normal = (1 + mantissa / 8) * torch.pow(2.0, (exponent - 7).to(torch.float64))
    value = torch.where(exponent == 0, mantissa / 8 * 2.0 ** -6, normal)
    value = torch.where((exponent == 0xF) & (bits & 0x7 == 0x7), torch.full_like(value, math.nan), value)
    return sign * value


def _decode_codes(code: torch.Tensor, bits: torch.Tensor, gs: torch.Tensor | float) -> torch.Tensor:
    """int64 codes ``[R, K]`` and scale bytes ``[R, K/16]`` -> ``code * block_scale / gs`` float64."""
    rows, k = code.shape
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64)[code].reshape(rows, k // BLOCK, BLOCK)
    blocks = values * decode_e4m3(bits).unsqueeze(-1)
    return blocks.reshape(rows, k) / float(torch.as_tensor(gs, dtype=torch.float64).reshape(()))


def dequantize(q: torch.Tensor, s: torch.Tensor, gs: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Packed uint8 ``q [R, K/2]`` and e4m3 ``s [R, K/16]`` -> ``code * block_scale / gs`` as float64
    ``[R, K]`` (``gs`` a number or a one-element tensor, used in float64 as given; the default 1
    gives ``code * block_scale``, no global scale)."""
    return _decode_codes(codes(q), scale_bits(s), gs)


# --------------------------------------------------------------------------- the quantize rule


def _nearest(values: torch.Tensor, candidates: torch.Tensor, candidate_codes: torch.Tensor) -> torch.Tensor:
    """For each of ``values`` (float64, finite, >= 0), the code of the nearest candidate; ties go to
    the even code."""
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
    candidates = decode_e4m3(finite_positive)
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


def expected_quantization(x: torch.Tensor, gs: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K], scale bits [M, K/16])``, int64, that the rule gives for ``x [M, K]`` with the
    global scale ``gs`` (a number or a one-element tensor, taken as fp32)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    gs32 = torch.as_tensor(gs, dtype=torch.float32).reshape(())
    if not (float(gs32) > 0 and math.isfinite(float(gs32))):
        return torch.zeros(m, k, dtype=torch.long), torch.full((m, k // BLOCK), E4M3_NAN_BITS)
    amax = blocks.abs().max(dim=-1).values
    amax = torch.where(torch.isnan(blocks).any(dim=-1), torch.tensor(math.nan), amax)
    bits = e4m3_round_bits((amax / 6.0) * gs32)  # fp32 arithmetic, as the rule states
    s = decode_e4m3(bits).float().unsqueeze(-1)
    q = e2m1_round_codes((blocks * gs32) / s)  # fp32 IEEE division
    dead = (s == 0) | torch.isnan(s)
    q = torch.where(dead, 0, q)
    return q.reshape(m, k), bits


def fake_quantize(x: torch.Tensor, gs: torch.Tensor | float) -> torch.Tensor:
    """``x [R, K]`` quantized by the rule with global scale ``gs`` and dequantized again: float64
    ``code * block_scale / gs`` with ``gs`` rounded to fp32 as the rule uses it."""
    gs32 = torch.as_tensor(gs, dtype=torch.float32).reshape(())
    code, bits = expected_quantization(x, gs32)
    return _decode_codes(code, bits, gs32)


def assert_quantized_by_the_rules(x: torch.Tensor, gs: torch.Tensor | float, q: torch.Tensor, s: torch.Tensor) -> None:
    """``(q, s)`` is exactly what the rule gives for ``x`` (every code and every scale byte)."""
    want_codes, want_bits = expected_quantization(x, gs)
    got_bits = scale_bits(s)
    bad_scales = (got_bits != want_bits).nonzero()
    assert bad_scales.numel() == 0, f"{len(bad_scales)} scales differ, first at {bad_scales[0].tolist()}: " \
        f"{got_bits[tuple(bad_scales[0])].item():#04x} vs {want_bits[tuple(bad_scales[0])].item():#04x}"
    got_codes = codes(q)
    bad_codes = (got_codes != want_codes).nonzero()
    assert bad_codes.numel() == 0, f"{len(bad_codes)} codes differ, first at {bad_codes[0].tolist()}: " \
        f"{got_codes[tuple(bad_codes[0])].item()} vs {want_codes[tuple(bad_codes[0])].item()}"


# --------------------------------------------------------------------------- scales and test data


def encode_gs(amax: float | torch.Tensor) -> torch.Tensor:
    """The encode-convention global scale ``448 * 6 / amax`` (computed in float64, rounded once) as
    fp32 ``[1]``."""
    return (torch.tensor(448.0 * 6.0, dtype=torch.float64) / torch.as_tensor(amax, dtype=torch.float64)
            ).float().reshape(1)


def dynamic_gs(amax: float | torch.Tensor) -> torch.Tensor:
    """The global scale fp4fuse derives from an amax at run time (README, "The NVFP4 format"): the
    value torch gives ``448 * 6 / amax`` for an fp32 tensor, the fp32 reciprocal times 2688, each
    rounded to fp32; as fp32 ``[1]``. Emulated in float64, exactly: rounding the float64 quotient
    to fp32 gives the correctly rounded fp32 quotient (double rounding is innocuous for a division
    when the wider format has at least 2p + 2 bits: 53 >= 2 * 24 + 2), and the product of two fp32
    numbers is exact in float64 before its one rounding."""
    a = torch.as_tensor(amax, dtype=torch.float64).float().double()
    return ((1.0 / a).float().double() * 2688.0).float().reshape(1)


def representable(rows: int, k: int, gs: float, generator: torch.Generator) -> torch.Tensor:
    """A float64 ``[rows, k]`` tensor that NVFP4 with a *dynamic* global scale holds exactly.

    Random e2m1 values times random normal e4m3 block scales in [2**-3, 240], divided by ``gs`` (a
    power of two): every block's first element has magnitude 6, so its amax gives back its block
    scale exactly, and every row's first block scale is 448, so the tensor's amax is
    ``6 * 448 / gs`` and a dynamic global scale is ``gs`` again. Values carry at most 6 significant
    bits: exact in bf16 and fp32, and products of two of them sum exactly in float64 (43-bit span)
    in any order. The same generator state gives the same tensor."""
    code = torch.randint(0, 16, (rows, k // BLOCK, BLOCK), generator=generator)
    code[..., 0] |= 0x7  # magnitude 6, the drawn sign
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64)[code]
    exponents = torch.randint(-3, 8, (rows, k // BLOCK), generator=generator)
    mantissas = torch.randint(0, 8, (rows, k // BLOCK), generator=generator)
    bits = (exponents + 7) << 3 | mantissas
    bits[:, 0] = E4M3_MAX_BITS
    return (values * decode_e4m3(bits).unsqueeze(-1)).reshape(rows, k) / gs
