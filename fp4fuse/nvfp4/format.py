"""The NVFP4 format in pure torch: the reference every kernel is checked against.

Layout (canonical in fp4fuse, see docs/design.md):

* data: ``uint8 [M, K/2]``; element ``2j`` in the low nibble, ``2j+1`` in the high nibble.
  e2m1 code: bit 3 sign, bits 2..1 exponent, bit 0 mantissa; magnitudes
  ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.
* block scales: ``float8_e4m3fn [M, K/16]``, row-major, unpadded, unswizzled ("linear").
* global scale ``gs``: fp32, one element, encode convention ``gs = 448 * 6 / amax``, with the value
  torch gives that expression for an fp32 tensor ``amax``: ``reciprocal(amax) * 2688``, each step
  rounded to fp32 (``global_scale_from_amax``; what a caller of vLLM's or flashinfer's quantization
  writes in torch). It is 1 ulp from the IEEE quotient ``2688 / amax`` (TransformerEngine's kernel
  divides) for about a quarter of amaxes; the two then quantize a tensor differently (other block
  scales and codes, equally accurate: each decodes with its own ``gs``), never inconsistently.

Quantize, all arithmetic in fp32 with IEEE round-to-nearest division::

    s = e4m3(min(block_amax / 6 * gs, 448))        # saturating; NaN stays NaN
    q = e2m1_rne((x * gs) / s)  clamped to +-6     # s == 0 -> q = 0

fp4fuse divides by the decoded block scale (``(x * gs) / s``). torchao and TransformerEngine
multiply by ``(1 / gs') / s`` with ``gs' = 1 / gs``; the two can differ only where the rounded
reciprocals move a value off an exact e2m1 tie (fp4fuse sees ``x*gs/s == 3.5`` and rounds to even,
the reciprocal form sees ``3.4999998``). Measured against torchao 0.18
``nvfp4_quantize(x, 16, per_tensor_scale=1/gs)`` over 5.2M elements per case: fp32 input 0 to
2e-7 of codes differ; bf16 input, whose coarse mantissa makes exact ties common, 1.2e-4 to 5.9e-4;
block scales never differ where they are normal (tests/test_format.py bounds the rates at 1e-3).
torchao also clamps ``s`` to at least the smallest normal e4m3 (2**-6); fp4fuse keeps subnormal
block scales, which is more accurate for blocks far below the tensor's amax.

Non-finite input (defined, tested): a NaN anywhere in a 16-element block makes that block's scale
NaN (the block dequantizes to NaN) and the NaN elements' codes 0; ``+-inf`` saturates, giving block
scale 448 and code ``+-6``. ``global_scale_from_amax`` maps amax 0 to 1 and a non-finite amax to NaN.

Global scale outside ``(0, inf)`` (defined, tested; every backend): a global scale that is 0,
negative (``-0.0`` included), ``+-inf`` or NaN poisons the whole tensor: every block scale is NaN
(e4m3 ``0x7F``) and every code 0, so it dequantizes to NaN everywhere, never to plausible
numbers. The ops cannot reject such a scale: it lives on the device, and reading it would cost a
host sync per call (and break CUDA-graph capture). A finite but huge scale is legitimate and
saturates: with ``gs = 1e30`` every nonzero block gets scale 448 and its elements codes ``+-6``
(``x * gs`` overflows to ``+-inf``), all-zero blocks scale 0.
"""
from __future__ import annotations

import torch

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E4M3_MAX",
    "E2M1_VALUES",
    "e2m1_encode",
    "e2m1_decode",
    "pack_nibbles",
    "unpack_nibbles",
    "global_scale_from_amax",
    "block_scales",
    "poison_unless_valid_global_scale",
    "quantize_reference",
    "dequantize_reference",
    "mm_fp4_reference",
    "swizzle_scales",
    "unswizzle_scales",
    "swizzled_shape",
]

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Round-to-nearest-even decision points on the magnitude grid: at a tie (0.25, 1.25, 2.5, 5) the
# lower neighbour has the even code, so the comparison is strict; at 0.75, 1.75, 3.5 the upper
# neighbour is even, so the comparison is inclusive. code = number of thresholds passed.
_RNE_STRICT = (0.25, 1.25, 2.5, 5.0)
_RNE_INCLUSIVE = (0.75, 1.75, 3.5)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to e2m1 codes (uint8 in [0, 15]), ties to even, saturating at +-6.

    NaN encodes as code 0 (magnitude 0, sign from the sign bit)."""
    a = v.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for t in _RNE_STRICT:
        mag += (a > t).to(torch.uint8)
    for t in _RNE_INCLUSIVE:
        mag += (a >= t).to(torch.uint8)
    # NaN has no e2m1 code: it encodes as +0 whatever its sign bit (x86 produces -NaN for 0*inf).
    sign = (torch.signbit(v) & ~torch.isnan(v)).to(torch.uint8) << 3
    return mag | sign


_E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=torch.float32)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode e2m1 codes (any integer dtype, values in [0, 15]) to ``dtype``."""
    table = _E2M1_TABLE.to(device=codes.device, dtype=dtype)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> ``uint8 [..., K/2]``; element 2j in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., K/2]`` -> codes ``uint8 [..., K]``."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Encode-convention global scale ``448 * 6 / amax`` (fp32) as torch evaluates it for a tensor:
    ``reciprocal(amax) * 2688`` (module docstring); amax 0 -> 1, non-finite -> NaN. The dynamic-scale
    pass and the quantization kernels that compute it on the device follow these operations."""
    amax = amax.float()
    gs = torch.reciprocal(amax) * (E4M3_MAX * E2M1_MAX)
    gs = torch.where(amax == 0, torch.ones_like(gs), gs)
    return torch.where(torch.isfinite(amax), gs, torch.full_like(gs, float("nan")))


def block_scales(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales from fp32 block amaxes: ``e4m3(min(amax / 6 * gs, 448))``; every scale is
    NaN (``0x7F``) unless ``0 < gs < inf`` (module docstring)."""
    s = block_amax / E2M1_MAX * global_scale
    gs_ok = (global_scale > 0) & torch.isfinite(global_scale)
    # +NaN explicitly: a NaN computed from the bad scale (0 * inf on x86) may carry the sign bit,
    # which would encode as 0xFF.
    s = torch.where(gs_ok, s, torch.full_like(s, float("nan")))
    # clamp_max keeps NaN; torch's cast to e4m3fn does not saturate, so clamp first.
    return torch.clamp(s, max=E4M3_MAX).to(torch.float8_e4m3fn)


def poison_unless_valid_global_scale(
    q: torch.Tensor, s: torch.Tensor, global_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)`` where ``0 < global_scale < inf``; else every code 0 and every block scale NaN
    (``0x7F``): the poison rule (module docstring) applied on the device, without a host sync, to
    a quantization whose kernel does not follow it itself (a third-party kernel)."""
    gs = global_scale.float().reshape(())
    gs_ok = (gs > 0) & torch.isfinite(gs)
    q = torch.where(gs_ok, q, torch.zeros_like(q))
    s = torch.where(gs_ok, s.view(torch.uint8), torch.full_like(s.view(torch.uint8), 0x7F))
    return q, s.view(torch.float8_e4m3fn)


def quantize_reference(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` to ``(q uint8 [M, K/2], s float8_e4m3fn [M, K/16])``.

    No input validation here (the op layer validates); K must be a multiple of 16. A global
    scale outside ``(0, inf)`` gives NaN scales and zero codes (module docstring)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK_SIZE, BLOCK_SIZE)
    gs = global_scale.float().reshape(())
    amax = xb.abs().amax(dim=-1)
    # amax() drops NaN on some backends; make the NaN rule explicit.
    amax = torch.where(torch.isnan(xb).any(dim=-1), torch.full_like(amax, float("nan")), amax)
    s = block_scales(amax, gs)
    s32 = s.float().unsqueeze(-1)
    scaled = (xb * gs) / s32
    dead = (s32 == 0) | torch.isnan(s32)  # all-zero or poisoned block: every code 0
    scaled = torch.where(dead, torch.zeros_like(scaled), scaled)
    codes = e2m1_encode(scaled).reshape(m, k)
    return pack_nibbles(codes), s


def dequantize_reference(
    q: torch.Tensor, s: torch.Tensor, global_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q * s / gs`` as ``[M, K]`` in ``dtype`` (computed in fp32; gs None means 1)."""
    m, k = q.shape[0], q.shape[1] * 2
    vals = e2m1_decode(unpack_nibbles(q)).reshape(m, k // BLOCK_SIZE, BLOCK_SIZE) * s.float().unsqueeze(-1)
    out = vals.reshape(m, k)
    if global_scale is not None:
        out = out / global_scale.float().reshape(())
    return out.to(dtype)


def mm_fp4_reference(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``alpha * (q_a * s_a) @ (q_b * s_b)^T`` computed in float64, rounded once to ``out_dtype``.

    Every e2m1 x e4m3 product is exact in float64 and each output element depends only on its
    own row of ``a``, so per-shard GEMMs reproduce the full GEMM bit for bit."""
    da = dequantize_reference(a, a_scale).double()
    db = dequantize_reference(b, b_scale).double()
    out = (da @ db.t()) * alpha.double().reshape(())
    return out.to(out_dtype)


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Padded shape of the 128x4 swizzled layout for a ``[rows, cols]`` scale matrix."""
    return (-(-rows // 128) * 128, -(-cols // 4) * 4)


def swizzle_scales(s: torch.Tensor) -> torch.Tensor:
    """Linear ``[M, C]`` scales -> cuBLASLt/CUTLASS 128x4 layout, zero-padded, shape
    ``swizzled_shape(M, C)``; flat element of ``(r, c)`` is at
    ``((r//128 * ceil(C/4) + c//4) * 32 + r%32) * 16 + (r%128)//32 * 4 + c%4``."""
    m, c = s.shape
    mp, cp = swizzled_shape(m, c)
    raw = s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s
    padded = raw.new_zeros(mp, cp)
    padded[:m, :c] = raw
    # (r_tile, r4, r32, c_tile, c4) -> (r_tile, c_tile, r32, r4, c4)
    tiles = padded.reshape(mp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    out = tiles.reshape(mp, cp).contiguous()
    return out.view(s.dtype) if s.dtype == torch.float8_e4m3fn else out


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: back to linear ``[rows, cols]``."""
    mp, cp = swizzled_shape(rows, cols)
    is_fp8 = swizzled.dtype == torch.float8_e4m3fn
    raw = swizzled.view(torch.uint8) if is_fp8 else swizzled
    tiles = raw.reshape(mp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    out = tiles.reshape(mp, cp)[:rows, :cols].contiguous()
    return out.view(torch.float8_e4m3fn) if is_fp8 else out
