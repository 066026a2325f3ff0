"""fp4fuse: tensor-parallel NVFP4 fusion passes for torch.compile / Inductor.

    import fp4fuse
    cfg = fp4fuse.FusionConfig(enable_sequence_parallelism=True, enable_async_tp=True)
    model = torch.compile(model, options={"post_grad_custom_post_pass": fp4fuse.FusionPass(cfg)})

Importing fp4fuse registers ``torch.ops.fp4fuse.*`` and makes ``NVFP4Tensor`` loadable with
``torch.load(weights_only=True)``; the pass machinery (which imports Inductor)
loads on first use of ``FusionPass`` / ``FusionConfig``.
"""
from __future__ import annotations

import importlib
from typing import Any

from fp4fuse import ops  # noqa: F401  (registers torch.ops.fp4fuse.*)
from fp4fuse.nvfp4.quantizer import (
    AmaxGroup,
    NVFP4Quantizer,
    UnknownAmaxGroupError,
    amax_group,
    amax_group_id,
    register_amax_group,
)
from fp4fuse.nvfp4.format import (
    dequantize_reference,
    global_scale_from_amax,
    quantize_reference,
    swizzle_scales,
    unswizzle_scales,
)
# Imported eagerly: it registers NVFP4Tensor for torch.load(weights_only=True) and dcp.load.
from fp4fuse.nvfp4.tensor import NVFP4Tensor, nvfp4_state_dict_for_dcp
from fp4fuse.config import warn_unknown_env as _warn_unknown_env

# A misspelled FP4FUSE_* variable (FP4FUSE_ENABLE_ASYNCTP) would otherwise be ignored without a word.
_warn_unknown_env()

_LAZY = {
    "FusionConfig": "fp4fuse.config",
    "FusionPass": "fp4fuse.passes.manager",
    "reserve_workspace": "fp4fuse.distributed.symm_mem.workspace",
}

__all__ = [
    "AmaxGroup",
    "FusionConfig",
    "FusionPass",
    "NVFP4Quantizer",
    "NVFP4Tensor",
    "UnknownAmaxGroupError",
    "amax_group",
    "amax_group_id",
    "dequantize_reference",
    "global_scale_from_amax",
    "nvfp4_state_dict_for_dcp",
    "quantize_reference",
    "register_amax_group",
    "reserve_workspace",
    "swizzle_scales",
    "unswizzle_scales",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fp4fuse' has no attribute {name!r}")
