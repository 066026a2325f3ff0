"""Sequence-parallel patterns on traced graphs, fake process group (world 2): exact match counts,
the ops before and after, and the logged reason for every match left alone.

Graphs are traced with ``fp4fuse.patterns.base.aot_trace`` (AOT autograd + Inductor decompositions, the
form of a post-grad graph); ``test_patterns_match_inductor_post_grad_graphs`` checks that the
same patterns match graphs Inductor itself hands to a post-grad pass. A traced graph's inputs are
all per-call inputs unless a test marks some as model state (``state=``: AOT autograd's parameter
descriptor, as graphs of modules carry it), which is what the rank-uniformity proofs trust.
"""
from __future__ import annotations

import collections
import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import fp4fuse  # noqa: F401  (registers torch.ops.fp4fuse.*)
from torch._functorch._aot_autograd.descriptors import BufferAOTInput, ParamAOTInput

from fp4fuse.nvfp4.format import global_scale_from_amax
from fp4fuse.nvfp4.quantizer import NVFP4Quantizer, register_amax_group
from fp4fuse.config import FusionConfig, RankCheck
from fp4fuse.ops import sp_ops  # noqa: F401  (registers fp4fuse::shard_rows)
from fp4fuse.passes.sequence_parallel import SequenceParallelismPass
from fp4fuse.patterns.base import aot_trace
from fp4fuse.patterns.thresholds import SPThresholds, sp_thresholds, sp_unquantized_min_tokens, sp_unshared_min_tokens

W = 2
H = 64
BF16 = torch.bfloat16
fc = torch.ops._c10d_functional
fp4 = torch.ops.fp4fuse
aten = torch.ops.aten
SP_LOGGER = "fp4fuse.passes.sequence_parallel"


# a 2-rank fake process group (tests/conftest.py): graphs with collectives trace without ranks
pytestmark = pytest.mark.usefixtures("fake_group")


@pytest.fixture(scope="module")
def sp_pass() -> SequenceParallelismPass:
    """One pass for the module: patterns are registered once per group and family."""
    return SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True))


@pytest.fixture(scope="module")
def always_pass() -> SequenceParallelismPass:
    """rank_check='always': per-call graph inputs are verified on every call, so they may be relied on."""
    return SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True, rank_check="always"))


def group() -> str:
    return dist.group.WORLD.group_name


# --------------------------------------------------------------------------- graph building


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(x, "sum", group())


def fp4fuse_norm(x, w, residual=None, eps=1e-6):
    if residual is None:
        return fp4.rms_norm(x, w, eps)
    out, total = fp4.fused_add_rms_norm(x, residual, w, eps)
    return out, total


def torch_functional_norm(x, w, residual=None, eps=1e-5, residual_first=False):
    if residual is None:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    total = residual + x if residual_first else x + residual
    return F.rms_norm(total, (total.shape[-1],), w, eps), total


def torch_manual_norm(x, w, residual=None, eps=1e-6, residual_first=False):
    def norm(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w
    if residual is None:
        return norm(x)
    total = residual + x if residual_first else x + residual
    return norm(total), total


def torch_fp32_norm(x, w, residual=None, eps=1e-6, residual_first=False):
    def norm(t):
        tf = t.float()
        return w * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype)
    if residual is None:
        return norm(x)
    total = residual + x if residual_first else x + residual
    return norm(total), total


def torch_offset_fp32_norm(x, w, residual=None, eps=1e-6, residual_first=False):
    """``Gemma3RMSNorm.forward``: fp32 statistics, ``1 + weight``, one rounding at the end."""
    def norm(t):
        tf = t.float()
        return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(t)
    if residual is None:
        return norm(x)
    total = residual + x if residual_first else x + residual
    return norm(total), total


NORMS = {"fp4fuse": fp4fuse_norm, "torch_functional": torch_functional_norm,
         "torch_manual": torch_manual_norm, "torch_fp32": torch_fp32_norm, "torch_offset_fp32": torch_offset_fp32_norm}


def static_quant(x):
    return fp4.scaled_fp4_quant(x, torch.full((1,), 3.0, device=x.device))


def rows_quant(x):
    """A linear's view of ``[..., K]``: ``[tokens, K]`` rows, quantized with a constant scale."""
    return static_quant(x.reshape(-1, x.shape[-1]))


def three_layers(norm, quant=static_quant, **norm_kwargs):
    """embedding all_reduce -> first norm -> quant; o_proj all_reduce -> middle norm -> quant;
    down all_reduce -> last norm (bf16). The quantized activations feed the next "GEMM" input."""
    def fn(x0, x1, x2, w0, w1, w2):
        r0 = all_reduce(x0)
        q0, s0 = quant(norm(r0, w0, **norm_kwargs))[:2]
        n1, r1 = norm(all_reduce(x1), w1, r0, **norm_kwargs)
        q1, s1 = quant(n1)[:2]
        n2, _ = norm(all_reduce(x2), w2, r1, **norm_kwargs)
        return q0, s0, q1, s1, n2
    return fn


def as_model_state(gm: torch.fx.GraphModule, state: dict[int, str]) -> torch.fx.GraphModule:
    """Mark inputs ``position -> name`` as parameters (``*.weight``) or buffers (anything else),
    the way AOT autograd describes the inputs of a module's graph."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    for position, name in state.items():
        desc = ParamAOTInput if name.endswith("weight") else BufferAOTInput
        placeholders[position].meta["desc"] = desc(name)
    return gm


def trace(fn, shapes, dtype=BF16, mode: FakeTensorMode | None = None,
          state: dict[int, str] | None = None, fp32: tuple[int, ...] = ()) -> torch.fx.GraphModule:
    """``fn`` traced on fake inputs of ``shapes`` (``dtype``; float32 at positions ``fp32``)."""
    mode = mode or FakeTensorMode()
    with mode:
        args = [torch.empty(s, dtype=torch.float32 if i in fp32 else dtype) for i, s in enumerate(shapes)]
    return as_model_state(aot_trace(fn, args), state or {})


#: the norm weights of ``three_layers`` (arguments 3-5) as the parameters of a model
NORM_WEIGHTS = {3: "layers.0.input_norm.weight", 4: "layers.0.post_norm.weight", 5: "norm.weight"}


def layer_shapes(tokens: int = 8, lead: tuple[int, ...] = ()):
    return [(*lead, tokens, H)] * 3 + [(H,)] * 3


def fake_value_of_output(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    return [n.meta["val"] for n in gm.graph.find_nodes(op="output")[0].args[0]]


def rank_checks(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return gm.graph.find_nodes(op="call_function", target=fp4.check_rank_uniform.default)


CONSTANTS_LABEL = "the constants compiled into this rank's graph that the rewrites rely on ("


def split_constants(check: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node, list[str], str]:
    """A rank check's model state without its last tensor, which is ``full([1], digest)`` of the
    literal arguments the rewrites rely on (an epsilon, a scale compiled into the graph), and the
    names without that tensor's label: ``(state, digest, names, constants label)``."""
    *state, digest = check.args[0]
    names = check.args[2].split("\n")
    label = names.pop(len(state))
    assert digest.target is aten.full.default and digest.args[0] == [1] and label.startswith(CONSTANTS_LABEL)
    return state, digest, names, label


def ops(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def reduce_ops(gm) -> list[str]:
    return [n.args[1] for n in gm.graph.nodes if n.target is fc.all_reduce.default]


def run(sp: SequenceParallelismPass, gm: torch.fx.GraphModule) -> int:
    n = sp(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return n


def counts(sp: SequenceParallelismPass) -> dict[str, int]:
    return {k.removeprefix("sequence_parallel."): v for k, v in sp.match_counts.items()}


# --------------------------------------------------------------------------- matches


def test_fp4fuse_norms_first_middle_last_static_scale(sp_pass):
    gm = trace(three_layers(fp4fuse_norm), layer_shapes(), state=NORM_WEIGHTS)
    before = ops(gm)
    assert before[fc.all_reduce.default] == 3 and before[fc.all_gather_into_tensor.default] == 0

    assert run(sp_pass, gm) == 5
    assert counts(sp_pass) == {"first.fp4fuse": 1, "middle.fp4fuse": 1, "last.fp4fuse": 1, "quant_before_gather": 2}
    after = ops(gm)
    assert after[fc.all_reduce.default] == 0
    assert after[fc.reduce_scatter_tensor.default] == 3
    # codes + scales of two quantized activations, and the last norm's bf16 output
    assert after[fc.all_gather_into_tensor.default] == 5
    assert after[fp4.scaled_fp4_quant.default] == 2 and after[fp4.fused_add_rms_norm.default] == 2
    # the residual stream stayed sharded: both shard_rows folded into the shards they re-sliced
    assert after[fp4.shard_rows.default] == 0 and sp_pass.folded_residuals == 2
    assert sp_pass.skips == []


def test_quantize_happens_before_the_gather(sp_pass):
    gm = trace(three_layers(fp4fuse_norm), layer_shapes(tokens=8), state=NORM_WEIGHTS)
    run(sp_pass, gm)
    for quant in gm.graph.find_nodes(op="call_function", target=fp4.scaled_fp4_quant.default):
        assert quant.meta["val"][0].shape == (4, H // 2)  # 8 tokens over 2 ranks: quantizes a shard
    gathers = gm.graph.find_nodes(op="call_function", target=fc.all_gather_into_tensor.default)
    gathered = [n.meta["val"] for n in gathers]
    assert sorted((tuple(v.shape), v.dtype) for v in gathered) == sorted(
        [((8, H // 2), torch.uint8)] * 2 + [((8, H // 16), torch.uint8)] * 2 + [((8, H), BF16)])
    views = gm.graph.find_nodes(op="call_function", target=aten.view.dtype)
    assert {n.args[1] for n in views} == {torch.uint8, torch.float8_e4m3fn}  # scales travel as uint8


@pytest.mark.parametrize("form", ["torch_functional", "torch_manual", "torch_fp32", "torch_offset_fp32"])
@pytest.mark.parametrize("residual_first", [False, True])
def test_torch_norm_forms(sp_pass, form, residual_first):
    gm = trace(three_layers(NORMS[form], residual_first=residual_first), layer_shapes(), state=NORM_WEIGHTS)
    assert run(sp_pass, gm) == 5
    assert counts(sp_pass) == {f"first.{form}": 1, f"middle.{form}": 1, f"last.{form}": 1, "quant_before_gather": 2}
    assert ops(gm)[fc.all_reduce.default] == 0


def test_the_offset_form_in_fp32_is_the_manual_form_with_one_plus_weight(sp_pass):
    """In fp32 the Gemma form has no casts: the manual form, registered first, matches it with
    ``1 + weight`` as its weight; the rewrite keeps that sum (one per norm)."""
    gm = trace(three_layers(torch_offset_fp32_norm), layer_shapes(), state=NORM_WEIGHTS, dtype=torch.float32)
    assert run(sp_pass, gm) == 5
    assert counts(sp_pass) == {"first.torch_manual": 1, "middle.torch_manual": 1, "last.torch_manual": 1,
                               "quant_before_gather": 2}


def scaled_layers(norm, embedding_scale=12.0, residual_scale=0.22, **norm_kwargs):
    """Granite's residual stream: the embedding's all-reduce times ``embedding_multiplier``, each
    row-parallel output times ``residual_multiplier`` before the residual add."""
    def fn(x0, x1, x2, w0, w1, w2):
        r0 = all_reduce(x0) * embedding_scale
        q0, s0 = static_quant(norm(r0, w0, **norm_kwargs))[:2]
        n1, r1 = norm(all_reduce(x1) * residual_scale, w1, r0, **norm_kwargs)
        q1, s1 = static_quant(n1)[:2]
        n2, _ = norm(all_reduce(x2) * residual_scale, w2, r1, **norm_kwargs)
        return q0, s0, q1, s1, n2
    return fn


def _scales_of_shards(gm: torch.fx.GraphModule) -> list[float]:
    """The numbers that multiply a reduce-scatter's (waited) result."""
    return sorted(n.args[1] for n in gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
                  if n.args[0].target is fc.wait_tensor.default
                  and n.args[0].args[0].target is fc.reduce_scatter_tensor.default)


@pytest.mark.parametrize("form", ["torch_functional", "torch_fp32"])
@pytest.mark.parametrize("residual_first", [False, True])
def test_scaled_all_reduces(sp_pass, form, residual_first):
    """``all_reduce(x) * number`` before the norm (first) or the residual add: the scaled patterns
    rewrite all three, and each number multiplies the shard instead."""
    gm = trace(scaled_layers(NORMS[form], residual_first=residual_first), layer_shapes(), state=NORM_WEIGHTS)
    assert run(sp_pass, gm) == 5
    assert counts(sp_pass) == {f"first.{form}_scaled": 1, f"middle.{form}_scaled": 1, f"last.{form}_scaled": 1,
                               "quant_before_gather": 2}
    assert ops(gm)[fc.all_reduce.default] == 0
    assert _scales_of_shards(gm) == [0.22, 0.22, 12.0]


@pytest.mark.parametrize("emulate", [False, True])
def test_rewritten_scalings_and_residual_adds_round_as_eager_under_emulate_precision_casts(emulate):
    """With ``emulate_precision_casts`` the bf16 ops the rewrite writes in place of eager-level ones
    -- each shard's scaling and each residual add -- carry AOT autograd's eager-rounding mark; without
    it nothing is marked."""
    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True))
    gm = trace(scaled_layers(torch_fp32_norm, residual_first=True), layer_shapes(), state=NORM_WEIGHTS)
    with torch._inductor.config.patch(emulate_precision_casts=emulate):
        assert run(sp, gm) == 5
    marked = collections.Counter(n.target for n in gm.graph.nodes if n.meta.get("low_precision_pointwise_barrier"))
    assert marked == (collections.Counter({aten.mul.Tensor: 3, aten.add.Tensor: 2}) if emulate else collections.Counter())


@pytest.mark.parametrize("position", ["first", "middle"])
@pytest.mark.parametrize("emulate", [False, True])
def test_a_rewritten_bf16_manual_norm_rounds_as_eager_under_emulate_precision_casts(emulate, position):
    """``t * rsqrt(t.pow(2).mean(-1) + eps) * w`` computed in bf16: every op is an eager-level
    low-precision op (AOT autograd marks each), so the shard's copy of the norm must carry the mark
    too, not only the residual add. Unmarked, Inductor fused them in fp32 and the rewritten graph
    differed from the unfused one in a third of the norm outputs (2 gloo ranks, 8 x 288; with NVFP4
    after it, 0.17 relative: tests/fuzz_fusion.py --seed 2 --case 6)."""
    def fn(x, residual, w):
        t = all_reduce(x) if position == "first" else all_reduce(x) + residual
        n = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return static_quant(n)[0], t
    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True))
    gm = trace(fn, [(8, H), (8, H), (H,)], state={1: "layer.residual_buffer", 2: "norm.weight"})
    with torch._inductor.config.patch(emulate_precision_casts=emulate):
        assert run(sp, gm) >= 1
    marked = collections.Counter(n.target for n in gm.graph.nodes if n.meta.get("low_precision_pointwise_barrier"))
    expected = {aten.add.Tensor: 1 if position == "first" else 2, aten.pow.Tensor_Scalar: 1, aten.mean.dim: 1,
                aten.rsqrt.default: 1, aten.mul.Tensor: 2}
    assert marked == (collections.Counter(expected) if emulate else collections.Counter())


def layer_norm(x, w, residual=None, eps=1e-5, residual_first=False, b=None):
    """``nn.LayerNorm``'s ``F.layer_norm(x, (hidden,), weight, bias, eps)`` (the bias is ``w`` reversed
    unless given)."""
    bias = w.flip(0) if b is None else b
    if residual is None:
        return F.layer_norm(x, (x.shape[-1],), w, bias, eps)
    total = residual + x if residual_first else x + residual
    return F.layer_norm(total, (x.shape[-1],), w, bias, eps), total


@pytest.mark.parametrize("residual_first", [False, True])
def test_layer_norm(sp_pass, residual_first):
    """LayerNorm (weight and bias) takes the same three rewrites, the bias proven like the weight."""
    def fn(x0, x1, x2, w0, w1, w2, b0, b1, b2):
        r0 = all_reduce(x0)
        q0, s0 = static_quant(layer_norm(r0, w0, b=b0))[:2]
        n1, r1 = layer_norm(all_reduce(x1), w1, r0, residual_first=residual_first, b=b1)
        q1, s1 = static_quant(n1)[:2]
        n2, _ = layer_norm(all_reduce(x2), w2, r1, residual_first=residual_first, b=b2)
        return q0, s0, q1, s1, n2
    state = {**NORM_WEIGHTS, 6: "layers.0.input_norm.bias", 7: "layers.0.post_norm.bias", 8: "norm.bias"}
    gm = trace(fn, layer_shapes() + [(H,)] * 3, state=state)
    assert run(sp_pass, gm) == 5
    assert counts(sp_pass) == {"first.torch_layer_norm": 1, "middle.torch_layer_norm": 1, "last.torch_layer_norm": 1,
                               "quant_before_gather": 2}
    assert ops(gm)[fc.all_reduce.default] == 0


def test_a_layer_norm_bias_that_may_differ_across_ranks_is_left_alone(sp_pass, caplog):
    """A norm bias that is a per-call input (not model state) may differ across ranks: skipped."""
    def fn(x0, w0, b0):
        return static_quant(layer_norm(all_reduce(x0), w0, b=b0))[:2]
    gm = trace(fn, [(8, H), (H,), (H,)], state={1: "layers.0.input_norm.weight"})
    with caplog.at_level(logging.DEBUG, logger=SP_LOGGER):
        run(sp_pass, gm)
    assert ops(gm)[fc.all_reduce.default] == 1
    assert_skipped(sp_pass, caplog, "norm bias", "torch_layer_norm")


@pytest.mark.parametrize("rows", [2, 4])
def test_a_layer_norm_over_one_row_per_rank_is_left_alone(sp_pass, caplog, rows):
    """Inductor computes a one-row LayerNorm (Welford) in another order than the same row among
    several: at 2 tokens (one row per rank) the rewrite changed last bits of HF Starcoder2's logits
    (fp32, 2 gloo ranks; tests/fuzz_fusion.py --seed 2 --case 37), so it is skipped there. RMS
    norms (one row computed as among many) and 4 tokens rewrite."""
    def fn(x0, w0, b0, x1, w1):
        n0 = layer_norm(all_reduce(x0), w0, b=b0)
        n1 = all_reduce(x1)
        n1 = n1 * torch.rsqrt(n1.pow(2).mean(-1, keepdim=True) + 1e-6) * w1
        return static_quant(n0)[0], static_quant(n1)[0]
    gm = trace(fn, [(rows, H), (H,), (H,), (rows, H), (H,)],
               state={1: "layers.0.input_norm.weight", 2: "layers.0.input_norm.bias", 4: "layers.1.input_norm.weight"})
    with caplog.at_level(logging.DEBUG, logger=SP_LOGGER):
        run(sp_pass, gm)
    if rows == 2:
        assert counts(sp_pass) == {"first.torch_manual": 1, "quant_before_gather": 1}
        assert_skipped(sp_pass, caplog, "2 tokens leave one row per rank", "first.torch_layer_norm")
    else:
        assert counts(sp_pass) == {"first.torch_layer_norm": 1, "first.torch_manual": 1, "quant_before_gather": 2}


def biased_hf_layers(norm):
    """Hugging Face layers with row-parallel biases: each row-parallel linear adds its bias to the
    all-reduced 2-D rows, then views them back to ``[b, s, h]`` (fp4fuse.tp.rows.row_parallel_sum)."""
    def fn(e, p1, p2, w0, w1, w2, b1, b2):
        lead = e.shape[:-1]
        h = all_reduce(e)                                  # a vocab-parallel embedding's sum
        q0, s0 = rows_quant(norm(h, w0))
        total = h + (all_reduce(p1) + b1).view(*lead, H)
        q1, s1 = rows_quant(norm(total, w1))
        n2 = norm(total + (all_reduce(p2) + b2).view(*lead, H), w2)
        return q0, s0, q1, s1, n2
    return fn


BIASED_SHAPES = [(2, 4, H), (8, H), (8, H), (H,), (H,), (H,), (H,), (H,)]
BIASED_NORM_WEIGHTS = {3: "layers.0.input_layernorm.weight", 4: "layers.0.post_attention_layernorm.weight",
                       5: "norm.weight"}


@pytest.mark.parametrize("norm", ["torch_fp32", "layer_norm"])
def test_row_parallel_biases(sp_pass, norm):
    """``all_reduce(rows) + row_bias`` viewed back to 3-D before the residual add: the view moves
    before the add and the all-reduce, and the biased patterns add the row to the shard."""
    norm_fn = hf_norm if norm == "torch_fp32" else (lambda x, w: layer_norm(x, w, b=w))
    gm = trace(biased_hf_layers(norm_fn), BIASED_SHAPES,
               state={**BIASED_NORM_WEIGHTS, 6: "layers.0.self_attn.o_proj.bias", 7: "layers.0.mlp.down_proj.bias"})
    assert run(sp_pass, gm) == 5
    family = "torch_fp32" if norm == "torch_fp32" else "torch_layer_norm"
    assert counts(sp_pass) == {f"first.{family}": 1, f"middle.{family}_biased": 1, f"last.{family}_biased": 1,
                               "quant_before_gather": 2}
    assert ops(gm)[fc.all_reduce.default] == 0
    row_adds = [n for n in gm.graph.find_nodes(op="call_function", target=aten.add.Tensor)
                if n.args[0].target is fc.wait_tensor.default and n.args[1].meta["val"].dim() == 1]
    # each bias (inputs 6 and 7) is added to a 4-row shard of a reduce-scatter
    biases = gm.graph.find_nodes(op="placeholder")[6:8]
    assert sorted(n.args[1].name for n in row_adds) == sorted(b.name for b in biases), row_adds
    assert all(n.args[0].args[0].target is fc.reduce_scatter_tensor.default and n.meta["val"].shape == (4, H)
               for n in row_adds)


def test_a_moved_row_bias_keeps_its_eager_rounding_where_nothing_fuses(sp_pass):
    """Moving a row bias's view before the add writes a new add; under ``emulate_precision_casts`` it
    keeps the eager-rounding mark AOT autograd gave the old one, also where no rewrite follows (7
    tokens do not split over 2 ranks), so the graph rounds as the one without the pass."""
    shapes = [(1, 7, H), (7, H), (7, H)] + [(H,)] * 5
    state = {**BIASED_NORM_WEIGHTS, 6: "layers.0.self_attn.o_proj.bias", 7: "layers.0.mlp.down_proj.bias"}
    with torch._inductor.config.patch(emulate_precision_casts=True):
        gm = trace(biased_hf_layers(hf_norm), shapes, state=state)
        assert run(sp_pass, gm) == 0
    row_adds = [n for n in gm.graph.find_nodes(op="call_function", target=aten.add.Tensor)
                if isinstance(n.args[1], torch.fx.Node) and n.args[1].meta["val"].dim() == 1]
    assert len(row_adds) == 2
    # the views moved before the adds and on before the all-reduces: add(wait(all_reduce(reshape(p))), b)
    assert all(n.args[0].args[0].args[0].target is aten.reshape.default for n in row_adds), row_adds
    assert all(n.meta.get("low_precision_pointwise_barrier") for n in row_adds)


def test_a_row_bias_from_a_per_call_input_is_left_alone(sp_pass, caplog):
    """A row added after the all-reduce that is not model state may differ across ranks: skipped."""
    gm = trace(biased_hf_layers(hf_norm), BIASED_SHAPES, state=BIASED_NORM_WEIGHTS)
    with caplog.at_level(logging.DEBUG, logger=SP_LOGGER):
        run(sp_pass, gm)
    assert counts(sp_pass) == {"first.torch_fp32": 1, "quant_before_gather": 1}
    assert ops(gm)[fc.all_reduce.default] == 2
    assert_skipped(sp_pass, caplog, "row-parallel bias", "_biased")


def alpha_adds(case):
    """``add(all_reduce(p), t, alpha=2)`` is ``sum + 2 * t``, not a row bias or residual add: a row
    bias viewed back to 3-D (with or without a norm after it), and a residual add before a norm."""
    def row_bias(p, w, b):
        y = torch.add(all_reduce(p), b, alpha=2.0).view(2, 4, H)
        return (hf_norm(y, w),) if case == "row_bias_then_norm" else (y,)

    def residual(p, e, w):
        n, total = torch_functional_norm(all_reduce(p), w, all_reduce(e))
        return n, total

    def residual_add(x, residual, w, eps=1e-5):  # torch_functional_norm's add, with alpha
        total = torch.add(x, residual, alpha=2.0)
        return F.rms_norm(total, (H,), w, eps), total

    def alpha_residual(p, e, w):
        return residual_add(all_reduce(p), all_reduce(e), w)
    if case == "residual_add":
        return alpha_residual, [(8, H), (8, H), (H,)], {2: "norm.weight"}
    return row_bias, [(8, H), (H,), (H,)], {1: "norm.weight", 2: "o_proj.bias"}


@pytest.mark.parametrize("case", ["row_bias", "row_bias_then_norm", "residual_add", "residual_add_no_pairs"])
def test_an_add_with_alpha_is_neither_a_row_bias_nor_a_residual_add(sp_pass, case, caplog, monkeypatch):
    """An add whose ``alpha`` is not 1 is left as it is (a rebuilt add, or a pattern traced without
    ``alpha``, would drop the factor): the graph computes what it computed without the pass (run
    on the fake group, whose all-reduce returns its input), and a pattern match says why it is skipped,
    also where the matcher does not say which pattern node matched which node (``no_pairs``)."""
    from fp4fuse.patterns import base as pattern_base

    if case.endswith("_no_pairs"):
        monkeypatch.setattr(pattern_base, "_pattern_node_pairs", lambda match: None)
        case = case.removesuffix("_no_pairs")
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    fn, shapes, state = alpha_adds(case)
    gm = trace(fn, shapes, state=state)
    unrewritten = copy.deepcopy(gm)
    run(sp_pass, gm)
    assert counts(sp_pass) == {}
    args = [torch.randn(s, dtype=BF16, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    expected = unrewritten(*args)
    assert all(torch.equal(out, ref) for out, ref in zip(gm(*args), expected, strict=True))
    if case == "residual_add":
        assert_skipped(sp_pass, caplog, "passes alpha=2.0, which the pattern does not", "middle.torch_functional")


def test_an_all_reduce_scaled_by_a_tensor_is_left_alone(sp_pass, caplog):
    """A tensor factor (here per hidden column) is not applied to the shard: the match is skipped
    with the reason, while the embedding's number-scaled all-reduce is rewritten."""
    def fn(x0, x1, w0, w1, t):
        r0 = all_reduce(x0) * 2.0
        q0, s0 = static_quant(torch_fp32_norm(r0, w0))[:2]
        n1, _ = torch_fp32_norm(all_reduce(x1) * t, w1, r0)
        return q0, s0, n1
    gm = trace(fn, [(8, H), (8, H), (H,), (H,), (H,)], state={2: "layers.0.input_norm.weight", 3: "norm.weight"})
    with caplog.at_level(logging.DEBUG, logger=SP_LOGGER):
        run(sp_pass, gm)
    assert counts(sp_pass) == {"first.torch_fp32_scaled": 1, "quant_before_gather": 1}
    assert ops(gm)[fc.all_reduce.default] == 1
    assert_skipped(sp_pass, caplog, "a tensor: only a number is applied to the shard", "_scaled")


def test_torch_norm_fp32_activations(sp_pass):
    gm = trace(three_layers(torch_functional_norm), layer_shapes(), state=NORM_WEIGHTS, dtype=torch.float32)
    assert run(sp_pass, gm) == 5
    assert counts(sp_pass)["middle.torch_functional"] == 1


def test_any_epsilon_and_it_is_kept(sp_pass):
    gm = trace(three_layers(fp4fuse_norm, eps=3e-4), layer_shapes(), state=NORM_WEIGHTS)
    run(sp_pass, gm)
    norms = gm.graph.find_nodes(op="call_function", target=fp4.fused_add_rms_norm.default)
    assert len(norms) == 2 and {n.args[3] for n in norms} == {3e-4}


def full_amax_quant(x):
    """A dynamic scale from one reduction over every element (``x.abs().amax()``), where
    ``NVFP4Quantizer`` takes the row maxima first (``abs_amax``)."""
    gs = global_scale_from_amax(x.abs().amax().float().reshape(1))
    return fp4.scaled_fp4_quant(x, gs)


@pytest.mark.parametrize("quant", ["quantizer", "full_amax"])
def test_dynamic_scale_gets_a_group_amax(sp_pass, quant):
    """Both forms of a dynamic scale's amax are replaced by the shards' all-reduce MAX: the row
    maxima first (NVFP4Quantizer) and one reduction over every element."""
    quant = NVFP4Quantizer().quantize if quant == "quantizer" else full_amax_quant
    gm = trace(three_layers(fp4fuse_norm, quant=quant), layer_shapes(), state=NORM_WEIGHTS)
    assert reduce_ops(gm) == ["sum"] * 3
    run(sp_pass, gm)
    assert counts(sp_pass) == {"first.fp4fuse": 1, "middle.fp4fuse": 1, "last.fp4fuse": 1,
                               "quant_before_gather.dynamic_scale": 2}
    # one all-reduce MAX of [amax, isnan flag] per quantized activation, nothing else all-reduced
    maxes = [n for n in gm.graph.find_nodes(op="call_function", target=fc.all_reduce.default)]
    assert [n.args[1] for n in maxes] == ["max", "max"]
    assert all(tuple(n.meta["val"].shape) == (2,) for n in maxes)
    # no amax reads a gathered tensor any more: every |.| an amax reads is of a shard
    magnitudes = [n.args[0] for n in gm.graph.find_nodes(op="call_function", target=aten.amax.default)
                  if n.args[0].target is aten.abs.default]
    assert len(magnitudes) == 2
    assert all(m.args[0].target is not fc.wait_tensor.default for m in magnitudes)


def test_dynamic_scale_with_amax_group(sp_pass):
    group_id = register_amax_group()
    quant = NVFP4Quantizer(amax_group=group_id).quantize
    gm = trace(three_layers(fp4fuse_norm, quant=quant), layer_shapes(), state=NORM_WEIGHTS)
    run(sp_pass, gm)
    assert counts(sp_pass)["quant_before_gather.dynamic_scale"] == 2
    # the quantizer's own all-reduce MAX stays (now over identical values); the SP one is added
    assert sorted(reduce_ops(gm)) == ["max"] * 4


def residual_from_input(x, residual, w):
    out, total = fp4fuse_norm(all_reduce(x), w, residual)
    return out, total


def test_residual_from_a_graph_input_is_trusted_only_when_checked_every_call(sp_pass, always_pass, caplog):
    """A residual passed to the graph (e.g. after a graph break) changes every call: the default
    mode leaves the norm alone, ``always`` shards it and verifies the residual on every call."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    gm = trace(residual_from_input, [(8, H), (8, H), (H,)], state={2: "norm.weight"})
    assert run(sp_pass, gm) == 0 and rank_checks(gm) == []
    assert_skipped(sp_pass, caplog, "the residual arg1_1 may differ across ranks: it depends on arg1_1, a per-call "
                   "graph input", "middle.fp4fuse")

    gm = trace(residual_from_input, [(8, H), (8, H), (H,)], state={2: "norm.weight"})
    run(always_pass, gm)
    assert counts(always_pass) == {"middle.fp4fuse": 1}
    x, residual, weight = gm.graph.find_nodes(op="placeholder")
    shards = gm.graph.find_nodes(op="call_function", target=fp4.shard_rows.default)
    assert len(shards) == 1 and shards[0].args == (residual, group())
    # nothing rank-specific was baked in: no slice of the residual by a constant offset
    assert not gm.graph.find_nodes(op="call_function", target=aten.slice.Tensor)
    (check,) = rank_checks(gm)
    state, digest, names, constants = split_constants(check)
    assert (state, check.args[1]) == ([weight], [residual])  # model state on the first call, the residual every call
    assert names == ["arg2_1 (norm.weight)", "arg1_1"] and check.args[3] == group()
    assert "1e-06" in constants  # the norm's epsilon: each rank computes its shard with its own
    assert check.prev is digest and digest.prev in (residual, weight)  # right after the inputs
    assert [s.labels for s in always_pass.rank_checks] == [["arg2_1 (norm.weight)", "arg1_1"]]


def test_rank_check_lists_the_model_state_the_rewrites_rely_on(sp_pass):
    gm = trace(three_layers(fp4fuse_norm), layer_shapes(), state=NORM_WEIGHTS)
    run(sp_pass, gm)
    (check,) = rank_checks(gm)
    placeholders = gm.graph.find_nodes(op="placeholder")
    state, digest, names, constants = split_constants(check)
    assert state == placeholders[3:] and check.args[1] == []
    assert names == [f"arg{i}_1 ({NORM_WEIGHTS[i]})" for i in (3, 4, 5)]
    # the static global scale torch.full((1,), 3.0) compiled into the graph is listed first, and verified
    assert constants.startswith(CONSTANTS_LABEL) and ": full.default([1], 3.0, " in constants.split(";")[0]
    assert any("full.default([1], 3.0, " in c for c in sp_pass.rank_checks[0].constants)
    first_calls = [n for n in gm.graph.nodes if n.op == "call_function"][:2]
    assert first_calls == [digest, check]  # before every collective of the graph
    assert len(check.users) == 0 and check.is_impure()  # kept by dead-code elimination
    gm.graph.eliminate_dead_code()
    assert rank_checks(gm) == [check]


# --------------------------------------------------------------------------- 3-D activations


def hf_layers(norm):
    """Hugging Face's residual stream on ``[batch, seq, hidden]``: a row-parallel linear all-reduces
    its ``[tokens, hidden]`` rows and views them back; ``residual + hidden`` in the model dtype."""
    def fn(e, p1, p2, w1, w2):
        lead = e.shape[:-1]
        h = all_reduce(e)                                  # a vocab-parallel embedding's sum
        total = h + all_reduce(p1).view(*lead, H)
        n1 = norm(total, w1)
        q, s = rows_quant(n1)
        n2 = norm(total + all_reduce(p2).view(*lead, H), w2)
        return q, s, n2
    return fn


def hf_norm(x, w, eps=1e-6):
    """``LlamaRMSNorm.forward``."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    return w * (xf * torch.rsqrt(variance + eps)).to(dtype)


@pytest.mark.parametrize("batch", [1, 3])
def test_hugging_face_layers_3d(sp_pass, batch):
    """Batch 1 and 3: the token count is batch x seq; the views the linears add around their 2-D
    rows fold away, so the quant moves before the gather as in a 2-D model."""
    seq = 4
    gm = trace(hf_layers(hf_norm), [(batch, seq, H), (batch * seq, H), (batch * seq, H), (H,), (H,)],
               state={3: "layers.0.post_attention_layernorm.weight", 4: "norm.weight"})
    assert run(sp_pass, gm) == 3
    assert counts(sp_pass) == {"middle.torch_fp32": 1, "last.torch_fp32": 1, "quant_before_gather": 1}
    assert ops(gm)[fc.all_reduce.default] == 1  # the embedding's, read by the residual add only
    (quant,) = gm.graph.find_nodes(op="call_function", target=fp4.scaled_fp4_quant.default)
    assert quant.meta["val"][0].shape == (batch * seq // W, H // 2)
    # gathered: the quant's codes and scales and the last norm's output (the residual stays sharded)
    gathered = gm.graph.find_nodes(op="call_function", target=fc.all_gather_into_tensor.default)
    assert sorted(n.meta["val"].shape[1] for n in gathered) == sorted([H // 2, H // 16, H])
    assert fake_value_of_output(gm)[-1].shape == (batch, seq, H)


def symbolic_hf_trace(batch_hint: int, seq: int):
    """``hf_layers`` the way Dynamo hands a model with a dynamic batch to Inductor: the batch is a
    SymInt graph input (``arg0_1``) and the activations ``[batch, seq, H]`` / ``[batch * seq, H]``."""
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC, DimDynamic.STATIC])
    e = mode.from_tensor(torch.empty(batch_hint, seq, H, dtype=BF16), symbolic_context=ctx)
    batch = e.shape[0]
    with mode:
        p1, p2 = (e.new_empty(batch * seq, H) for _ in range(2))
        w1, w2 = (torch.empty(H, dtype=BF16) for _ in range(2))
    layers = hf_layers(hf_norm)
    gm = aot_trace(lambda _batch, *args: layers(*args), [batch, e, p1, p2, w1, w2])
    return shape_env, as_model_state(gm, {4: "layers.0.post_attention_layernorm.weight", 5: "norm.weight"})


@pytest.mark.parametrize("seq", [1, 5])
def test_hugging_face_layers_with_a_dynamic_batch(sp_pass, seq):
    """Decode steps ``[batch, 1]`` and prefill chunks with a dynamic batch fuse as static ones do
    (the views around the all-reduces have symbolic shapes), under a divisibility guard, and each
    reduced activation keeps one reader, its collective's: no size read or view of it is left
    behind, which would keep the GEMM that produces it from fusing with a reduce-scatter."""
    shape_env, gm = symbolic_hf_trace(batch_hint=4, seq=seq)
    reduced = gm.graph.find_nodes(op="placeholder")[1:4]
    assert run(sp_pass, gm) == 3
    assert counts(sp_pass) == {"middle.torch_fp32": 1, "last.torch_fp32": 1, "quant_before_gather": 1}
    assert any("Mod(" in str(g.expr) for g in shape_env.guards)
    assert ops(gm)[fc.reduce_scatter_tensor.default] == 2
    for activation in reduced:
        assert len(activation.users) == 1, (activation, list(activation.users))
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and not n.users and not n.is_impure()]
    assert fake_value_of_output(gm)[-1].shape[1:] == (seq, H)


def test_a_dynamic_batch_hinted_at_one_row_per_rank_is_left_alone(sp_pass, caplog):
    """Two tokens over two ranks: tracing the shards at one row would specialize the batch (sizes
    0 and 1 are static to torch.compile), breaking a ``mark_dynamic``. No rewrite and no
    specialization; one guard keeps this graph to fewer than two rows per rank."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    shape_env, gm = symbolic_hf_trace(batch_hint=2, seq=1)
    assert run(sp_pass, gm) == 0
    assert not shape_env.replacements
    assert [_admits(shape_env, t) for t in (2, 3, 4, 5)] == [True, True, False, False]
    assert_skipped(sp_pass, caplog, "(hint 2) gives 1 row per rank")


def test_3d_token_count_is_the_product_of_the_leading_dims(sp_pass, caplog):
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    gm = trace(three_layers(torch_fp32_norm, quant=rows_quant), layer_shapes(tokens=3, lead=(3,)), state=NORM_WEIGHTS)
    assert run(sp_pass, gm) == 0
    assert_skipped(sp_pass, caplog, "token count 9 is not divisible by the group size 2", "torch_fp32")
    gm = trace(three_layers(torch_fp32_norm, quant=rows_quant), layer_shapes(tokens=4, lead=(1,)), state=NORM_WEIGHTS)
    assert run(sp_pass, gm) == 5
    assert counts(sp_pass) == {"first.torch_fp32": 1, "middle.torch_fp32": 1, "last.torch_fp32": 1,
                               "quant_before_gather": 2}


# --------------------------------------------------------------------------- left alone, with a reason


def assert_skipped(sp, caplog, reason_part: str, key_part: str = "") -> None:
    assert any(reason_part in s.reason and key_part in s.key for s in sp.skips), sp.skips
    assert any(reason_part in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)


def assert_left_alone(sp, gm, caplog, all_reduces: int, reason_part: str, key_part: str = "") -> None:
    """``sp`` rewrites nothing in ``gm``, whose ``all_reduces`` sums stay, and says why."""
    assert run(sp, gm) == 0
    assert reduce_ops(gm) == ["sum"] * all_reduces
    assert_skipped(sp, caplog, reason_part, key_part)


def test_token_count_not_divisible(sp_pass, caplog):
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    gm = trace(three_layers(fp4fuse_norm), layer_shapes(tokens=7), state=NORM_WEIGHTS)
    assert_left_alone(sp_pass, gm, caplog, 3, "token count 7 is not divisible by the group size 2", "fp4fuse")


def test_min_tokens(caplog):
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True, min_tokens=16))
    gm = trace(three_layers(fp4fuse_norm), layer_shapes(tokens=8), state=NORM_WEIGHTS)
    assert run(sp, gm) == 0
    assert_skipped(sp, caplog, "token count 8 is below min_tokens=16")
    gm = trace(three_layers(fp4fuse_norm), layer_shapes(tokens=16), state=NORM_WEIGHTS)
    assert run(sp, gm) == 5


def test_broadcast_residual(sp_pass, caplog):
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)

    def fn(x, residual, w):
        return torch_manual_norm(all_reduce(x), w, residual)
    gm = trace(fn, [(8, H), (1, H), (H,)], state={2: "norm.weight"})
    assert run(sp_pass, gm) == 0
    assert_skipped(sp_pass, caplog, "a broadcast residual cannot be sharded by rows", "torch_manual")


def test_per_row_norm_weight(sp_pass, caplog):
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)

    def fn(x, w):
        r = all_reduce(x)
        return torch_manual_norm(r, w), r
    gm = trace(fn, [(8, H), (8, H)])
    assert run(sp_pass, gm) == 0
    assert_skipped(sp_pass, caplog, "it must not vary by row", "first.torch_manual")


def norm_then_quant(x, w, gs):
    r = all_reduce(x)
    q, s = fp4.scaled_fp4_quant(fp4fuse_norm(r, w), gs)
    return q, s, r


def scale_shapes() -> list:
    return [(8, H), (H,), (1,)]


def test_static_scale_from_a_graph_input_stays_after_the_gather(sp_pass, caplog):
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    gm = trace(norm_then_quant, scale_shapes(), state={1: "norm.weight"}, fp32=(2,))
    run(sp_pass, gm)
    assert counts(sp_pass) == {"first.fp4fuse": 1}  # the norm is sharded, the quant is not moved
    assert_skipped(sp_pass, caplog, "the global scale arg2_1 may differ across ranks: it depends on arg2_1, a "
                   "per-call graph input", "quant_before_gather")
    quant = gm.graph.find_nodes(op="call_function", target=fp4.scaled_fp4_quant.default)[0]
    assert quant.args[0].target is fc.wait_tensor.default  # still quantizes the gathered rows


def test_static_scale_held_as_a_buffer_moves_before_the_gather(sp_pass):
    """A checkpoint's ``input_scale`` is a buffer: model state, verified on the first call."""
    gm = trace(norm_then_quant, scale_shapes(), state={1: "norm.weight", 2: "proj.input_scale"}, fp32=(2,))
    run(sp_pass, gm)
    assert counts(sp_pass) == {"first.fp4fuse": 1, "quant_before_gather": 1}
    quant = gm.graph.find_nodes(op="call_function", target=fp4.scaled_fp4_quant.default)[0]
    assert quant.meta["val"][0].shape == (4, H // 2)  # quantizes this rank's shard
    (check,) = rank_checks(gm)
    assert split_constants(check)[2] == ["arg1_1 (norm.weight)", "arg2_1 (proj.input_scale)"]


def test_rank_check_off_trusts_model_state_unchecked():
    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True, rank_check=RankCheck.OFF))
    gm = trace(norm_then_quant, scale_shapes(), state={1: "norm.weight", 2: "proj.input_scale"}, fp32=(2,))
    run(sp, gm)
    assert counts(sp) == {"first.fp4fuse": 1, "quant_before_gather": 1}
    assert rank_checks(gm) == [] and sp.rank_checks == []
    gm = trace(norm_then_quant, scale_shapes(), state={1: "norm.weight"}, fp32=(2,))
    run(sp, gm)
    assert counts(sp) == {"first.fp4fuse": 1}  # a per-call scale is still not trusted


@pytest.fixture(scope="module")
def other_groups() -> dict[str, str]:
    """Groups besides the TP group (world, ranks [0, 1]) of the fake process group."""
    return {"covering": dist.new_group([0, 1]).group_name, "subgroup": dist.new_group([0]).group_name,
            "unknown": "no_such_group"}


@pytest.mark.parametrize("which, reason", [
    ("covering", None),
    ("subgroup", "(ranks [0]) does not cover the TP group '0' (ranks [0, 1])"),
    ("unknown", "'no_such_group' or the TP group '0' does not resolve in this process"),
])
def test_scale_from_an_all_reduce_over_another_group(sp_pass, caplog, other_groups, which, reason):
    """An all-reduce proves its result uniform over its own group only: the quant moves before
    the TP gather when that group covers the TP group, and is left alone with the reason otherwise."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    other = other_groups[which]

    def fn(x, w, local_amax):
        amax = fc.wait_tensor(fc.all_reduce(local_amax, "max", other))
        return norm_then_quant(x, w, 2688.0 / amax)

    gm = trace(fn, scale_shapes(), state={1: "norm.weight"}, fp32=(2,))
    run(sp_pass, gm)
    if reason is None:
        assert counts(sp_pass) == {"first.fp4fuse": 1, "quant_before_gather": 1}
    else:
        assert counts(sp_pass) == {"first.fp4fuse": 1}
        assert_skipped(sp_pass, caplog, reason, "quant_before_gather")


def test_scale_from_a_rank_local_collective(sp_pass, caplog):
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)

    def fn(x, w, amaxes):
        local = fc.wait_tensor(fc.reduce_scatter_tensor(amaxes, "max", W, group()))
        return norm_then_quant(x, w, 2688.0 / local)

    gm = trace(fn, [(8, H), (H,), (2,)], state={1: "norm.weight"}, fp32=(2,))
    run(sp_pass, gm)
    assert counts(sp_pass) == {"first.fp4fuse": 1}
    assert_skipped(sp_pass, caplog, "reduce_scatter_tensor reduce_scatter_tensor, whose result is rank-local")


def test_scale_read_from_uninitialized_memory(sp_pass, caplog):
    """A global scale read from ``torch.empty`` holds whatever each rank's allocator handed out: not
    known to be the same on every rank, so its quantization does not move before the gather."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)

    def fn(x, w):
        return norm_then_quant(x, w, torch.empty(1, dtype=torch.float32, device=x.device))

    gm = trace(fn, [(8, H), (H,)], state={1: "norm.weight"})
    run(sp_pass, gm)
    assert counts(sp_pass) == {"first.fp4fuse": 1}
    assert_skipped(sp_pass, caplog, "(empty.memory_format), which is not known to give the same result on every rank")


def test_qkv_quants_each_move_before_their_own_gather(sp_pass):
    """Three linears (q, k, v) quantize one norm output, each with its own static scale (a
    buffer): each quant moves before the gather; the bf16 gather disappears."""
    def fn(x, w, gs_q, gs_k, gs_v):
        r = all_reduce(x)
        n = fp4fuse_norm(r, w)
        return (*fp4.scaled_fp4_quant(n, gs_q), *fp4.scaled_fp4_quant(n, gs_k), *fp4.scaled_fp4_quant(n, gs_v), r)

    state = {1: "norm.weight", 2: "q_proj.input_scale", 3: "k_proj.input_scale", 4: "v_proj.input_scale"}
    gm = trace(fn, [(8, H), (H,), (1,), (1,), (1,)], state=state, fp32=(2, 3, 4))
    run(sp_pass, gm)
    assert counts(sp_pass) == {"first.fp4fuse": 1, "quant_before_gather": 3}
    gathered = [n.meta["val"] for n in gm.graph.find_nodes(op="call_function", target=fc.all_gather_into_tensor.default)]
    assert sorted(tuple(v.shape) for v in gathered) == sorted([(8, H // 2)] * 3 + [(8, H // 16)] * 3 + [(8, H)])
    assert [v.dtype for v in gathered].count(BF16) == 1  # the residual stream only
    (check,) = rank_checks(gm)
    assert len(split_constants(check)[0]) == 4


def read_by_gemms(tensors):
    """Stand-ins for the GEMMs that read quantized activations: copies, so that no quantization output
    is itself a graph output (the CSE pass keeps equal nodes apart where their values reach two
    outputs, which must stay separate buffers)."""
    return tuple(t.float() for t in tensors)


def qkv_norm(x, w, gs_q, gs_k, gs_v):
    """A norm output read by the q, k and v linears, each quantizing it with its scale argument."""
    r = all_reduce(x)
    n = fp4fuse_norm(r, w)
    return (*read_by_gemms(t for gs in (gs_q, gs_k, gs_v) for t in fp4.scaled_fp4_quant(n, gs)), r)


def trace_qkv(scales: str, tokens: int) -> torch.fx.GraphModule:
    """``qkv_norm`` traced with fake CUDA tensors (no GPU needed), so that the pass applies its CUDA
    thresholds: ``own``, three static scales (buffers, one per projection); ``shared``, one
    buffer for all three (a fused q/k/v linear's), which the pass merges into one quantization."""
    with FakeTensorMode():
        args = [torch.empty(shape, dtype=dtype, device="cuda")
                for shape, dtype in [((tokens, H), BF16), ((H,), BF16)] + [((1,), torch.float32)] * 3]
    if scales == "own":
        fn, state = qkv_norm, {1: "norm.weight", 2: "q_proj.input_scale", 3: "k_proj.input_scale",
                               4: "v_proj.input_scale"}
    else:
        def fn(x, w, gs, *_):
            return qkv_norm(x, w, gs, gs, gs)
        state = {1: "norm.weight", 2: "qkv_proj.input_scale"}
    return as_model_state(aot_trace(fn, args), state)


def test_unshared_threshold_rule():
    """Sequence parallelism's threshold for a norm output read by quantizations with scales of their
    own: the GEMM + reduce-scatter's (2048 rows a rank by default) where the collective GEMMs are on,
    at least the 4096 tokens of every SP rewrite; never without them; an explicit min_tokens, and any
    device but CUDA, as for every rewrite."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [sp_unshared_min_tokens(None, True, world, cuda) for world in (2, 4, 8)] == [4096, 8192, 16384]
    assert sp_unshared_min_tokens(None, False, 2, cuda) is None
    assert sp_unshared_min_tokens(None, True, 4, cpu) == sp_unshared_min_tokens(None, False, 4, cpu) == 0
    assert sp_unshared_min_tokens(16, False, 4, cuda) == 16


def test_unshared_quantizations_wait_for_the_gemm_reduce_scatter_on_cuda(monkeypatch, caplog):
    """On CUDA, a norm output quantized with three static scales of their own (q, k, v) is left
    alone below the GEMM + reduce-scatter's threshold, with the reason; the same output quantized
    with one shared scale (one quantization after the rewrite) is rewritten from the usual 4096
    tokens. The reduce-scatter threshold is raised to 10000 rows through its variable so that the
    two thresholds differ at two ranks."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    monkeypatch.setenv("FP4FUSE_OVERLAP_MIN_ROWS", "10000")
    sp = SequenceParallelismPass(FusionConfig(enable_async_tp=True))
    assert_left_alone(sp, trace_qkv("own", 8192), caplog, 1, "token count 8192 is below min_tokens=10000: the norm "
                      "output is quantized with 3 global scales of their own", "first.fp4fuse")
    run(sp, trace_qkv("shared", 8192))
    assert counts(sp) == {"first.fp4fuse": 1, "shared_quantization": 2, "quant_before_gather": 1}
    run(sp, trace_qkv("own", 10000))
    assert counts(sp) == {"first.fp4fuse": 1, "quant_before_gather": 3}
    assert run(sp, trace_qkv("shared", 2048)) == 0
    assert_skipped(sp, caplog, "token count 2048 is below min_tokens=4096", "first.fp4fuse")


def test_unshared_rule_reads_an_hf_middle_norm_through_its_views(monkeypatch, caplog):
    """The form an HF decoder layer gives the pass: 3-D activations, the residual add and fp32 norm
    written in torch ops (``middle.torch_fp32``), its output flattened to rows by each linear before
    the gate and up projections quantize it with static scales of their own."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    monkeypatch.setenv("FP4FUSE_OVERLAP_MIN_ROWS", "10000")

    def fn(x, residual, w, gs_gate, gs_up):
        n, total = torch_fp32_norm(all_reduce(x), w, residual)
        return (*fp4.scaled_fp4_quant(n.reshape(-1, H), gs_gate), *fp4.scaled_fp4_quant(n.reshape(-1, H), gs_up),
                total)

    def traced(tokens):
        with FakeTensorMode():
            args = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in
                    [((1, tokens, H), BF16)] * 2 + [((H,), BF16)] + [((1,), torch.float32)] * 2]
        return as_model_state(aot_trace(fn, args), {2: "norm.weight", 3: "gate_proj.input_scale",
                                                    4: "up_proj.input_scale"})

    # rank_check="always": the residual, a per-call input here, is then verified on every call
    sp = SequenceParallelismPass(FusionConfig(enable_async_tp=True, rank_check="always"))
    assert run(sp, traced(8192)) == 0
    assert_skipped(sp, caplog, "quantized with 2 global scales of their own", "middle.torch_fp32")
    run(sp, traced(10000))
    assert counts(sp) == {"middle.torch_fp32": 1, "quant_before_gather": 2}


def test_unshared_quantizations_without_the_collective_gemms_are_left_alone_on_cuda(caplog):
    """Sequence parallelism alone (no collective GEMMs) never takes a norm output quantized with
    scales of its readers' own on CUDA; one with a shared scale it does; an explicit min_tokens
    overrides both."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True))
    assert run(sp, trace_qkv("own", 16384)) == 0
    assert_skipped(sp, caplog, "the collective GEMMs, with which it pays, are off (enable_async_tp)", "first.fp4fuse")
    run(sp, trace_qkv("shared", 16384))
    assert counts(sp)["first.fp4fuse"] == 1
    forced = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True, min_tokens=0))
    run(forced, trace_qkv("own", 16384))
    assert counts(forced) == {"first.fp4fuse": 1, "quant_before_gather": 3}


def test_unquantized_threshold_rule():
    """Sequence parallelism's threshold for a first or middle norm output that no quantization or
    matmul reads: never on CUDA, 0 elsewhere, an explicit min_tokens wherever it is set; the pass's
    thresholds bundle it with the other two."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert sp_unquantized_min_tokens(None, cuda) is None
    assert sp_unquantized_min_tokens(None, cpu) == 0
    assert sp_unquantized_min_tokens(16, cuda) == sp_unquantized_min_tokens(16, cpu) == 16
    assert sp_thresholds(None, True, 2, cuda) == SPThresholds(4096, 4096, None)
    assert sp_thresholds(None, True, 2, cpu) == SPThresholds(0, 0, 0)


def trace_post_norm(reader: str, tokens: int) -> torch.fx.GraphModule:
    """A sandwich norm (Gemma 2 / 3: the norm on the all-reduced sublayer output, before the
    residual add) traced with fake CUDA tensors, its output read by ``reader``: ``add``, the
    residual add alone; ``quant``, also an NVFP4 quantization (a static scale); ``mm``, a bf16 matmul."""
    def fn(x, residual, w, gs, wt):
        n = torch_offset_fp32_norm(all_reduce(x), w)
        total = residual + n
        if reader == "quant":
            return (*fp4.scaled_fp4_quant(n, gs), total)
        if reader == "mm":
            return n @ wt, total
        return (total,)

    with FakeTensorMode():
        args = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in
                [((tokens, H), BF16)] * 2 + [((H,), BF16), ((1,), torch.float32), ((H, H), BF16)]]
    return as_model_state(aot_trace(fn, args), {2: "layers.0.post_attention_layernorm.weight",
                                                3: "mlp.input_scale", 4: "mlp.weight"})


def test_post_norms_read_by_neither_a_quantization_nor_a_matmul_are_left_alone_on_cuda(caplog):
    """On CUDA a sandwich norm whose output only the residual add reads stays an all-reduce, with the
    reason; read by a quantization or a matmul too, it is rewritten from the usual 4096 tokens; an
    explicit min_tokens rewrites it as well."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True))
    assert_left_alone(sp, trace_post_norm("add", 8192), caplog, 1, "the norm output is read by aten.add.Tensor, "
                      "neither an NVFP4 quantization nor a matmul", "first.torch_offset_fp32")
    for reader in ("quant", "mm"):
        assert run(sp, trace_post_norm(reader, 8192)) >= 1, reader
        assert counts(sp)["first.torch_offset_fp32"] == 1
    forced = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True, min_tokens=0))
    assert run(forced, trace_post_norm("add", 8192)) == 1
    assert counts(forced) == {"first.torch_offset_fp32": 1}


def test_qkv_quants_with_dynamic_scales_share_one_gather(sp_pass):
    """Three linears (q, k, v) quantize one norm output, each with a dynamic scale computed the same
    way (its own NVFP4Quantizer): the pass merges the three into one quantization first
    (``shared_quantization``: two merged away), so one all-reduce MAX, one quantization and one
    gather of codes and scales serve all three readers."""
    quantizers = [NVFP4Quantizer() for _ in range(3)]

    def fn(x, w):
        r = all_reduce(x)
        n = fp4fuse_norm(r, w)
        return (*read_by_gemms(out for q in quantizers for out in q.quantize(n)[:2]), r)

    gm = trace(fn, [(8, H), (H,)], state={1: "norm.weight"})
    run(sp_pass, gm)
    assert counts(sp_pass) == {"first.fp4fuse": 1, "shared_quantization": 2, "quant_before_gather.dynamic_scale": 1}
    gathered = [n.meta["val"] for n in gm.graph.find_nodes(op="call_function", target=fc.all_gather_into_tensor.default)]
    assert sorted(tuple(v.shape) for v in gathered) == sorted([(8, H // 2), (8, H // 16), (8, H)])
    maxes = gm.graph.find_nodes(op="call_function", target=fc.all_reduce.default)
    assert [n.args[1] for n in maxes] == ["max"]
    assert len(gm.graph.find_nodes(op="call_function", target=fp4.scaled_fp4_quant.default)) == 1


def test_unmatched_all_reduce_is_reported(sp_pass, caplog):
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)

    def fn(x):
        return all_reduce(x) * 2
    gm = trace(fn, [(8, H)])
    assert run(sp_pass, gm) == 0
    assert_skipped(sp_pass, caplog, "no sequence-parallel norm pattern starts at this all_reduce (its result is read "
                   "by aten.mul.Tensor)", "unmatched")
    assert not any("leaves this graph" in s.reason for s in sp_pass.skips)


def test_all_reduce_at_the_end_of_a_graph_names_graph_breaks(sp_pass, caplog):
    """A graph that ends at the all-reduce (the model's graph broken after it, the norm in the next
    graph): the skip says so and how to find the break."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    gm = trace(lambda x: all_reduce(x), [(8, H)])
    assert run(sp_pass, gm) == 0
    assert_skipped(sp_pass, caplog, "(its result is read by output)", "unmatched")
    unmatched = [s.reason for s in sp_pass.skips if "unmatched" in s.key]
    assert len(unmatched) == 1 and "its result leaves this graph" in unmatched[0], unmatched
    assert "TORCH_LOGS=graph_breaks" in unmatched[0]


def test_gathered_activation_with_another_reader(sp_pass, caplog):
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)

    def fn(x, w):
        r = all_reduce(x)
        n = fp4fuse_norm(r, w)
        q, s = static_quant(n)
        return q, s, n, r
    gm = trace(fn, [(8, H), (H,)], state={1: "norm.weight"})
    run(sp_pass, gm)
    assert counts(sp_pass) == {"first.fp4fuse": 1}
    assert_skipped(sp_pass, caplog, "quantizing before the gather would need the bf16 gather as well")


def test_group_that_does_not_resolve(caplog):
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True))

    def fn(x, w):
        r = fc.wait_tensor(fc.all_reduce(x, "sum", "no_such_group"))
        return fp4fuse_norm(r, w), r
    gm = trace(fn, [(8, H), (H,)], state={1: "norm.weight"})
    assert run(sp, gm) == 0
    assert_skipped(sp, caplog, "does not resolve in this process", "group")


def test_disabled_config_changes_nothing():
    sp = SequenceParallelismPass(FusionConfig())
    gm = trace(three_layers(fp4fuse_norm), layer_shapes(), state=NORM_WEIGHTS)
    before = str(gm.graph)
    assert run(sp, gm) == 0 and str(gm.graph) == before


# --------------------------------------------------------------------------- symbolic token counts


def symbolic_trace(tokens_hint: int):
    """The three-layer graph with a symbolic token count (one symbol shared by every activation)."""
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x0 = mode.from_tensor(torch.empty(tokens_hint, H, dtype=BF16), symbolic_context=ctx)
    with mode:
        xs = [x0] + [x0.new_empty(x0.shape[0], H) for _ in range(2)]
        ws = [torch.empty(H, dtype=BF16) for _ in range(3)]
    return shape_env, as_model_state(aot_trace(three_layers(fp4fuse_norm), [*xs, *ws]), NORM_WEIGHTS)


def test_symbolic_tokens_get_a_divisibility_guard(sp_pass):
    shape_env, gm = symbolic_trace(tokens_hint=10)
    assert run(sp_pass, gm) == 5
    guards = [str(g.expr) for g in shape_env.guards]
    assert any("Mod(" in g and "2" in g for g in guards), guards


def _admits(shape_env: ShapeEnv, tokens: int) -> bool:
    """Whether ``tokens`` meets every guard installed so far (each guard's own expression)."""
    (symbol,) = {s for g in shape_env.guards for s in g.expr.free_symbols}
    return all(bool(g.expr.subs(symbol, tokens)) for g in shape_env.guards)


def test_symbolic_tokens_with_an_odd_hint_are_left_alone_under_a_guard(sp_pass, caplog):
    """The graph left alone is guarded to odd counts: served first from a warm cache, it must not
    take the even counts that the sharded graph serves."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    shape_env, gm = symbolic_trace(tokens_hint=9)
    assert run(sp_pass, gm) == 0
    assert [_admits(shape_env, t) for t in (7, 9, 11, 8, 10)] == [True] * 3 + [False] * 2
    assert_skipped(sp_pass, caplog, "(hint 9) is not divisible by the group size 2")


def test_symbolic_tokens_with_one_row_per_rank_are_left_alone_under_a_guard(sp_pass, caplog):
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    shape_env, gm = symbolic_trace(tokens_hint=2)
    assert run(sp_pass, gm) == 0
    assert [_admits(shape_env, t) for t in (2, 3, 4, 6)] == [True, True, False, False]
    assert_skipped(sp_pass, caplog, "(hint 2) gives 1 row per rank")


def test_symbolic_tokens_and_min_tokens():
    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True, min_tokens=8))
    shape_env, gm = symbolic_trace(tokens_hint=10)
    assert run(sp, gm) == 5
    guards = [str(g.expr) for g in shape_env.guards]
    assert any(">= 8" in g or "8 <=" in g for g in guards), guards
    shape_env, gm = symbolic_trace(tokens_hint=6)
    assert run(sp, gm) == 0
    assert any("(hint 6) is below min_tokens=8" in s.reason for s in sp.skips)


# --------------------------------------------------------------------------- the real post-grad graphs


class EveryNormForm(torch.nn.Module):
    """Each norm form once as a first and once as a last norm, weights as parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(H, dtype=BF16), requires_grad=False)
                                              for _ in NORMS)

    def forward(self, xs):
        outs = []
        for i, form in enumerate(NORMS.values()):
            r = all_reduce(xs[2 * i])
            q, s, _ = NVFP4Quantizer().quantize(form(r, self.weights[i]))
            n, _ = form(all_reduce(xs[2 * i + 1]), self.weights[i], r)
            outs += [q, s, n]
        return outs


def test_patterns_match_inductor_post_grad_graphs():
    """Compile (fake group) a module holding every norm form; the pass runs inside Inductor and
    reads which graph inputs are parameters from the tracing context. (rank_check off: the fake
    group's collectives return no data, so a run-time check could not pass; tests/e2e run it.)"""
    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True, rank_check="off"))
    seen = []

    def post_grad(graph: torch.fx.Graph) -> None:
        sp(graph)
        seen.append(dict(sp.match_counts))

    xs = [torch.randn(8, H, dtype=BF16) for _ in range(2 * len(NORMS))]
    with torch._inductor.config.patch(post_grad_custom_post_pass=post_grad, fx_graph_cache=False):
        torch._dynamo.reset()
        torch.compile(EveryNormForm(), fullgraph=True)(xs)
    (got,) = seen
    expected = {f"sequence_parallel.{pos}.{form}": 1 for form in NORMS for pos in ("first", "last")}
    expected["sequence_parallel.quant_before_gather.dynamic_scale"] = len(NORMS)
    assert got == expected


class ResidualSources(torch.nn.Module):
    """Three norms after all-reduces, each adding a residual from another place: a buffer, a tensor
    passed in, and a buffer the forward then overwrites (a cache: new data every call)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(H, dtype=BF16), requires_grad=False)
        self.register_buffer("residual", torch.randn(8, H, dtype=BF16))
        self.register_buffer("cache", torch.randn(8, H, dtype=BF16))

    def forward(self, x0, x1, x2, passed):
        a, _ = torch_functional_norm(all_reduce(x0), self.weight, self.residual)
        b, _ = torch_functional_norm(all_reduce(x1), self.weight, passed)
        c, _ = torch_functional_norm(all_reduce(x2), self.weight, self.cache)
        self.cache.copy_(x2)
        return a, b, c


def test_only_parameters_and_unwritten_buffers_are_model_state(caplog):
    """Compiled (fake group), the pass reads which inputs are model state from Dynamo: the buffer
    is; a tensor passed in is not, also when marked with ``torch._dynamo.mark_static_address`` (as
    static KV caches and the input buffers of CUDA-graph serving loops are: AOT autograd lists it
    with the parameters as a static input, but it holds new data every call), and neither is a
    buffer the graph writes. Only the first norm is rewritten. (rank_check off, as in the test
    above: model state is then trusted unchecked and per-call inputs are not.)"""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)
    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True, rank_check="off"))
    seen = []

    def post_grad(graph: torch.fx.Graph) -> None:
        sp(graph)
        seen.append((dict(sp.match_counts), [s.reason for s in sp.skips]))

    xs = [torch.randn(8, H, dtype=BF16) for _ in range(3)]
    passed = torch.randn(8, H, dtype=BF16)
    torch._dynamo.mark_static_address(passed)
    with torch._inductor.config.patch(post_grad_custom_post_pass=post_grad, fx_graph_cache=False):
        torch._dynamo.reset()
        torch.compile(ResidualSources(), fullgraph=True)(*xs, passed)
    ((got, reasons),) = seen
    assert got == {"sequence_parallel.last.torch_functional": 1}
    assert any("(L['passed']), a per-call graph input" in r for r in reasons), reasons
    assert any("(L['self'].cache), a per-call graph input" in r for r in reasons), reasons


# --------------------------------------------------------------------------- bookkeeping


def test_source_files_cover_patterns_and_ops(sp_pass):
    names = {p.rsplit("/", 1)[-1] for p in sp_pass.source_files()}
    assert {"sequence_parallel.py", "quant_before_gather.py", "rank_uniform.py", "sp_ops.py", "norm_ops.py",
            "fp4_ops.py", "rank_check.py"} <= names
    assert SequenceParallelismPass.reads_process_groups


def test_a_used_pass_deep_copies(sp_pass):
    """Inductor deep-copies its config, this pass included, on every torch.compile call: nothing
    of a graph (nodes, fake tensors) may stay on the pass after it ran."""
    run(sp_pass, trace(three_layers(fp4fuse_norm), layer_shapes(), state=NORM_WEIGHTS))
    assert copy.deepcopy(sp_pass).rank_checks == sp_pass.rank_checks


def test_shard_rows_op_contract():
    x = torch.arange(12.0).reshape(6, 2)
    torch.library.opcheck(torch.ops.fp4fuse.shard_rows, (x, group()))
    assert torch.equal(torch.ops.fp4fuse.shard_rows(x, group()), x[:3])  # the fake group's rank is 0
    with pytest.raises(RuntimeError, match="divisible by the group size 2"):
        torch.ops.fp4fuse.shard_rows(torch.zeros(5, 2), group())
    column_major = x.t().contiguous().t()
    out = torch.ops.fp4fuse.shard_rows(column_major, group())
    assert out.is_contiguous() and torch.equal(out, x[:3])  # a fresh row-major tensor, not a view
    out.add_(100.0)
    assert torch.equal(column_major, x)



# --------------------------------------------------------------------------- adversarial review


@pytest.mark.parametrize("position", ["first", "middle"])
def test_a_norm_epsilon_held_in_a_tensor_is_left_alone(sp_pass, caplog, position):
    """``rsqrt(mean(x^2) + eps)`` with a tensor ``eps`` matches the patterns' epsilon wildcard. Each
    rank would compute its rows with its own tensor, and a per-call input may differ across ranks
    (the gathered rows then carry other ranks' epsilons: measured on 2 gloo ranks, 12 of 256 codes
    differed), so the match is left alone with the reason."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)

    def fn(x, residual, w, eps):
        r = all_reduce(x)
        t = r if position == "first" else r + residual
        n = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w
        return static_quant(n)[0], t
    gm = trace(fn, [(8, H), (8, H), (H,), (1,)], state={1: "layer.residual_buffer", 2: "norm.weight"})
    assert run(sp_pass, gm) == 0
    assert reduce_ops(gm) == ["sum"]
    assert_skipped(sp_pass, caplog, "the norm's epsilon is a tensor (arg3_1), not a number", f"{position}.torch_manual")


def test_an_amax_of_the_gathered_rows_in_their_wire_dtype_is_not_the_activation_amax(sp_pass, caplog):
    """A gather sent as a uint8 view and quantized as bf16: an ``amax(abs(.))`` of the uint8 rows
    is a maximum of bytes, not of the activation, so replacing it by the shards' all-reduced
    ``max |x|`` (in bf16) would change the global scale (measured on 2 gloo ranks: every scale and
    a tenth of the codes differed). Only an amax of the rows as quantized is replaced."""
    caplog.set_level(logging.DEBUG, logger=SP_LOGGER)

    def fn(x):
        wire = fc.wait_tensor(fc.all_gather_into_tensor(x.view(torch.uint8), W, group()))
        gs = (448.0 * 6.0 / wire.abs().amax().float()).reshape(1)
        return fp4.scaled_fp4_quant(wire.view(BF16), gs)
    gm = trace(fn, [(4, H)])
    run(sp_pass, gm)
    assert counts(sp_pass) == {}
    assert reduce_ops(gm) == []  # no all-reduce MAX stands in for the byte maximum
    assert_skipped(sp_pass, caplog, "also read by ['abs", "quant_before_gather")
    (quant,) = gm.graph.find_nodes(op="call_function", target=fp4.scaled_fp4_quant.default)
    assert quant.meta["val"][0].shape == (4 * W, H // 2)  # still quantizes the gathered rows
