"""Test helpers for NVFP4Tensor: the payload as bits, and a float64 decoder written from the format.

``decode64`` is independent of fp4fuse's code: it reads the codes through the e2m1 table of
docs/design.md (element ``2j`` in the low nibble; bit 3 sign, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4,
6), the e4m3 scales through torch's own float8 conversion, and the global scale from its
definition ``448 * 6 / amax`` (1 when amax is 0), all in float64."""
from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def weight(seed: int, rows: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 3).to(dtype)


def bits(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale bytes, amax bits) of an NVFP4Tensor, on the CPU."""
    return t.qdata.cpu(), t.scale.view(torch.uint8).cpu(), t.amax.view(torch.int32).cpu()


def same_payload(a, b) -> bool:
    """The two NVFP4Tensors have the same shape and payload, bit for bit."""
    return tuple(a.shape) == tuple(b.shape) and all(torch.equal(x, y) for x, y in zip(bits(a), bits(b)))


def decode64(t) -> torch.Tensor:
    """The value of NVFP4Tensor ``t`` in float64 (see the module docstring)."""
    q = t.qdata.cpu().long()
    codes = torch.stack((q & 0xF, q >> 4), dim=-1).flatten(-2)
    magnitude = torch.tensor(E2M1, dtype=torch.float64)[codes & 0x7]
    signed = torch.where((codes & 0x8) != 0, -magnitude, magnitude)
    scales = t.scale.cpu().to(torch.float64).repeat_interleave(16, dim=-1)
    amax = float(t.amax.cpu().double())
    global_scale = 1.0 if amax == 0 else 448.0 * 6.0 / amax
    return signed * scales / global_scale
