"""Tiny Hugging Face models with random weights, and an NVFP4 reference of them in float64, for the
parallelize and checkpoint tests (which import transformers; the helpers here import it lazily so
that a module collecting without transformers can skip).

Model: 2 layers, hidden 96, intermediate 160, 6 heads of 16 (2 KV heads), vocab 100: every split
at TP=2 is whole heads and 16-aligned, and no size is a power of two. ``initializer_range`` 0.1 (HF's
0.02 gives logits too small to compare relatively); Qwen2's q/k/v biases are drawn N(0, 0.5) so
that they matter.

Reference: the same HF model in float64 whose planned linears are replaced by
:class:`FakeQuantLinear`: the weight as NVFP4 decodes it (given in float64), the input quantized and
decoded with the format table (nvfp4_oracle) -- a static global scale, or a dynamic one from the
amax of each of ``chunks`` column blocks (a row-parallel layer at TP=``chunks`` quantizes each rank's
slice with its own amax) -- products in float64, bias added after the sum.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

import nvfp4_oracle as oracle

LAYERS = 2
VOCAB = 100
#: special token ids inside the tiny vocabulary (some configs default to ids past it)
_SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
#: the (column-parallel, row-parallel) linears of the kinds whose names differ from Llama's, from
#: their HF plans: GLM merges gate/up (gathered, then chunked), Phi-3 also q/k/v (gathered); Starcoder2
#: names its MLP c_fc / c_proj
PROJECTIONS = {
    "glm": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_up_proj"), ROWWISE),
    "phi3": (("self_attn.qkv_proj", "mlp.gate_up_proj"), ROWWISE),
    "starcoder2": (COLWISE[:3] + ("mlp.c_fc",), ("self_attn.o_proj", "mlp.c_proj")),
}


def build(kind: str, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = LAYERS) -> nn.Module:
    """A ``LlamaForCausalLM`` (``kind="llama"``; ``"llama-tied"``: LM head tied to the input
    embedding), ``Qwen2ForCausalLM`` (``"qwen2"``), ``GraniteForCausalLM`` (``"granite"``: the
    embedding and every row-parallel output multiplied by a number before the norm / residual add),
    ``Starcoder2ForCausalLM`` (``"starcoder2"``: LayerNorm, biases on every linear, one MLP input
    projection ``c_fc``), ``Olmo2ForCausalLM`` (``"olmo2"``: q/k norms over the whole projection,
    so its plan gathers q/k/v and splits o_proj's input), ``GlmForCausalLM`` (``"glm"``: merged
    gate/up, gathered, then chunked), ``Phi3ForCausalLM`` (``"phi3"``: merged q/k/v and gate/up,
    both gathered),
    ``Qwen3ForCausalLM`` (``"qwen3"``: per-head q/k norms, replicated by its TP plan) or
    ``Gemma3ForCausalLM`` (``"gemma3"``: those norms, a scaled input embedding, sandwich norms of
    the ``(1 + weight)`` form, sliding-window layers and a full-attention last layer, as a Gemma 3
    group ends), eval mode, with ``layers`` decoder layers."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GlmConfig, GlmForCausalLM, GraniteConfig,
                              GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, Olmo2Config, Olmo2ForCausalLM,
                              Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Starcoder2Config, Starcoder2ForCausalLM)
    sizes = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=layers,
                 num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
    torch.manual_seed(seed)
    if kind in ("llama", "llama-tied"):  # llama-tied: the LM head is the input embedding (Llama 3.2 1B/3B)
        model = LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=kind == "llama-tied"))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**sizes, head_dim=16))
    elif kind == "gemma3":
        layer_types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        model = Gemma3ForCausalLM(Gemma3TextConfig(**sizes, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                                   layer_types=layer_types))
    elif kind == "granite":
        model = GraniteForCausalLM(GraniteConfig(**sizes, embedding_multiplier=12.0, residual_multiplier=0.22,
                                                 attention_multiplier=0.0625, logits_scaling=8.0))
    elif kind == "starcoder2":
        model = Starcoder2ForCausalLM(Starcoder2Config(**sizes, use_bias=True, sliding_window=None))
    elif kind == "olmo2":
        model = Olmo2ForCausalLM(Olmo2Config(**sizes, **_SPECIAL_TOKENS))
    elif kind == "glm":
        model = GlmForCausalLM(GlmConfig(**sizes, head_dim=16, **_SPECIAL_TOKENS))
    elif kind == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**sizes, **_SPECIAL_TOKENS))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**sizes))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    return model.to(dtype).eval()


def ties_lm_head(model: nn.Module) -> bool:
    """Whether the model's LM head is its input embedding (one tensor, stored once by HF)."""
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def planned(prefix: str = "model.", kind: str = "llama", layers: int = LAYERS) -> dict[str, int]:
    """``{full module name: chunks}`` of the planned linears of a ``kind`` model, written from the
    HF plan by hand: 1 for column-parallel (gathered or not: its input is whole), 0 for
    row-parallel (split input or not: each rank quantizes its features; the caller substitutes the
    TP size)."""
    colwise, rowwise = PROJECTIONS.get(kind, (COLWISE, ROWWISE))
    names = {}
    for i in range(layers):
        names.update({f"{prefix}layers.{i}.{n}": 1 for n in colwise})
        names.update({f"{prefix}layers.{i}.{n}": 0 for n in rowwise})
    return names


def token_ids(batch: int, seq: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def calibrate(model: nn.Module, ids: torch.Tensor, kind: str = "llama") -> dict[str, float]:
    """Static activation scales ``448 * 6 / amax`` of every planned linear's input on ``ids``."""
    amax: dict[str, float] = {}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda _m, args, name=name: amax.__setitem__(name, max(amax.get(name, 0.0), float(args[0].abs().max()))))
        for name in planned(kind=kind, layers=model.config.num_hidden_layers)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return {name: float(oracle.encode_gs(a)) for name, a in amax.items()}


def fake_quantized_weight(linear: nn.Linear) -> torch.Tensor:
    """``linear.weight`` quantized with its own amax and decoded (float64)."""
    w = linear.weight.detach()
    return oracle.fake_quantize(w.float(), oracle.dynamic_gs(w.double().abs().max()))


class FakeQuantLinear(nn.Module):
    """float64 NVFP4 reference of a linear: ``sum_c q(x_c) @ w_c^T + b`` (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, input_scale: float | None, chunks: int) -> None:
        super().__init__()
        self.weight, self.bias = weight.double(), None if bias is None else bias.detach().double()
        self.input_scale, self.chunks = input_scale, chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        k = rows.shape[1] // self.chunks
        out = torch.zeros(rows.shape[0], self.weight.shape[0], dtype=torch.float64)
        for c in range(self.chunks):
            xc = rows[:, c * k:(c + 1) * k]
            gs = self.input_scale if self.input_scale is not None else oracle.dynamic_gs(xc.float().abs().max())
            out += oracle.fake_quantize(xc, gs) @ self.weight[:, c * k:(c + 1) * k].t()
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], -1)


def nvfp4_reference(model: nn.Module, weights: dict[str, torch.Tensor], input_scales: dict[str, float] | None,
                    tp: int, kind: str = "llama") -> nn.Module:
    """A float64 copy of ``model`` whose planned linears are :class:`FakeQuantLinear` with the
    given decoded ``weights``; static ``input_scales`` or (None) dynamic scales per TP slice."""
    ref = copy.deepcopy(model).double()
    for name, chunks in planned(kind=kind, layers=model.config.num_hidden_layers).items():
        linear = ref.get_submodule(name)
        static = None if input_scales is None else input_scales[name]
        parent, _, child = name.rpartition(".")
        setattr(ref.get_submodule(parent), child,
                FakeQuantLinear(weights[name], linear.bias, static, 1 if static is not None else chunks or tp))
    return ref


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.double()


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius, float64)."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())
