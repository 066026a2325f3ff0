"""End to end, TP=2 on gloo: Hugging Face ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (q/k/v biases),
``GraniteForCausalLM`` (its own test: scaled embedding and residuals), ``Starcoder2ForCausalLM``
(its own test: LayerNorm, row-parallel biases) and ``Gemma3ForCausalLM`` (its own test: sandwich
norms, in bf16),
tiny configs with random weights (tests/hf_tiny.py), put on TP with ``fp4fuse.tp.parallelize``
(NVFP4 linears, ``config.base_model_tp_plan``), compiled with and without
``fp4fuse.FusionPass(FusionConfig(enable_async_tp=True, ...))``. Inputs ``[batch, seq]`` token ids,
activations ``[batch, seq, hidden]``; fp32 models (fp32 norms are bitwise under Inductor's defaults,
fp4fuse.patterns.sequence_parallel "Numerics"; the bf16 Gemma 3 compiles with
``emulate_precision_casts``); logits compared bit for bit.

The residual stream. ``parallelize`` shards the input embedding over the vocabulary by default,
so the residual starts as an all-reduce's result, the same on every rank by construction, and the
sequence-parallel norms fuse in the default check mode (``first``: model state compared once).
With ``parallelize(embedding=False)`` the embedding is replicated and the residual is computed on
each rank from the per-call ``input_ids``: in the default mode nothing fuses and every norm's skip
says why; ``rank_check='always'`` compares ``input_ids`` on every call and then fuses.

Fusion counts for a model of L decoder layers (each: input norm -> q, k, v (colwise) -> attention
-> o_proj (rowwise) -> post-attention norm -> gate, up (colwise) -> down (rowwise); a final norm),
vocab-parallel embedding:

* sequence_parallel: first = 1 (the embedding's all-reduce -> layer 0's input norm),
  middle = 2L - 1, last = 1 (the final norm);
* quant_before_gather: with static activation scales (buffers, one per projection) 5L, each
  rewritten norm's column-parallel readers quantized before the gather one by one (q, k, v per input
  norm; gate, up per post-attention norm); with dynamic scales (``.dynamic_scale``) 2L, since the
  readers of one norm output quantize it alike and share one quantization and one gather
  (shared_quantization = 3L: k and v merged into q, up into gate);
* async_tp: mm_fp4_reduce_scatter = 2L (o_proj, down); all_gather_mm_fp4 = 5L with static scales,
  all_gather_mm_fp4_gathered = 2L with dynamic ones (one fused gather + GEMM per shared gather, its
  gathered codes feeding the other readers).

A dynamic batch (what a serving engine compiles: decode steps ``[batch, 1]``, ``mark_dynamic`` on
the batch) fuses as the static model does under a divisibility guard, and a batch that fails the
guard recompiles into a graph that fuses nothing, with the reasons (and a guard of its own). After
``torch._dynamo.reset()`` (a restart, the caches kept) the same two graphs come from the compile
caches, each to the batches of its guards, whichever batch comes first.

With a replicated embedding and ``always``: first = 0 and layer 0's q, k, v stay unfused
(dynamic scales: quant_before_gather = all_gather_mm_fp4_gathered = 2L - 1, shared_quantization =
3L - 2).

At L = 2 (Qwen2, static scales): first 1, middle 3, last 1, quant_before_gather 10,
all_gather_mm_fp4 10, mm_fp4_reduce_scatter 4; at L = 1 with dynamic scales (the other runs): 1, 1,
1, quant_before_gather 2, shared_quantization 3, all_gather_mm_fp4_gathered 2, mm_fp4_reduce_scatter 2.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import pytest
import torch

from dist_utils import COMPILE_THREADS, run_on_ranks

pytest.importorskip("transformers", reason="the test extra installs transformers (pip install -e '.[test]')")

import hf_tiny  # noqa: E402

WORLD = 2
SEQ = 4
#: whether Inductor rounds a fused bf16 intermediate before a reduction reads it under
#: ``emulate_precision_casts`` (tests/e2e/test_norm_numerics_e2e.py)
EMULATES_CASTS_IN_REDUCTIONS = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"
TIMEOUT_S = 600.0
#: decode steps ``[batch, 1]`` with ``mark_dynamic`` on the batch: compiled at 4 tokens (2 rows per rank),
#: reused at 6 (the divisibility guard holds), recompiled at 5 (it fails; nothing shards)
DYNAMIC_BATCHES = (4, 6, 5)
#: the same model again after ``torch._dynamo.reset()``, as a restarted server calls it: the odd batch
#: first, so that each graph comes from the compile caches, which hold both graphs under one key
WARM_BATCHES = (5, 4)


# Dynamo names the model ``L['self']``, or ``L['args'][0]`` where transformers wraps ``forward`` (5.24 does),
# and the token ids the positional argument after it.
_MODEL_ROOT = re.compile(r"^L\['self'\]|^L\['args'\]\[0\](?=\.)")
_TOKEN_IDS = re.compile(r"L\['args'\]\[[01]\]")


def state_path(source: str) -> str:
    """A model-state source without its root: ``.model.layers[0].input_layernorm.weight``."""
    return _MODEL_ROOT.sub("", source)


def expected_counts(layers: int, static: bool, vocab_parallel: bool = True) -> dict[str, int]:
    counts = {"sequence_parallel.middle.torch_fp32": 2 * layers - 1, "sequence_parallel.last.torch_fp32": 1,
              "async_tp.mm_fp4_reduce_scatter": 2 * layers}
    if static:  # each projection's own scale: quantized and gathered one by one
        gathered = 5 * layers if vocab_parallel else 5 * layers - 3
        counts.update({"sequence_parallel.quant_before_gather": gathered, "async_tp.all_gather_mm_fp4": gathered})
    else:  # q/k/v and gate/up share one quantization and gather of their norm's output
        gathered, shared = (2 * layers, 3 * layers) if vocab_parallel else (2 * layers - 1, 3 * layers - 2)
        counts.update({"sequence_parallel.quant_before_gather.dynamic_scale": gathered,
                       "sequence_parallel.shared_quantization": shared,
                       "async_tp.all_gather_mm_fp4_gathered": gathered})
    if vocab_parallel:
        counts["sequence_parallel.first.torch_fp32"] = 1
    return counts


class Run(NamedTuple):
    """One model compiled with and without fp4fuse, called at ``batches``."""

    name: str
    kind: str                         # tests/hf_tiny.py
    batches: tuple[int, ...] = (3,)
    static: bool = False              # static activation scales (calibrated) instead of dynamic ones
    rank_check: str = "first"
    vocab_parallel: bool = True       # parallelize(embedding=...)
    dynamic: bool = False             # decode steps [batch, 1] with mark_dynamic on the batch
    dtype: str = "float32"            # bfloat16: compiled with emulate_precision_casts (README, "Numerics")
    unfused: bool = True              # also compile without fp4fuse and compare the logits bit for bit
    same_as: str | None = None        # or compare with this earlier run's logits
    layers: int = 1                   # decoder layers (1 still has a first, a middle and a last norm)


# What each run adds (a compile of these tiny models takes about 15-30 s of a CI core, 13 in all, so
# each run covers what no cheaper test does, with one decoder layer where that shows what it is there
# for: one layer still has a first, a middle and a last norm): Qwen2, static activation scales and
# q/k/v biases, with two layers (the one run where a middle norm, the residual after layer 0's down
# projection, feeds q/k/v, and where the rank check names a second layer's state); Granite, whose
# residual stream is scaled (the scaled sequence-parallel patterns); Starcoder2, LayerNorm and
# row-parallel biases added after the all-reduce (the biased patterns);
# Gemma 3 in bf16, its serving dtype (its fp32 norm form, torch_manual, is covered by
# tests/test_sp_patterns.py); Llama with a replicated embedding, static shapes and dynamic scales,
# in both check modes (the default mode fuses nothing, asserted, so its graph is the unfused compile
# the "always" run is compared with); Llama with a dynamic batch, whose first graph has the static
# model's rewrites. Qwen3's per-head q/k norms read a column-parallel output, never an all-reduce, so
# no rewrite can match them (tests/test_parallelize.py runs Qwen3 at TP=2). OLMo 2, GLM and Phi-3
# (gathered column-parallel outputs, split row-parallel inputs) run eager at TP=2 in
# tests/test_parallelize.py; compiled, fused against unfused, only in benchmarks/survey_hf_families.py
# (a compile here costs about a minute of CI's budget per model).
RUNS = (Run("qwen2-static", "qwen2", static=True, layers=2), Run("gemma3-bf16", "gemma3", dtype="bfloat16"),
        Run("granite", "granite"), Run("starcoder2", "starcoder2"),
        Run("llama-replicated", "llama", batches=(1,), vocab_parallel=False, unfused=False),
        Run("llama-replicated-always", "llama", batches=(1,), rank_check="always", vocab_parallel=False,
            unfused=False, same_as="llama-replicated"),
        Run("llama-dynamic", "llama", batches=DYNAMIC_BATCHES, dynamic=True),
        Run("llama-dynamic-warm", "llama", batches=WARM_BATCHES, dynamic=True))
LAYERS = {run.name: run.layers for run in RUNS}


def _rank_main(runs: tuple) -> dict:
    import torch

    import hf_tiny as tiny
    from fp4fuse.config import FusionConfig
    from fp4fuse.passes.manager import FusionPass
    from fp4fuse.tp import parallelize

    results, logits = {}, {}
    # one pass per configuration for every model, as a serving engine keeps one for all its graphs (a
    # pass registers its patterns once per norm family and dtype); the results are each graph's own
    plain_pass, fused_passes = FusionPass(), {}
    for run in runs:
        torch._dynamo.reset()  # every run compiles the same HF forward: keep under the recompile limit
        hf = tiny.build(run.kind, dtype=getattr(torch, run.dtype), layers=run.layers)
        scales = tiny.calibrate(hf, tiny.token_ids(3, seq=SEQ)) if run.static else None
        model = parallelize(hf, activation_scales=scales, embedding=run.vocab_parallel)
        if run.rank_check not in fused_passes:
            fused_passes[run.rank_check] = FusionPass(FusionConfig(enable_async_tp=True, rank_check=run.rank_check))
        fusion = fused_passes[run.rank_check]
        shapes = None if run.dynamic else False  # dynamic: the batch is marked dynamic below
        fused = torch.compile(model, dynamic=shapes, options={"post_grad_custom_post_pass": fusion})
        plain = (torch.compile(model, dynamic=shapes, options={"post_grad_custom_post_pass": plain_pass})
                 if run.unfused else None)
        for batch in run.batches:
            ids = tiny.token_ids(batch, seq=1 if run.dynamic else SEQ)
            if run.dynamic:
                torch._dynamo.mark_dynamic(ids, 0)
            calls, served, served_counts = fusion.calls, fusion.cached_graphs, fusion.cached_match_counts
            with torch.no_grad(), torch._inductor.config.patch(emulate_precision_casts=run.dtype != "float32"):
                out = fused(ids, use_cache=False).logits
                ref = plain(ids, use_cache=False).logits if plain is not None else logits.get((run.same_as, batch))
            logits[run.name, batch] = out
            results[run.name, batch] = {
                "graphs": fusion.calls - calls, "shape": tuple(out.shape),
                "served": fusion.cached_graphs - served,
                "served_counts": {k: v for k, v in (fusion.cached_match_counts - served_counts).items()
                                  if k.startswith(("sequence", "async"))},
                "equal": bool(torch.equal(out, ref)) if ref is not None else None,
                "counts": {k: v for k, v in fusion.last_match_counts.items() if k.startswith(("sequence", "async"))},
                "skips": [(s.key, s.reason) for s in fusion.last_skips if s.key.startswith(("sequence", "async"))],
                "norm_quant": ({k: v for k, v in fusion.last_match_counts.items() if k.startswith("norm_quant")},
                               sorted({s.key for s in fusion.last_skips if s.key.startswith("norm_quant")})),
                "checked": [(site.model_state, site.per_call) for site in fusion.passes[1].rank_checks],
            }
    return results


@pytest.fixture(scope="module")
def results(rank_inductor_cache) -> dict:
    """Every run, in one spawn of two ranks."""
    per_rank = run_on_ranks(_rank_main, WORLD, RUNS, timeout=TIMEOUT_S, backend="gloo",
                            env={"TORCHINDUCTOR_CACHE_DIR": rank_inductor_cache,
                                 "TORCHINDUCTOR_COMPILE_THREADS": COMPILE_THREADS})
    first, second = per_rank
    assert {k: (v["counts"], v["equal"]) for k, v in first.items()} == {
        k: (v["counts"], v["equal"]) for k, v in second.items()}
    return first


@pytest.mark.parametrize("run, batch", [("qwen2-static", 3)], ids=["qwen2-static-scales"])
def test_fusion_counts_and_bitwise_logits(results, run, batch):
    got = results[run, batch]
    static = run.endswith("-static")
    assert got["graphs"] == 1 and got["shape"] == (batch, SEQ, hf_tiny.VOCAB)
    assert got["counts"] == expected_counts(LAYERS[run], static), got["counts"]
    assert got["skips"] == [], got["skips"]
    # HF's RMSNorm (Qwen's is Llama's form) is a torch-form norm: its quants are not fused with it, and say why
    assert got["norm_quant"] == ({}, ["norm_quant.torch_norm"]), got["norm_quant"]
    assert got["equal"], f"{run} batch {batch}: logits differ from the model compiled without fp4fuse"


def test_gemma3_fuses_its_sandwich_norms_and_reduce_scatters_bitwise(results):
    """Gemma 3 writes its norms ``(xf * rsqrt(mean(xf^2) + eps) * (1 + weight.float())).type_as(x)``
    and applies one to each all-reduced attention and MLP output before the residual add: those 2L
    norms take the sequence-parallel ``first`` rewrite, and the 2L row-parallel GEMMs fuse with their
    reduce-scatters. In bf16 the norm is its own form (fp32 math, one rounding: torch_offset_fp32),
    bitwise under ``emulate_precision_casts`` where Inductor honours it inside a fused reduction
    (torch 2.13; torch 2.11 does not, tests/e2e/test_norm_numerics_e2e.py, so there the logits
    are not held bitwise). The norms before q/k/v and gate/up read the residual sum, not an
    all-reduce, so no gather feeds a quant there. Its scaled input embedding stays replicated
    (parallelize: more than a lookup), which the ``first`` rewrites do not need."""
    got = results["gemma3-bf16", 3]
    layers = LAYERS["gemma3-bf16"]
    assert got["graphs"] == 1 and got["shape"] == (3, SEQ, hf_tiny.VOCAB)
    assert got["counts"] == {"sequence_parallel.first.torch_offset_fp32": 2 * layers,
                             "async_tp.mm_fp4_reduce_scatter": 2 * layers}, got["counts"]
    assert got["skips"] == [], got["skips"]
    if not EMULATES_CASTS_IN_REDUCTIONS:
        pytest.xfail("torch < 2.13: Inductor does not round a fused bf16 intermediate before a reduction "
                     "under emulate_precision_casts (tests/e2e/test_norm_numerics_e2e.py)")
    assert got["equal"], "gemma3-bf16: logits differ from the model compiled without fp4fuse"


def test_granite_scaled_residual_stream_fuses_bitwise(results):
    """Granite multiplies the embedding's all-reduce by ``embedding_multiplier`` and every
    row-parallel output by ``residual_multiplier`` before the norm / residual add: the scaled
    sequence-parallel patterns take every norm (Llama's counts under the ``_scaled`` names), each
    number multiplies the shard, and the logits equal the compile without fp4fuse bit for bit."""
    got = results["granite", 3]
    want = {key.replace(".torch_fp32", ".torch_fp32_scaled"): n
            for key, n in expected_counts(LAYERS["granite"], static=False).items()}
    assert got["graphs"] == 1 and got["shape"] == (3, SEQ, hf_tiny.VOCAB)
    assert got["counts"] == want, got["counts"]
    assert got["skips"] == [], got["skips"]
    assert got["equal"], "granite: logits differ from the model compiled without fp4fuse"


def test_starcoder2_layer_norms_and_row_parallel_biases_fuse_bitwise(results):
    """Starcoder2 normalizes with ``nn.LayerNorm`` and its row-parallel linears (``o_proj``, ``c_proj``)
    add their bias after the all-reduce, on the 2-D rows, before the view back to ``[b, s, h]``: the
    view moves before the add, the LayerNorm patterns take every norm (the middle and last ones in
    their ``_biased`` form, adding the bias row to the shard), q/k/v (sharing one quantization) and
    the one MLP input projection ``c_fc`` quantize before the gather (2 per layer), and the logits
    equal the compile without fp4fuse bit for bit."""
    got = results["starcoder2", 3]
    layers = LAYERS["starcoder2"]
    assert got["graphs"] == 1 and got["shape"] == (3, SEQ, hf_tiny.VOCAB)
    assert got["counts"] == {
        "sequence_parallel.first.torch_layer_norm": 1, "sequence_parallel.middle.torch_layer_norm_biased": 2 * layers - 1,
        "sequence_parallel.last.torch_layer_norm_biased": 1,
        "sequence_parallel.quant_before_gather.dynamic_scale": 2 * layers,
        "sequence_parallel.shared_quantization": 2 * layers,
        "async_tp.all_gather_mm_fp4_gathered": layers, "async_tp.all_gather_mm_fp4": layers,
        "async_tp.mm_fp4_reduce_scatter": 2 * layers}, got["counts"]
    assert got["skips"] == [], got["skips"]
    assert got["equal"], "starcoder2: logits differ from the model compiled without fp4fuse"


def test_the_check_names_what_the_rewrites_rely_on(results):
    """Model state on the first call: the norm weights and the static scales of the quants moved
    before the gather (nothing per call: the residual is the embedding's all-reduce)."""
    (state, per_call), = results["qwen2-static", 3]["checked"]
    sources = {state_path(label.split(" (", 1)[1].rstrip(")")) for label in state}
    layers = LAYERS["qwen2-static"]
    norms = {f".model.layers[{i}].{n}.weight" for i in range(layers)
             for n in ("input_layernorm", "post_attention_layernorm")}
    scales = {f".model.layers[{i}].mlp.{p}_proj.input_global_scale" for i in range(layers) for p in ("gate", "up")}
    scales |= {f".model.layers[{i}].self_attn.{p}_proj.input_global_scale" for i in range(layers) for p in "qkv"}
    assert sources == norms | scales | {".model.norm.weight"}
    assert per_call == ()


def test_replicated_embedding_fuses_only_with_the_per_call_check(results):
    """A replicated embedding's residual comes from the per-call token ids: left alone (with the
    reason) in the default mode, fused under rank_check='always', which compares the ids every call."""
    got = results["llama-replicated", 1]
    assert got["graphs"] == 1 and got["counts"] == {} and got["checked"] == []
    assert got["skips"] and all(
        "a per-call graph input, whose values are compared across ranks only with rank_check='always'" in reason
        and _TOKEN_IDS.search(reason) for _, reason in got["skips"])
    got = results["llama-replicated-always", 1]
    assert got["graphs"] == 1
    want = expected_counts(LAYERS["llama-replicated-always"], static=False, vocab_parallel=False)
    assert got["counts"] == want, got["counts"]
    assert got["equal"]  # bitwise the default mode's graph, which fused nothing
    (_, per_call), = got["checked"]
    (label,) = per_call
    assert _TOKEN_IDS.fullmatch(label.split(" (", 1)[1].rstrip(")")), label


def test_a_dynamic_batch_fuses_under_a_guard_and_recompiles_where_it_fails(results):
    """What a serving engine compiles: decode steps with ``mark_dynamic`` on the batch. Compiled at 4
    tokens, every rewrite of the static model fires (the divisibility guard goes into the graph);
    6 tokens reuse that graph; 5 fail the guard and recompile into a graph that leaves each
    all-reduce alone with the reason. Logits bitwise equal to the unfused compile at every size."""
    first, reused, odd = (results["llama-dynamic", b] for b in DYNAMIC_BATCHES)
    for got, batch in zip((first, reused, odd), DYNAMIC_BATCHES):
        assert got["shape"] == (batch, 1, hf_tiny.VOCAB) and got["equal"], (batch, got)
    assert first["graphs"] == 1 and first["skips"] == []
    assert first["counts"] == expected_counts(LAYERS["llama-dynamic"], static=False), first["counts"]
    # HF's LlamaRMSNorm is a torch-form norm: its quants are not fused with it, and say why
    assert first["norm_quant"] == ({}, ["norm_quant.torch_norm"]), first["norm_quant"]
    assert reused["graphs"] == 0
    assert odd["graphs"] == 1 and odd["counts"] == {}
    assert odd["skips"] and all("(hint 5) is not divisible by the group size 2" in reason
                                for key, reason in odd["skips"] if key.startswith("sequence_parallel"))


def test_a_warm_cache_serves_each_batch_the_graph_of_its_guards(results):
    """A restart (``torch._dynamo.reset()``, the caches kept): the odd batch first, then an even one.
    The compile caches hold both graphs of the dynamic batch under one key and must serve each
    batch the one whose guards it meets, on both ranks alike (otherwise they run different
    collectives and hang): the graph that leaves the all-reduces alone for 5, the sharded one for 4.
    fp4fuse.passes.cache_guards is what makes the caches read those guards right."""
    odd, even = (results["llama-dynamic-warm", b] for b in WARM_BATCHES)
    for got, batch in zip((odd, even), WARM_BATCHES):
        assert got["graphs"] == 0 and got["served"] == 1, (batch, got)
        assert got["shape"] == (batch, 1, hf_tiny.VOCAB) and got["equal"], (batch, got)
    assert odd["served_counts"] == {}
    assert even["served_counts"] == expected_counts(LAYERS["llama-dynamic-warm"], static=False)
