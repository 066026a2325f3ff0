"""Tensor-parallel building blocks with NVFP4 linears, ``parallelize`` and ``load_checkpoint`` for
existing (Hugging Face) models, and a small Llama-style decoder.

``load_checkpoint`` and its layouts (fp4fuse.tp.checkpoint) load on first use: they need
``safetensors``, which the rest of fp4fuse does not."""
from __future__ import annotations

import importlib
from typing import Any

from fp4fuse.tp.dense import ColumnParallelLinear, RowParallelLinear
from fp4fuse.tp.layers import NormImpl, RMSNorm, VocabParallelEmbedding
from fp4fuse.tp.linear import ColumnParallelNVFP4Linear, NVFP4Linear, RowParallelNVFP4Linear, quantize_weight
from fp4fuse.tp.llama import LlamaConfig, TPLlamaAttention, TPLlamaDecoderLayer, TPLlamaMLP, TPLlamaModel
from fp4fuse.tp.parallel import TPGroup, seeded_normal, shard
from fp4fuse.tp.parallelize import WeightFormat, parallelize
from fp4fuse.tp.plan import ParallelStyle

_LAZY = {
    "BlockScaleLayout": "fp4fuse.tp.checkpoint_layouts",
    "CheckpointLayout": "fp4fuse.tp.checkpoint_layouts",
    "LoadReport": "fp4fuse.tp.checkpoint",
    "load_checkpoint": "fp4fuse.tp.checkpoint",
}

__all__ = [
    "BlockScaleLayout", "CheckpointLayout", "ColumnParallelLinear", "ColumnParallelNVFP4Linear", "LlamaConfig",
    "LoadReport", "NVFP4Linear", "NormImpl", "ParallelStyle", "RMSNorm", "RowParallelLinear",
    "RowParallelNVFP4Linear", "TPGroup", "TPLlamaAttention", "TPLlamaDecoderLayer", "TPLlamaMLP", "TPLlamaModel",
    "VocabParallelEmbedding", "WeightFormat", "load_checkpoint", "parallelize", "quantize_weight", "seeded_normal",
    "shard",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fp4fuse.tp' has no attribute {name!r}")
