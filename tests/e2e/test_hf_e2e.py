"""End to end, TP=2 on gloo: Hugging Face ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` (q/k/v biases),
tiny configs with random weights (tests/hf_tiny.py), put on TP with ``fp4fuse.tp.parallelize``
(NVFP4 linears, ``config.base_model_tp_plan``), compiled with and without
``fp4fuse.FusionPass(FusionConfig(enable_async_tp=True, ...))``. Inputs ``[batch, seq]`` token ids,
activations ``[batch, seq, hidden]``; fp32 models (fp32 norms are bitwise under Inductor's defaults,
fp4fuse.patterns.sequence_parallel "Numerics"); logits compared bit for bit.

Why ``rank_check='always'``: ``parallelize`` leaves the embedding replicated, so the residual stream
is ``embed_tokens(input_ids)``, computed on each rank from the per-call ``input_ids``. The
sequence-parallel norms need that residual to be the same on every rank, which only a check on
every call can promise; in the default mode (``first``) nothing fuses and every norm's skip says
so (tested below). With ``always`` the compiled graph verifies ``input_ids`` on every call and the
model state (norm weights, the embedding, static scales) on its first.

Fusion counts for a model of L decoder layers (each: input norm -> q, k, v (colwise) -> attention
-> o_proj (rowwise) -> post-attention norm -> gate, up (colwise) -> down (rowwise); a final norm):

* sequence_parallel: middle = 2L - 1 (every norm after an all-reduce but the final one; layer 0's
  input norm reads the embedding, no all-reduce), last = 1 (the final norm), first = 0;
* quant_before_gather = 5L - 3: each rewritten norm's column-parallel readers, quantized before
  the gather one by one (q, k, v: 3 per input norm of layers 1..L-1; gate, up: 2 per post-attention
  norm); ``.dynamic_scale`` with dynamic activation scales, plain with static ones (buffers);
* async_tp: all_gather_mm_fp4 = 5L - 3 (one per moved quant), mm_fp4_reduce_scatter = 2L (o_proj,
  down).

At L = 2: middle 3, last 1, quant_before_gather 7, all_gather_mm_fp4 7, mm_fp4_reduce_scatter 4.
"""
from __future__ import annotations

import pytest

from dist_utils import run_on_ranks

pytest.importorskip("transformers", reason="the test extra installs transformers (pip install -e '.[test]')")

import hf_tiny  # noqa: E402

WORLD = 2
SEQ = 4
TIMEOUT_S = 600.0


def expected_counts(layers: int, static: bool) -> dict[str, int]:
    quant = "quant_before_gather" if static else "quant_before_gather.dynamic_scale"
    return {"sequence_parallel.middle.torch_fp32": 2 * layers - 1, "sequence_parallel.last.torch_fp32": 1,
            f"sequence_parallel.{quant}": 5 * layers - 3,
            "async_tp.all_gather_mm_fp4": 5 * layers - 3, "async_tp.mm_fp4_reduce_scatter": 2 * layers}


# (model, static activation scales, rank_check, batches)
RUNS = (("llama", False, "always", (1, 3)), ("qwen2", True, "always", (3,)), ("llama", False, "first", (1,)))


def _rank_main(runs: tuple) -> dict:
    import torch

    import hf_tiny as tiny
    from fp4fuse.config import FusionConfig
    from fp4fuse.passes.manager import FusionPass
    from fp4fuse.tp import parallelize

    results = {}
    for kind, static, mode, batches in runs:
        hf = tiny.build(kind)
        scales = tiny.calibrate(hf, tiny.token_ids(3, seq=SEQ)) if static else None
        model = parallelize(hf, activation_scales=scales)
        fusion = FusionPass(FusionConfig(enable_async_tp=True, rank_check=mode))
        fused = torch.compile(model, dynamic=False, options={"post_grad_custom_post_pass": fusion})
        plain = torch.compile(model, dynamic=False, options={"post_grad_custom_post_pass": FusionPass()})
        for batch in batches:
            ids = tiny.token_ids(batch, seq=SEQ)
            calls = fusion.calls
            with torch.no_grad():
                out = fused(ids, use_cache=False).logits
                ref = plain(ids, use_cache=False).logits
            results[kind, static, mode, batch] = {
                "graphs": fusion.calls - calls, "equal": bool(torch.equal(out, ref)), "shape": tuple(out.shape),
                "counts": {k: v for k, v in fusion.last_match_counts.items() if k.startswith(("sequence", "async"))},
                "skips": [(s.key, s.reason) for s in fusion.last_skips],
                "checked": [(site.model_state, site.per_call) for site in fusion.passes[1].rank_checks],
            }
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    cache_dir = str(tmp_path_factory.mktemp("inductor_cache"))
    per_rank = run_on_ranks(_rank_main, WORLD, RUNS, timeout=TIMEOUT_S, backend="gloo",
                            env={"TORCHINDUCTOR_CACHE_DIR": cache_dir, "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    first, second = per_rank
    assert {k: (v["counts"], v["equal"]) for k, v in first.items()} == {
        k: (v["counts"], v["equal"]) for k, v in second.items()}
    return first


@pytest.mark.parametrize("kind, static, batch", [("llama", False, 1), ("llama", False, 3), ("qwen2", True, 3)],
                         ids=["llama-dynamic-b1", "llama-dynamic-b3", "qwen2-static-b3"])
def test_fusion_counts_and_bitwise_logits(results, kind, static, batch):
    got = results[kind, static, "always", batch]
    assert got["graphs"] == 1 and got["shape"] == (batch, SEQ, hf_tiny.VOCAB)
    assert got["counts"] == expected_counts(hf_tiny.LAYERS, static), got["counts"]
    assert got["skips"] == [], got["skips"]
    assert got["equal"], f"{kind} batch {batch}: logits differ from the model compiled without fp4fuse"


def test_the_check_names_what_the_rewrites_rely_on(results):
    """Model state on the first call (norm weights, the embedding the residual is looked up in,
    the static scales of the quants moved before the gather), the token ids on every call."""
    (state, per_call), = results["qwen2", True, "always", 3]["checked"]
    sources = {label.split(" (", 1)[1].rstrip(")") for label in state}
    layers = hf_tiny.LAYERS
    norms = {f"L['self'].model.layers[{i}].post_attention_layernorm.weight" for i in range(layers)}
    norms |= {f"L['self'].model.layers[{i}].input_layernorm.weight" for i in range(1, layers)}
    scales = {f"L['self'].model.layers[{i}].mlp.{p}_proj.input_global_scale" for i in range(layers) for p in ("gate", "up")}
    scales |= {f"L['self'].model.layers[{i}].self_attn.{p}_proj.input_global_scale"
               for i in range(1, layers) for p in "qkv"}
    assert sources == norms | scales | {"L['self'].model.norm.weight", "L['self'].model.embed_tokens.weight"}
    assert [label.split(" (", 1)[1] for label in per_call] == ["L['args'][0])"]


def test_default_mode_leaves_a_replicated_embeddings_residual_alone(results):
    got = results["llama", False, "first", 1]
    assert got["counts"] == {} and got["checked"] == [] and got["equal"]
    assert got["skips"] and all(
        "a per-call graph input, whose values are compared across ranks only with rank_check='always'" in reason
        and "L['args'][0]" in reason for _, reason in got["skips"])
