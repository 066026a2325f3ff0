"""fp4fuse.passes.cse: repeated pure computations merged, never across a barrier.

The end-to-end check compiles a block with three NVFP4 linears reading one activation (a Hugging
Face q/k/v projection) with and without FusionPass: one quantization is left, and the outputs are
bitwise equal to the compile without fp4fuse.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import fp4fuse
from fp4fuse.nvfp4.quantizer import NVFP4Quantizer
from fp4fuse.passes.cse import CommonSubexpressionPass, merge_common_subexpressions
from fp4fuse.tp.linear import NVFP4Linear

aten = torch.ops.aten
QUANT = torch.ops.fp4fuse.scaled_fp4_quant.default


def _count(graph: fx.Graph, target) -> int:
    return len(graph.find_nodes(op="call_function", target=target))


class _QKV(torch.nn.Module):
    """Three NVFP4 linears on one input, dynamic activation scales (each quantizes x itself)."""

    def __init__(self, hidden: int, outs: tuple[int, ...]) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.projs = torch.nn.ModuleList(
            NVFP4Linear(torch.randn(n, hidden, generator=gen), NVFP4Quantizer(), torch.float32) for n in outs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(proj(x) for proj in self.projs)


def test_three_linears_on_one_input_quantize_it_once_and_stay_bitwise_equal():
    torch._dynamo.reset()
    block = _QKV(96, (64, 32, 32)).eval()
    x = torch.randn(2, 5, 96) * torch.rand(2, 5, 96).pow(3) * 4
    graphs: list[fx.Graph] = []
    fusion = fp4fuse.FusionPass()
    options = {"post_grad_custom_post_pass": fusion,
               "post_grad_custom_pre_pass": lambda g: graphs.append(g)}
    with torch.no_grad():
        expected = torch.compile(block)(x)
        torch._dynamo.reset()
        got = torch.compile(block, options=options)(x)
    assert _count(graphs[0], QUANT) == 1, "the pass ran after the pre-pass hook, on the same graph"
    assert fusion.match_counts["cse.scaled_fp4_quant"] == 2
    assert fusion.fusion_counts == {}  # merging is not a fusion
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def _graph(fn, *args) -> fx.Graph:
    return make_fx(fn)(*args).graph


def test_equal_pure_nodes_merge_and_their_readers_follow():
    def f(x):
        a, b = x.abs(), x.abs()
        return a + 1, b + 1, (a * 2).sum(), (b * 2).sum()

    graph = _graph(f, torch.randn(4, 3))
    counts = merge_common_subexpressions(graph)
    assert _count(graph, aten.abs.default) == 1 and _count(graph, aten.mul.Tensor) == 1
    assert counts == {"other": 4}  # abs, mul, sum and the second add (read by the output: kept)
    out = graph.find_nodes(op="output")[0].args[0]
    assert out[0] is not out[1], "a graph output keeps its own node"


def test_no_merge_across_a_mutation_or_of_random_ops_or_uninitialized_memory():
    def mutated(x):
        a = x.abs()
        x.add_(1)
        return a, x.abs()

    graph = _graph(mutated, torch.randn(4))
    assert merge_common_subexpressions(graph) == {}
    assert _count(graph, aten.abs.default) == 2

    def random(x):
        return torch.rand_like(x), torch.rand_like(x)

    graph = _graph(random, torch.randn(4))
    assert merge_common_subexpressions(graph) == {}

    def uninitialized(x):
        first, second = torch.empty_like(x), torch.empty_like(x)
        return first.fill_(1), second.fill_(2)

    graph = _graph(uninitialized, torch.randn(4))
    merge_common_subexpressions(graph)
    assert _count(graph, aten.empty_like.default) == 2


def test_collectives_are_barriers_never_merged():
    graph = fx.Graph()
    x = graph.placeholder("x")
    reduce = torch.ops._c10d_functional.all_reduce.default
    first, second = (graph.call_function(reduce, (x, "sum", "0")) for _ in range(2))
    abs_before = graph.call_function(aten.abs.default, (x,))
    graph.output((first, second, abs_before, graph.call_function(reduce, (x, "sum", "0")),
                  graph.call_function(aten.abs.default, (x,))))
    # the two abs are separated by an all_reduce (a barrier); the collectives never merge
    assert merge_common_subexpressions(graph) == {}
    assert _count(graph, reduce) == 3 and _count(graph, aten.abs.default) == 2


def test_float_literals_compare_by_bits():
    """``full(nan)`` twice merges (NaN != NaN by ``==``); ``x * 0.0`` and ``x * -0.0`` do not
    (0.0 == -0.0 by ``==``, but the products' zeros differ in sign)."""
    def f(x):
        return torch.full_like(x, float("nan")) + 1, torch.full_like(x, float("nan")) + 1, x * 0.0, x * -0.0

    graph = _graph(f, torch.randn(3))
    merge_common_subexpressions(graph)
    assert _count(graph, aten.full_like.default) == 1
    assert _count(graph, aten.mul.Tensor) == 2


def _left_alone(f, x: torch.Tensor) -> torch.fx.GraphModule:
    """``f`` traced: merging leaves the graph alone (no count) and its outputs as they were."""
    gm = make_fx(f)(x)
    expected = gm(x)
    assert merge_common_subexpressions(gm.graph) == {}
    gm.recompile()
    got = gm(x)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    return gm


def test_a_graph_that_mutates_an_intermediate_is_left_alone():
    """A merge must not let a reader of one copy see an in-place update of the other. Post-grad
    graphs are functional when the pass runs (Inductor reinplaces later); a graph that mutates an
    intermediate anyway is not rewritten."""
    def f(x):
        a, b = x.abs(), x.abs()
        a.add_(1)
        return a, b * 2

    gm = _left_alone(f, torch.randn(5))
    cse_pass = CommonSubexpressionPass(fp4fuse.FusionConfig())
    assert cse_pass(gm.graph) == 0
    assert [s.key for s in cse_pass.skips] == ["cse.other"]
    assert "writes to an intermediate tensor in place" in cse_pass.skips[0].reason


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_outputs_that_alias_equal_nodes_stay_separate_buffers():
    """Eager returns six separate tensors, each a view or ``getitem`` of one of three pairs of equal
    nodes; after merging, no two outputs may share memory (an in-place update of one would change
    the other)."""
    def f(x, gs):
        a, b = x.abs(), x.abs()
        return (QUANT(x, gs)[0], QUANT(x, gs)[0], a.view(-1), b.view(-1),
                aten._unsafe_view(x.neg(), [-1]), aten._unsafe_view(x.neg(), [-1]))

    args = (torch.randn(4, 32), torch.tensor([7.5]))
    expected = f(*args)
    assert len(_storages(expected)) == len(expected)
    gm = make_fx(f)(*args)
    merge_common_subexpressions(gm.graph)
    gm.recompile()
    got = gm(*args)
    assert len(_storages(got)) == len(got)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))


def test_a_write_through_a_list_argument_is_a_write_to_an_intermediate():
    """``_foreach_mul_`` writes to the tensors of its list argument (``Tensor(a!)[]``): the graph
    writes to an intermediate and is left alone, so the unwritten clone keeps its value."""
    def f(x):
        a, b = x.clone(), x.clone()
        torch._foreach_mul_([a], 2.0)
        return a + 0, b + 0

    _left_alone(f, torch.arange(4.0))


def test_complex_literals_compare_by_the_bits_of_their_parts():
    """``complex(0.0, 0.0) == complex(-0.0, -0.0)``, but ``full`` of each fills different bits.
    (The graph runs in an interpreter: FX's generated code prints ``complex(-0.0, -0.0)`` lossily.)"""
    def f(x):
        return tuple(torch.view_as_real(torch.full((2,), value, dtype=torch.complex64)) * x
                     for value in (complex(0.0, 0.0), complex(-0.0, -0.0), complex(-0.0, -0.0)))

    x = torch.ones(1)
    expected = f(x)
    gm = make_fx(f)(x)
    merge_common_subexpressions(gm.graph)
    assert _count(gm.graph, aten.full.default) == 2  # the two -0.0 fills are equal
    for e, g in zip(expected, fx.Interpreter(gm).run(x)):
        assert torch.equal(e.view(torch.int32), g.view(torch.int32))
