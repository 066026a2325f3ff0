"""Tensor-parallel building blocks with NVFP4 linears, and a small Llama-style decoder."""
from fp4fuse.tp.layers import NormImpl, RMSNorm, VocabParallelEmbedding
from fp4fuse.tp.linear import ColumnParallelNVFP4Linear, NVFP4Linear, RowParallelNVFP4Linear, quantize_weight
from fp4fuse.tp.llama import LlamaConfig, TPLlamaAttention, TPLlamaDecoderLayer, TPLlamaMLP, TPLlamaModel
from fp4fuse.tp.parallel import TPGroup, seeded_normal, shard

__all__ = [
    "ColumnParallelNVFP4Linear", "LlamaConfig", "NVFP4Linear", "NormImpl", "RMSNorm",
    "RowParallelNVFP4Linear", "TPGroup", "TPLlamaAttention", "TPLlamaDecoderLayer", "TPLlamaMLP",
    "TPLlamaModel", "VocabParallelEmbedding", "quantize_weight", "seeded_normal", "shard",
]
