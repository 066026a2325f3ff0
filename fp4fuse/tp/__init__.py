"""Tensor-parallel building blocks with NVFP4 linears, ``parallelize`` for existing (Hugging Face)
models, and a small Llama-style decoder."""
from fp4fuse.tp.dense import ColumnParallelLinear, RowParallelLinear
from fp4fuse.tp.layers import NormImpl, RMSNorm, VocabParallelEmbedding
from fp4fuse.tp.linear import ColumnParallelNVFP4Linear, NVFP4Linear, RowParallelNVFP4Linear, quantize_weight
from fp4fuse.tp.llama import LlamaConfig, TPLlamaAttention, TPLlamaDecoderLayer, TPLlamaMLP, TPLlamaModel
from fp4fuse.tp.parallel import TPGroup, seeded_normal, shard
from fp4fuse.tp.parallelize import WeightFormat, parallelize
from fp4fuse.tp.plan import ParallelStyle

__all__ = [
    "ColumnParallelLinear", "ColumnParallelNVFP4Linear", "LlamaConfig", "NVFP4Linear", "NormImpl",
    "ParallelStyle", "RMSNorm", "RowParallelLinear", "RowParallelNVFP4Linear", "TPGroup", "TPLlamaAttention",
    "TPLlamaDecoderLayer", "TPLlamaMLP", "TPLlamaModel", "VocabParallelEmbedding", "WeightFormat",
    "parallelize", "quantize_weight", "seeded_normal", "shard",
]
