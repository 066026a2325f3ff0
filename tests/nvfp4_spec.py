"""The NVFP4 format written from its table (docs/design.md, "The NVFP4 format"), in float64, for
tests: the expected values of TP-layer, parallelize and checkpoint tests come from here, never from
fp4fuse.nvfp4.format or the ops under test.

* e2m1 code: bit 3 sign, bits 2..0 index into the magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6);
  packed two per byte, element ``2j`` in the low nibble.
* e4m3 (float8_e4m3fn) byte: bit 7 sign, bits 6..3 exponent (bias 7), bits 2..0 mantissa;
  exponent 0 is subnormal (``m/8 * 2**-6``); ``S.1111.111`` is NaN; no infinities.
* value = code * block_scale / global_scale (encode convention ``gs = 448 * 6 / amax``).
* quantize: ``s = e4m3(min(block_amax / 6 * gs, 448))``, ``q = e2m1_rne(x * gs / s)`` (fp32 math).
"""
from __future__ import annotations

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = 16


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[R, C]`` -> float64 ``[R, 2C]``: the low nibble is element 2j, the high one 2j+1."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    sign = torch.where(codes & 0x8 != 0, -1.0, 1.0).to(torch.float64)
    return sign * table[codes & 0x7]


def decode_e4m3(scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its uint8 bytes) -> float64, from the bit fields."""
    bits = (scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales).long()
    sign = torch.where(bits & 0x80 != 0, -1.0, 1.0).to(torch.float64)
    exp, man = (bits >> 3) & 0xF, (bits & 0x7).to(torch.float64)
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).to(torch.float64))
    value = torch.where(exp == 0, man / 8 * 2.0 ** -6, normal)
    value = torch.where((exp == 0xF) & (bits & 0x7 == 0x7), torch.full_like(value, float("nan")), value)
    return sign * value


def dequantize(q: torch.Tensor, s: torch.Tensor, gs: torch.Tensor | float) -> torch.Tensor:
    """``code * block_scale / gs`` as float64 ``[R, K]``."""
    codes = decode_e2m1(q)
    rows, k = codes.shape
    blocks = codes.reshape(rows, k // BLOCK, BLOCK) * decode_e4m3(s).unsqueeze(-1)
    return blocks.reshape(rows, k) / float(torch.as_tensor(gs, dtype=torch.float64).reshape(()))


def _e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value, ties to the even code (mantissa bit 0), saturating at 6."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    dist = (v.abs().unsqueeze(-1).double() - table).abs()
    best = dist.min(dim=-1, keepdim=True).values
    # of the (at most two, adjacent) nearest magnitudes take the one with the even index
    candidates = torch.where(dist == best, (torch.arange(8) % 2).double(), torch.tensor(9.0))
    mag = table[candidates.argmin(dim=-1)]
    return torch.where(v < 0, -mag, mag)


def fake_quantize(x: torch.Tensor, gs: float | torch.Tensor) -> torch.Tensor:
    """``x [R, K]`` quantized to NVFP4 with global scale ``gs`` and decoded again, float64."""
    gs32 = torch.as_tensor(gs, dtype=torch.float32).reshape(())
    rows, k = x.shape
    xb = x.float().reshape(rows, k // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    s = torch.clamp(amax / 6 * gs32, max=448.0).to(torch.float8_e4m3fn).float()
    scaled = torch.where(s == 0, torch.zeros_like(xb), (xb * gs32) / s)
    return (_e2m1_round(scaled) * s.double() / gs32.double()).reshape(rows, k)


def encode_gs(amax: float | torch.Tensor) -> torch.Tensor:
    """fp4fuse's encode-convention global scale ``448 * 6 / amax`` as fp32 ``[1]``."""
    return (torch.tensor(448.0 * 6.0, dtype=torch.float64) / torch.as_tensor(amax, dtype=torch.float64)
            ).float().reshape(1)


def representable(rows: int, k: int, gs: float, generator: torch.Generator) -> torch.Tensor:
    """A float64 ``[rows, k]`` tensor that NVFP4 with a *dynamic* global scale holds exactly.

    Random e2m1 values and e4m3 block scales in [2**-3, 448], divided by ``gs`` (a power of two):
    every block's first element has magnitude 6, so its amax gives back its block scale exactly, and
    every row's first block scale is 448, so the tensor's amax is ``6 * 448 / gs`` and a dynamic
    global scale is ``gs`` again. Values carry at most 6 significant bits: exact in bf16 and fp32,
    and products of two of them sum exactly in float64 (43-bit span) in any order."""
    codes = torch.randint(0, 16, (rows, k // BLOCK, BLOCK), generator=generator)
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    sign = torch.where(codes & 0x8 != 0, -1.0, 1.0).double()
    values = sign * table[codes & 0x7]
    values[..., 0] = sign[..., 0] * 6.0
    exps = torch.randint(-3, 8, (rows, k // BLOCK), generator=generator).double()
    mants = torch.randint(0, 8, (rows, k // BLOCK), generator=generator).double()
    scales = torch.clamp((1 + mants / 8) * torch.pow(2.0, exps), max=448.0)
    scales[:, 0] = 448.0
    return (values * scales.unsqueeze(-1)).reshape(rows, k) / gs
