"""fp4fuse: tensor-parallel NVFP4 fusion passes for torch.compile / Inductor."""
from fp4fuse import ops  # noqa: F401  (registers torch.ops.fp4fuse.*)
from fp4fuse.format import (
    dequantize_reference,
    global_scale_from_amax,
    quantize_reference,
    swizzle_scales,
    unswizzle_scales,
)

__all__ = [
    "dequantize_reference",
    "global_scale_from_amax",
    "quantize_reference",
    "swizzle_scales",
    "unswizzle_scales",
]
__version__ = "0.1.0"
