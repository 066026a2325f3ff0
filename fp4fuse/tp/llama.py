"""A small Llama-style decoder built from fp4fuse's TP layers: the model the SP / AsyncTP passes
are tested on end to end.

    ids [T] -> VocabParallelEmbedding (all_reduce)
    per layer:  input_norm -> qkv (column, merged) -> causal SDPA on local heads -> o (row, all_reduce)
                post_attention_norm -> gate_up (column, merged) -> SwiGLU -> down (row, all_reduce)
    final norm -> hidden [T, hidden] (bf16; no LM head)

The residual stream is vLLM's: the first layer's input norm reads the embedding (which is also the
residual), later norms are fused add + norm. Tokens are one sequence, flattened to rows (no batch
dimension, no KV cache, no rotary embedding). SwiGLU is computed in float32 and rounded once, so
eager and compiled code round the same way.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from fp4fuse.nvfp4.quantizer import NVFP4Quantizer
from fp4fuse.tp.layers import NormImpl, RMSNorm, VocabParallelEmbedding
from fp4fuse.tp.linear import ColumnParallelNVFP4Linear, RowParallelNVFP4Linear
from fp4fuse.tp.parallel import TPGroup, seeded_normal

__all__ = ["LlamaConfig", "TPLlamaAttention", "TPLlamaDecoderLayer", "TPLlamaMLP", "TPLlamaModel"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and numerics of the test model. ``act_global_scale`` None quantizes activations with
    a dynamic scale (their amax); a float makes every activation quantizer static."""

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    rms_norm_eps: float = 1e-6
    norm_impl: NormImpl = NormImpl.FP4FUSE
    act_global_scale: float | None = None
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def act_quantizer(self) -> NVFP4Quantizer:
        return NVFP4Quantizer(global_scale=self.act_global_scale)


def _weight(cfg: LlamaConfig, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    return seeded_normal(cfg.seed, name, shape, std=1.0 / math.sqrt(shape[-1])).to(cfg.dtype)


def _norm(cfg: LlamaConfig, name: str, device: torch.device) -> RMSNorm:
    weight = seeded_normal(cfg.seed, name, (cfg.hidden_size,), std=0.1, mean=1.0).to(cfg.dtype)
    return RMSNorm(weight.to(device), cfg.rms_norm_eps, cfg.norm_impl)


class TPLlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, group: TPGroup, prefix: str, device: torch.device) -> None:
        super().__init__()
        d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        if h % kv:
            raise ValueError(f"num_heads = {h} must be a multiple of num_kv_heads = {kv}")
        self.local_heads = group.split(h, "num_heads")
        self.local_kv_heads = group.split(kv, "num_kv_heads")
        self.head_dim = d
        qkv = _weight(cfg, f"{prefix}.qkv", ((h + 2 * kv) * d, cfg.hidden_size))
        self.qkv_proj = ColumnParallelNVFP4Linear(qkv, group, cfg.act_quantizer(), cfg.dtype,
                                                  parts=(h * d, kv * d, kv * d))
        o = _weight(cfg, f"{prefix}.o", (cfg.hidden_size, h * d))
        self.o_proj = RowParallelNVFP4Linear(o, group, cfg.act_quantizer(), cfg.dtype)
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(list(self.qkv_proj.local_parts), dim=-1)
        q = q.reshape(tokens, self.local_heads, self.head_dim).transpose(0, 1)
        k = k.reshape(tokens, self.local_kv_heads, self.head_dim).transpose(0, 1)
        v = v.reshape(tokens, self.local_kv_heads, self.head_dim).transpose(0, 1)
        groups = self.local_heads // self.local_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(attn.transpose(0, 1).reshape(tokens, self.local_heads * self.head_dim).contiguous())


class TPLlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, group: TPGroup, prefix: str, device: torch.device) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        gate_up = _weight(cfg, f"{prefix}.gate_up", (2 * inter, cfg.hidden_size))
        self.gate_up_proj = ColumnParallelNVFP4Linear(gate_up, group, cfg.act_quantizer(), cfg.dtype,
                                                      parts=(inter, inter))
        down = _weight(cfg, f"{prefix}.down", (cfg.hidden_size, inter))
        self.down_proj = RowParallelNVFP4Linear(down, group, cfg.act_quantizer(), cfg.dtype)
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(x.dtype)
        return self.down_proj(act)


class TPLlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, group: TPGroup, index: int, device: torch.device) -> None:
        super().__init__()
        prefix = f"layers.{index}"
        self.input_norm = _norm(cfg, f"{prefix}.input_norm", device)
        self.attn = TPLlamaAttention(cfg, group, f"{prefix}.attn", device)
        self.post_attention_norm = _norm(cfg, f"{prefix}.post_attention_norm", device)
        self.mlp = TPLlamaMLP(cfg, group, f"{prefix}.mlp", device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.input_norm(x)
        else:
            h, residual = self.input_norm(x, residual)
        h, residual = self.post_attention_norm(self.attn(h), residual)
        return self.mlp(h), residual


class TPLlamaModel(nn.Module):
    """``forward(ids [T] int64) -> hidden [T, hidden_size]``, replicated on every rank."""

    def __init__(self, cfg: LlamaConfig, group: TPGroup, device: torch.device | str = "cpu") -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        embed = seeded_normal(cfg.seed, "embed", (cfg.vocab_size, cfg.hidden_size)).to(cfg.dtype)
        self.embed = VocabParallelEmbedding(embed, group).to(device)
        self.layers = nn.ModuleList(TPLlamaDecoderLayer(cfg, group, i, device) for i in range(cfg.num_layers))
        self.norm = _norm(cfg, "final_norm", device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed(ids), None
        for layer in self.layers:
            x, residual = layer(x, residual)
        out, _ = self.norm(x, residual)
        return out
