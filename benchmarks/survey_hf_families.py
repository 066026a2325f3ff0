"""Which Hugging Face model families fp4fuse fuses, and whether the fused graph gives the unfused
graph's logits bit for bit: TP=2 on gloo (CPU), tiny random configs, ``fp4fuse.tp.parallelize``
(NVFP4 linears, dynamic activation scales, the model's own ``base_model_tp_plan``), compiled with
``FusionPass(FusionConfig(enable_async_tp=True))`` and with ``FusionPass()`` (nothing fused).

    PYTHONPATH=. python benchmarks/survey_hf_families.py [family ...] [--dtype bfloat16]

Families: mistral granite gemma2 phi starcoder2 cohere smollm3 olmo2 glm phi3 (default: all). bf16 runs
compile under ``emulate_precision_casts`` (README, "Numerics"). Prints one markdown row per family:
the fusion counts, the distinct skip reasons, and the largest relative difference of the compiled
unfused model from eager (a sanity check of the harness).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4fuse.launch import run_on_ranks  # noqa: E402

SIZES = dict(vocab_size=100, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, pad_token_id=None,
             bos_token_id=None, eos_token_id=None)
FAMILIES = ("mistral", "granite", "gemma2", "phi", "starcoder2", "cohere", "smollm3", "olmo2", "glm", "phi3")


def build(family: str, dtype: torch.dtype) -> torch.nn.Module:
    import transformers as hf

    torch.manual_seed(0)
    sizes = dict(SIZES)
    configs = {
        "mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(**sizes, sliding_window=None)),
        "granite": lambda: hf.GraniteForCausalLM(hf.GraniteConfig(
            **sizes, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
            logits_scaling=8.0)),
        "gemma2": lambda: hf.Gemma2ForCausalLM(hf.Gemma2Config(
            **sizes, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0)),
        "phi": lambda: hf.PhiForCausalLM(hf.PhiConfig(**{**sizes, "num_key_value_heads": 6}, partial_rotary_factor=0.5)),
        "starcoder2": lambda: hf.Starcoder2ForCausalLM(hf.Starcoder2Config(**sizes, use_bias=True, sliding_window=None)),
        "cohere": lambda: hf.CohereForCausalLM(hf.CohereConfig(**sizes, logit_scale=0.0625)),
        "smollm3": lambda: hf.SmolLM3ForCausalLM(hf.SmolLM3Config(**sizes, no_rope_layers=[1, 0])),
        "olmo2": lambda: hf.Olmo2ForCausalLM(hf.Olmo2Config(**sizes)),
        "glm": lambda: hf.GlmForCausalLM(hf.GlmConfig(**sizes, head_dim=16)),
        "phi3": lambda: hf.Phi3ForCausalLM(hf.Phi3Config(**sizes)),
    }
    return configs[family]().to(dtype).eval()


def _rank_main(families: tuple[str, ...], dtype_name: str) -> dict:
    from fp4fuse.config import FusionConfig
    from fp4fuse.passes.manager import FusionPass
    from fp4fuse.tp import parallelize

    dtype = getattr(torch, dtype_name)
    out = {}
    for family in families:
        torch._dynamo.reset()
        ids = torch.randint(0, SIZES["vocab_size"], (3, 4), generator=torch.Generator().manual_seed(1))
        try:
            model = parallelize(build(family, dtype))
        except (ValueError, TypeError) as exc:
            out[family] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        fusion = FusionPass(FusionConfig(enable_async_tp=True))
        fused = torch.compile(model, dynamic=False, options={"post_grad_custom_post_pass": fusion})
        plain = torch.compile(model, dynamic=False, options={"post_grad_custom_post_pass": FusionPass()})
        with torch.no_grad(), torch._inductor.config.patch(emulate_precision_casts=dtype != torch.float32):
            eager = model(ids, use_cache=False).logits.double()
            got = fused(ids, use_cache=False).logits
            want = plain(ids, use_cache=False).logits
        out[family] = {
            "equal": bool(torch.equal(got, want)),
            "rel_vs_eager": float((want.double() - eager).norm() / eager.norm()),
            "counts": {k: v for k, v in fusion.last_match_counts.items() if k.startswith(("sequence", "async"))},
            "skips": sorted({f"{s.key}: {s.reason.split(';')[0]}" for s in fusion.last_skips
                             if s.key.startswith(("sequence", "async"))}),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("families", nargs="*", default=list(FAMILIES))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    ranks = run_on_ranks(_rank_main, 2, tuple(args.families), args.dtype, timeout=3600, backend="gloo",
                         env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    print(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, {args.dtype}")
    print("| family | fused == unfused | counts | skips | unfused vs eager |")
    print("| --- | --- | --- | --- | --- |")
    for family in args.families:
        r0, r1 = ranks[0][family], ranks[1][family]
        if "error" in r0:
            print(f"| {family} | parallelize refused: {r0['error']} | | | |")
            continue
        agree = "" if r0 == r1 else " (ranks differ)"
        counts = ", ".join(f"{k.split('.', 1)[1]} {v}" for k, v in r0["counts"].items()) or "none"
        print(f"| {family} | {r0['equal']}{agree} | {counts} | {'; '.join(r0['skips']) or '-'} | {r0['rel_vs_eager']:.1e} |")


if __name__ == "__main__":
    main()
