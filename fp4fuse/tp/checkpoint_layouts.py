"""The NVFP4 checkpoint layouts fp4fuse reads, and how their scales become fp4fuse's.

Per quantized linear ``<m>`` (``N`` output, ``K`` input features):

=================  =================================  ===========================================
                   ModelOpt (``quant_algo: NVFP4``)   compressed-tensors (``nvfp4-pack-quantized``)
=================  =================================  ===========================================
codes              ``<m>.weight`` U8 ``[N, K/2]``      ``<m>.weight_packed`` U8 ``[N, K/2]``
block scales       ``<m>.weight_scale`` F8_E4M3        ``<m>.weight_scale`` F8_E4M3 ``[N, K/16]``
                   ``[N, K/16]``
weight global      ``<m>.weight_scale_2`` F32,         ``<m>.weight_global_scale`` F32,
                   decode: ``amax / (448 * 6)``        encode: ``448 * 6 / amax``
input global       ``<m>.input_scale`` F32, decode     ``<m>.input_global_scale`` F32, encode
                                                       (absent for weight-only ``nvfp4a16``)
=================  =================================  ===========================================

Both agree with fp4fuse's format (docs/design.md) bit for bit in the codes: element ``2j`` in the
low nibble (ModelOpt ``NVFP4QTensor.quantize``: ``(q[..., 1::2] << 4) | q[..., 0::2]``;
compressed-tensors ``pack_fp4_to_uint8``: ``indices[:, 0] | indices[:, 1] << 4``), bit 3 the sign,
bits 2..0 indexing ``0, 0.5, 1, 1.5, 2, 3, 4, 6``. Block scales are linear (unswizzled, unpadded)
``[N, K/16]`` e4m3 in both; a checkpoint written with cuBLASLt's padded 128x4 layout is read with
``BlockScaleLayout.SWIZZLED`` and unswizzled (``fp4fuse.nvfp4.format.unswizzle_scales``).
Dequantization: ModelOpt ``q * (s * weight_scale_2)``, compressed-tensors ``q * (s /
weight_global_scale)``: fp4fuse's ``q * s / gs`` with ``gs = 1 / weight_scale_2`` (ModelOpt) or
``gs = weight_global_scale`` (compressed-tensors); the same for the input scale, which fp4fuse
quantizes activations with (vLLM: ``input_scale_inv = 1 / input_scale``).

Merged layers (q/k/v, gate/up in one module) may store one global scale per part. vLLM keeps the
largest amax and warns, leaving every other part's block scales as they were: those parts then
dequantize off by the ratio of the scales. fp4fuse instead requantizes: the common scale is the
one of the largest amax (no block scale can overflow) and each other part's block scales are
re-encoded as ``e4m3(s * gs_common / gs_part)`` with the codes unchanged. That is exact when the
parts agree (what llm-compressor and ModelOpt export, having fused these scales at calibration)
or differ by a power of two (unless a scale falls below e4m3's smallest normal, 2**-6); otherwise each
block scale moves by at most half an e4m3 step (more where it lands among e4m3's subnormals, or
flushes to 0) and a warning gives the largest relative change. Per-part input scales keep the largest amax (one
activation feeds every part), with a warning when they differ.
"""
from __future__ import annotations

import dataclasses
import enum
import logging

import torch

from fp4fuse.nvfp4 import format as nvfp4

__all__ = ["BlockScaleLayout", "CheckpointLayout", "LayoutNames", "ScaleConvention", "encode_global_scales",
           "merge_part_scales"]

logger = logging.getLogger(__name__)


class CheckpointLayout(enum.Enum):
    MODELOPT = "modelopt"
    COMPRESSED_TENSORS = "compressed-tensors"


class BlockScaleLayout(enum.Enum):
    LINEAR = "linear"      # [N, K/16] row-major: what ModelOpt and compressed-tensors write
    SWIZZLED = "swizzled"  # cuBLASLt/CUTLASS 128x4 tiles, padded to [round_up(N, 128), round_up(K/16, 4)]


class ScaleConvention(enum.Enum):
    ENCODE = "encode"  # gs = 448 * 6 / amax: x * gs lands in the e4m3 x e2m1 range (fp4fuse)
    DECODE = "decode"  # scale = amax / (448 * 6) = 1 / gs


@dataclasses.dataclass(frozen=True)
class LayoutNames:
    """Tensor names of one layout, relative to the module, and its global-scale convention."""

    weight: str
    block_scale: str
    weight_global_scale: str
    input_global_scale: str
    convention: ScaleConvention


LAYOUT_NAMES = {
    CheckpointLayout.MODELOPT: LayoutNames("weight", "weight_scale", "weight_scale_2", "input_scale",
                                           ScaleConvention.DECODE),
    CheckpointLayout.COMPRESSED_TENSORS: LayoutNames("weight_packed", "weight_scale", "weight_global_scale",
                                                     "input_global_scale", ScaleConvention.ENCODE),
}


def encode_global_scales(stored: torch.Tensor, convention: ScaleConvention, key: str) -> torch.Tensor:
    """Stored global scale(s) -> fp4fuse's encode convention, fp32 ``[n]`` (one per part).

    Decode-convention values are inverted in float64 and rounded once. ``ValueError`` naming ``key``
    unless every stored value is finite and > 0 and so is its fp32 encode-convention value."""
    values = stored.detach().double().reshape(-1)
    if values.numel() == 0 or not bool((torch.isfinite(values) & (values > 0)).all()):
        raise ValueError(f"load_checkpoint: {key} must hold finite global scales > 0 ({convention.value} "
                         f"convention), got {values.tolist()}")
    encoded = (1.0 / values if convention is ScaleConvention.DECODE else values).float()
    if not bool((torch.isfinite(encoded) & (encoded > 0)).all()):  # e.g. a decode scale below 1 / FLT_MAX
        raise ValueError(f"load_checkpoint: {key} = {values.tolist()} ({convention.value} convention) is out of "
                         f"fp32 range as an encode-convention global scale 448*6/amax: {encoded.tolist()}")
    return encoded


def merge_part_scales(block_scales: torch.Tensor, part_rows: tuple[int, ...], global_scales: torch.Tensor,
                      key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One encode-convention global scale for a merged weight whose parts (consecutive row blocks of
    ``part_rows`` rows) were quantized with ``global_scales[i]``: ``(block scales, gs [1])``.

    Requantizes the block scales to the smallest global scale (largest amax); see the module
    docstring. Logs a warning naming ``key`` when that is not exact."""
    if global_scales.numel() != len(part_rows):
        raise ValueError(f"load_checkpoint: {key} holds {global_scales.numel()} global scales for "
                         f"{len(part_rows)} merged parts")
    common = global_scales.min().reshape(1)
    if bool((global_scales == common).all()):
        return block_scales, common
    old = block_scales.float()
    ratio = torch.repeat_interleave(common / global_scales, torch.tensor(part_rows)).unsqueeze(-1)
    new = torch.clamp(old * ratio, max=nvfp4.E4M3_MAX).to(torch.float8_e4m3fn)
    before = old.double() / torch.repeat_interleave(global_scales.double(), torch.tensor(part_rows)).unsqueeze(-1)
    after = new.double() / common.double()
    change = float(((after - before).abs() / before.where(before > 0, torch.ones_like(before))).max())
    if change > 0:
        logger.warning("load_checkpoint: %s: merged parts carry different global scales %s; block scales "
                       "requantized to the common scale %s, largest relative change of a block scale %.3g",
                       key, global_scales.tolist(), float(common), change)
    return new, common
