"""fp4fuse.tp.parallelize on Hugging Face Llama, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms,
replicated by its plan), Gemma 3 (a scaled input embedding, left replicated), and OLMo 2, GLM and
Phi-3 (plans that gather column-parallel outputs and split row-parallel inputs), tiny configs,
random weights (tests/hf_tiny.py).

Single process (a fake 2-rank group, no collectives run): plan resolution and its errors,
dimension errors, static activation scales as buffers, a static scale as a compiled-graph input.

Two gloo ranks, one spawn, fp32 models, inputs ``[batch, seq]`` with batch 1 and 3 (3-D
activations ``[batch, seq, hidden]`` in every linear):

* ``WeightFormat.BF16`` at TP=2 against the untouched HF model: the same math except that each
  row-parallel sum is split in two fp32 partial sums (measured 5e-7 relative; bound 1e-5). This
  also proves HF attention runs on the local heads it infers from the projection width.
* NVFP4 at TP=2 (static scales, and dynamic) and at TP=1 against a float64 reference written
  from the format table (hf_tiny.nvfp4_reference): the HF model in float64 with each planned
  linear's weight and input quantized and decoded by nvfp4_oracle. The only differences are fp32
  roundings of the model's own ops (measured 2e-7 relative). A value that lands within one fp32
  rounding of an e2m1 decision point could flip one code on another CPU, which moves the logits by
  ~1e-4 to 1e-3; anything wrong (a shard, a scale, a bias, the dynamic row-parallel rule) moves them
  by 0.2 or more (measured: the TP=1 dynamic rule against the TP=2 model, 0.23-0.26). Bound 2e-3.
* OLMo 2, GLM and Phi-3 (NVFP4, dynamic scales) traced whole by Dynamo (``fullgraph=True``, eager
  backend): the eager logits bit for bit. A graph break in a TP layer would keep every rewrite from
  spanning it; on torch 2.11 each gathered output was one (fp4fuse.tp.rows).
"""
from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

pytest.importorskip("transformers", reason="the test extra installs transformers (pip install -e '.[test]')")

import fp4fuse  # noqa: E402,F401  (registers torch.ops.fp4fuse.*)
import hf_tiny  # noqa: E402
from dist_utils import run_on_ranks  # noqa: E402
from fp4fuse.tp import (  # noqa: E402
    ColumnParallelLinear, ColumnParallelNVFP4Linear, NVFP4Linear, RowParallelLinear, RowParallelNVFP4Linear,
    VocabParallelEmbedding, WeightFormat, parallelize,
)
from fp4fuse.tp.plan import ParallelStyle, resolve_plan  # noqa: E402

WORLD = 2
TIMEOUT_S = 400.0
EXACT_SPLIT_SUM = 1e-5   # BF16 format vs HF: split fp32 sums only
#: NVFP4 vs the float64 format reference, which takes fp4fuse's global-scale convention
#: (oracle.dynamic_gs): fp32 roundings (at most 3.8e-7 measured on torch 2.13), plus the margin of
#: a code that an fp32 rounding of an activation moves across a rounding boundary (none seen)
QUANTIZED = 2e-3


# --------------------------------------------------------------------------- single process


def test_plan_names_modules_under_the_base_model_prefix():
    model = hf_tiny.build("llama")
    expected = {name: ParallelStyle.COLWISE if chunks else ParallelStyle.ROWWISE
                for name, chunks in hf_tiny.planned().items()}
    assert resolve_plan(model, model.config.base_model_tp_plan) == expected
    assert resolve_plan(model.model, model.config.base_model_tp_plan) == {
        name.removeprefix("model."): style for name, style in expected.items()}
    full_names = {"model.layers.*.mlp.down_proj": "rowwise"}
    assert resolve_plan(model, full_names) == {f"model.layers.{i}.mlp.down_proj": ParallelStyle.ROWWISE
                                               for i in range(hf_tiny.LAYERS)}


@pytest.mark.parametrize("plan, error", [
    ({"layers.*.mlp": "colwise"}, r"names 'model.layers.0.mlp', a LlamaMLP; only nn.Linear"),
    ({"layers.*.self_attn.q_proj": "packed_colwise"},
     r"gives module 'model.layers.0.self_attn.q_proj' the style 'packed_colwise'; fp4fuse supports"),
    ({"lm_head": "sequence_parallel"}, r"module 'lm_head' the style 'sequence_parallel'"),
    ({"layers.*.self_attn.qq_proj": "colwise"}, r"'layers.\*.self_attn.qq_proj' matches no module"),
    ({"layers.*.mlp.up_proj": "colwise", "layers.1.mlp.up_proj": "rowwise"},
     r"'model.layers.1.mlp.up_proj' is colwise by plan entry 'layers.\*.mlp.up_proj' and rowwise"),
    ({}, r"non-empty mapping"),
], ids=["not-linear", "unknown-style", "lm-head-style", "no-match", "conflict", "empty"])
def test_bad_plans_are_clear_errors(fake_group, plan, error):
    with pytest.raises(ValueError, match=error):
        parallelize(hf_tiny.build("llama"), plan=plan)


class _DoubledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


@pytest.mark.parametrize("change, error", [
    ("subclass", r"names 'model.layers.0.mlp.up_proj', a _DoubledLinear, overrides nn.Linear.forward; only a module "
                 r"computing nn.Linear's x @ W\^T \+ b can be split"),
    ("hook", r"names 'model.layers.0.mlp.up_proj', a Linear with 1 forward \(pre-\)hook\(s\)"),
    ("instance-forward", r"names 'model.layers.0.mlp.up_proj', a Linear whose forward was replaced on the instance"),
], ids=["subclass", "hook", "instance-forward"])
def test_a_linear_computing_more_than_nn_linear_is_not_split(fake_group, change, error):
    """A TP linear computes ``x @ W^T + b`` from the weights alone: what a subclass's ``forward``,
    a forward hook or a replaced ``forward`` adds would be dropped (the subclass above doubled the
    output; split anyway it computed half of it), so such a module is an error, and the model is
    left as it was."""
    model = hf_tiny.build("llama")
    mlp = model.model.layers[0].mlp
    if change == "subclass":
        doubled = _DoubledLinear(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
        doubled.load_state_dict(mlp.up_proj.state_dict())
        mlp.up_proj = doubled
    elif change == "hook":
        mlp.up_proj.register_forward_hook(lambda _m, _args, out: out * 2)
    else:
        mlp.up_proj.forward = lambda x, f=mlp.up_proj.forward: f(x) * 2
    linear = mlp.up_proj
    with pytest.raises(ValueError, match=error):
        parallelize(model)
    assert mlp.up_proj is linear and type(model.model.layers[0].self_attn.q_proj) is nn.Linear


def test_dimensions_that_do_not_split_name_the_module(fake_group):
    from transformers import LlamaConfig, LlamaForCausalLM
    sizes = dict(vocab_size=100, hidden_size=96, num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2)
    odd = LlamaForCausalLM(LlamaConfig(intermediate_size=72, **sizes))   # 36 input features per rank
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj \(rowwise, weight \[96, 72\]\): NVFP4 needs "
                                         r"input features per rank \(36\) to be a multiple of 16"):
        parallelize(odd)
    parallelize(odd, weight_format=WeightFormat.BF16)  # the 16-block rule is NVFP4's alone
    three = LlamaForCausalLM(LlamaConfig(intermediate_size=75, **sizes))
    with pytest.raises(ValueError, match=r"mlp.gate_proj \(colwise, weight \[75, 96\]\): out_features = 75 is not "
                                         r"divisible by the tensor-parallel size 2"):
        parallelize(three, weight_format=WeightFormat.BF16)
    one_kv_head = LlamaForCausalLM(LlamaConfig(intermediate_size=160, **{**sizes, "num_key_value_heads": 1}))
    with pytest.raises(ValueError, match="config.num_key_value_heads = 1 is not divisible by the tensor-parallel size 2"):
        parallelize(one_kv_head)


def test_layers_replace_only_planned_linears(fake_group):
    model = parallelize(hf_tiny.build("qwen2"))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert type(attn.q_proj) is ColumnParallelNVFP4Linear and type(attn.o_proj) is RowParallelNVFP4Linear
    assert type(mlp.up_proj) is ColumnParallelNVFP4Linear and type(mlp.down_proj) is RowParallelNVFP4Linear
    assert attn.q_proj.weight_q.shape == (48, 48) and attn.q_proj.bias.shape == (48,)   # rank 0 of 2
    assert attn.o_proj.weight_q.shape == (96, 24) and attn.o_proj.bias is None
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is VocabParallelEmbedding
    dense = parallelize(hf_tiny.build("qwen2"), weight_format=WeightFormat.BF16)
    q = dense.model.layers[0].self_attn.q_proj
    assert type(q) is ColumnParallelLinear and q.weight.shape == (48, 96) and q.bias.shape == (48,)
    assert type(dense.model.layers[0].mlp.down_proj) is RowParallelLinear


def test_gather_and_split_styles_and_their_hf_aliases(fake_group):
    """OLMo 2's plan gathers q/k/v's outputs (its q/k norms span the whole projection) and gives
    o_proj a whole input to split; GLM gathers its merged gate/up (chunked after). Hugging Face's
    ``colwise_rep`` / ``rowwise_rep`` name the same two styles. With no plain ``colwise`` linear
    (Phi-3's plan) attention runs whole on every rank, so a head count that does not split is
    accepted."""
    from transformers import Phi3Config, Phi3ForCausalLM

    model = parallelize(hf_tiny.build("olmo2"))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert type(attn.q_proj) is ColumnParallelNVFP4Linear and attn.q_proj.gather_output
    assert attn.q_proj.weight_q.shape == (48, 48)  # this rank's 48 of 96 output features
    assert type(attn.o_proj) is RowParallelNVFP4Linear and not attn.o_proj.input_is_parallel
    assert not mlp.gate_proj.gather_output and mlp.down_proj.input_is_parallel
    dense = parallelize(hf_tiny.build("glm"), weight_format=WeightFormat.BF16)
    gate_up, down = dense.model.layers[1].mlp.gate_up_proj, dense.model.layers[1].mlp.down_proj
    assert type(gate_up) is ColumnParallelLinear and gate_up.gather_output and gate_up.weight.shape == (160, 96)
    assert type(down) is RowParallelLinear and not down.input_is_parallel and down.weight.shape == (96, 80)
    aliases = {"layers.*.self_attn.q_proj": "colwise_rep", "layers.*.self_attn.o_proj": "rowwise_rep"}
    assert set(resolve_plan(hf_tiny.build("llama"), aliases).values()) == {
        ParallelStyle.COLWISE_GATHER, ParallelStyle.ROWWISE_SPLIT}
    sizes = dict(vocab_size=100, hidden_size=96, intermediate_size=160, num_hidden_layers=1, num_attention_heads=6,
                 num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    phi3 = parallelize(Phi3ForCausalLM(Phi3Config(**sizes)))
    assert phi3.model.layers[0].self_attn.qkv_proj.gather_output


def test_replicated_plan_entries_leave_their_modules_whole(fake_group):
    """Qwen3's plan names its per-head q/k norms ``replicated_with_grad_allreduce``: accepted for
    any module type, not split, and still checked for conflicts with a splitting entry."""
    model = hf_tiny.build("qwen3")
    plan = model.config.base_model_tp_plan
    assert "layers.*.self_attn.q_norm" in plan and ParallelStyle(plan["layers.*.self_attn.q_norm"]) is (
        ParallelStyle.REPLICATED)
    assert set(resolve_plan(model, plan)) == set(hf_tiny.planned())
    norm = model.model.layers[0].self_attn.q_norm
    parallelize(model)
    assert model.model.layers[0].self_attn.q_norm is norm
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj' is replicated_with_grad_allreduce by "
                                         r"plan entry 'layers.0.self_attn.q_proj' and colwise"):
        resolve_plan(hf_tiny.build("qwen3"), {"layers.0.self_attn.q_proj": "replicated_with_grad_allreduce",
                                              "layers.*.self_attn.q_proj": "colwise"})


@pytest.mark.parametrize("kind, change, why", [
    ("gemma3", None, "a Gemma3TextScaledWordEmbedding, overrides nn.Embedding.forward"),
    ("llama", "max_norm", r"renormalizes the rows it looks up \(max_norm=1.0\)"),
    ("llama", "hook", r"an Embedding with 1 forward \(pre-\)hook\(s\), which its replacement would not run"),
], ids=["forward-override", "max-norm", "forward-hook"])
def test_an_embedding_that_is_more_than_a_lookup_stays_replicated(fake_group, caplog, kind, change, why):
    """A vocab-parallel embedding computes a plain lookup; an input embedding that computes more
    (Gemma 3 scales the lookup by sqrt(hidden); ``max_norm`` renormalizes rows; a forward hook may
    change the lookup, here scaling it as Gemma does) stays whole, with the reason in the warning."""
    model = hf_tiny.build(kind)
    table = model.get_input_embeddings()
    if change == "max_norm":
        table.max_norm = 1.0
    elif change == "hook":
        table.register_forward_hook(lambda _m, _args, out: out * 96 ** 0.5)
    with caplog.at_level("WARNING", logger="fp4fuse.tp.parallelize"):
        parallelize(model)
    assert model.get_input_embeddings() is table
    assert re.search(why + r".*the input embedding stays replicated", caplog.text), caplog.text


def test_static_activation_scales_are_buffers_in_the_state_dict(fake_group):
    q_name, down_name = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"
    model = parallelize(hf_tiny.build("llama"), activation_scales={q_name: 96.5, down_name: torch.tensor([3.25])})
    state = model.state_dict()
    assert torch.equal(state[f"{q_name}.input_global_scale"], torch.tensor([96.5]))
    assert torch.equal(state[f"{down_name}.input_global_scale"], torch.tensor([3.25]))
    assert dict(model.named_buffers())[f"{q_name}.input_global_scale"].dtype == torch.float32
    assert "model.layers.0.self_attn.k_proj.input_global_scale" not in state   # dynamic: no buffer
    assert f"{q_name}.weight_q" in state and f"{q_name}.weight_global_scale" in state


@pytest.mark.parametrize("scales, weight_format, error", [
    ({"layers.0.self_attn.q_proj": 2.0}, WeightFormat.NVFP4,
     r"names \['layers.0.self_attn.q_proj'\], which the plan does not parallelize; keys are full module names"),
    ({"model.layers.0.self_attn.q_proj": 2.0}, WeightFormat.BF16, "activation_scales quantize NVFP4 activations"),
    ({"model.layers.0.self_attn.q_proj": 0.0}, WeightFormat.NVFP4, "must be finite and > 0, got 0.0"),
    ({"model.layers.0.self_attn.q_proj": math.nan}, WeightFormat.NVFP4, "must be finite and > 0, got nan"),
    ({"model.layers.0.self_attn.q_proj": torch.ones(2)}, WeightFormat.NVFP4, r"must hold one element, got shape \(2,\)"),
], ids=["not-full-name", "bf16", "zero", "nan", "two-elements"])
def test_bad_activation_scales_are_clear_errors(fake_group, scales, weight_format, error):
    with pytest.raises(ValueError, match=error):
        parallelize(hf_tiny.build("llama"), activation_scales=scales, weight_format=weight_format)


def test_static_scale_is_a_tensor_input_of_the_compiled_graph():
    """If the scale were baked into the graph as a constant, changing the buffer in place would not
    change the compiled output; it does, with no recompilation."""
    layer = NVFP4Linear(torch.randn(40, 64, generator=torch.Generator().manual_seed(0)), fp4fuse.NVFP4Quantizer(),
                        torch.float32, input_global_scale=200.0)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    first = compiled(x)
    assert torch.equal(first, layer(x))
    layer.input_global_scale.fill_(20.0)
    second = compiled(x)
    assert torch.equal(second, layer(x)) and not torch.equal(first, second)
    assert counter.frame_count == 1


# --------------------------------------------------------------------------- 2 gloo ranks


def _quantized_weights(model: nn.Module, kind: str) -> dict[str, torch.Tensor]:
    return {name: hf_tiny.fake_quantized_weight(model.get_submodule(name)) for name in hf_tiny.planned(kind=kind)}


#: olmo2, glm and phi3: plans with gathered column-parallel outputs and split row-parallel inputs, run
#: in the variants those layers change (the static-scale and TP=1 ones add nothing new for them)
KINDS = ("llama", "qwen2", "qwen3", "gemma3", "olmo2", "glm", "phi3")
ALL_VARIANTS = ("bf16", "nvfp4_static_tp2", "nvfp4_static_tp1", "nvfp4_dynamic_tp2")
GATHER_SPLIT_KINDS = ("olmo2", "glm", "phi3")


def _variants(kind: str) -> tuple[str, ...]:
    return ("bf16", "nvfp4_dynamic_tp2") if kind in GATHER_SPLIT_KINDS else ALL_VARIANTS


def _rank_main() -> dict[str, torch.Tensor]:
    """Logits of every parallelized variant; the references are computed once, in the test."""
    singles = [dist.new_group([r]) for r in range(WORLD)]
    tp1 = singles[dist.get_rank()]
    logits: dict[str, torch.Tensor] = {}
    for kind in KINDS:
        hf = hf_tiny.build(kind)
        scales = hf_tiny.calibrate(hf, hf_tiny.token_ids(3), kind)
        builders = {"bf16": lambda: parallelize(copy.deepcopy(hf), weight_format=WeightFormat.BF16),
                    "nvfp4_static_tp2": lambda: parallelize(copy.deepcopy(hf), activation_scales=scales),
                    "nvfp4_static_tp1": lambda: parallelize(copy.deepcopy(hf), tp1, activation_scales=scales),
                    "nvfp4_dynamic_tp2": lambda: parallelize(copy.deepcopy(hf))}
        for variant in _variants(kind):
            model = builders[variant]()
            for batch in (1, 3):
                logits[f"{kind}/{variant}/batch{batch}"] = hf_tiny.logits(model, hf_tiny.token_ids(batch))
        if kind in GATHER_SPLIT_KINDS:  # one graph: no rewrite spans a graph break
            traced = torch.compile(builders["nvfp4_dynamic_tp2"](), backend="eager", fullgraph=True)
            logits[f"{kind}/fullgraph"] = hf_tiny.logits(traced, hf_tiny.token_ids(3))
    return logits


def test_hf_models_at_tp2_equal_their_references():
    results = run_on_ranks(_rank_main, WORLD, timeout=TIMEOUT_S)
    for kind in KINDS:
        hf = hf_tiny.build(kind)
        weights = _quantized_weights(hf, kind)
        scales = hf_tiny.calibrate(hf, hf_tiny.token_ids(3), kind)
        references = {"bf16": hf.double(),
                      "nvfp4_static": hf_tiny.nvfp4_reference(hf, weights, scales, WORLD, kind),
                      "nvfp4_dynamic": hf_tiny.nvfp4_reference(hf, weights, None, WORLD, kind)}
        for batch in (1, 3):
            ids = hf_tiny.token_ids(batch)
            expected = {name: hf_tiny.logits(ref, ids) for name, ref in references.items()}
            for rank, logits in enumerate(results):
                for variant in _variants(kind):
                    key = f"{kind}/{variant}/batch{batch}"
                    err = hf_tiny.rel_error(logits[key], expected[variant.removesuffix("_tp2").removesuffix("_tp1")])
                    bound = EXACT_SPLIT_SUM if variant == "bf16" else QUANTIZED
                    assert err < bound, f"rank {rank}: {key}: relative error {err:.3g} >= {bound}"
    for kind in GATHER_SPLIT_KINDS:  # traced whole (fullgraph), the eager model's logits bit for bit
        for rank, logits in enumerate(results):
            assert torch.equal(logits[f"{kind}/fullgraph"], logits[f"{kind}/nvfp4_dynamic_tp2/batch3"]), (rank, kind)
