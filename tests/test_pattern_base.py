"""fp4fuse.patterns.base: the helpers every pass builds on."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
import torch.distributed as dist
from torch._inductor import pattern_matcher as pm
from torch._inductor.pattern_matcher import fwd_only
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from fp4fuse.patterns.base import (
    CollectiveKind, MatchRecorder, ReplacementPattern, erase_if_unused, fake_value, find_collectives, hoist_before,
    insert_call, shapes_known_equal, token_count_reason,
)
from fp4fuse.passes.cleanup import read_sizes_from_graph_inputs

fc = torch.ops._c10d_functional
aten = torch.ops.aten


# a 2-rank fake process group (tests/conftest.py): graphs with collectives trace without ranks
pytestmark = pytest.mark.usefixtures("fake_group")


def test_token_count_reason_static():
    assert token_count_reason(8, 2, 0, require_divisible=True) is None
    assert token_count_reason(7, 2, 0, require_divisible=True) == "token count 7 is not divisible by the group size 2"
    assert token_count_reason(7, 2, 0, require_divisible=False) is None
    assert token_count_reason(8, 2, 9, require_divisible=True) == "token count 8 is below min_tokens=9"
    assert token_count_reason(9, 2, 9, require_divisible=False) is None


def _symbolic(hint: int) -> tuple[ShapeEnv, torch.SymInt]:
    env = ShapeEnv()
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC])
    s0 = FakeTensorMode(shape_env=env).from_tensor(torch.empty(hint), symbolic_context=ctx).shape[0]
    assert isinstance(s0, torch.SymInt)
    return env, s0


def test_token_count_reason_symbolic_divisibility_needs_a_proof():
    _, s0 = _symbolic(6)
    assert "dynamic token count" in token_count_reason(s0, 2, 0, require_divisible=True)
    assert token_count_reason(2 * s0, 2, 0, require_divisible=True) is None
    assert token_count_reason(2 * s0, 2, 4, require_divisible=True) is None  # a dynamic size is >= 2


@pytest.mark.parametrize("min_tokens, fires", [(12, True), (13, False)])
def test_symbolic_threshold_is_decided_by_the_hint_and_guarded_on_that_side(min_tokens, fires):
    """2 * s0 with hint 12: the decision follows the hint and a guard pins it, so the shape
    environment then proves the decision for every size the graph serves."""
    env, s0 = _symbolic(6)
    reason = token_count_reason(2 * s0, 2, min_tokens, require_divisible=True)
    assert (reason is None) is fires
    if fires:
        assert statically_known_true(2 * s0 >= min_tokens)
    else:
        assert "below min_tokens=13 (guarded)" in reason
    assert any(str(min_tokens) in str(g.expr) for g in env.guards), f"no guard on {min_tokens}: {env.guards}"


def _collectives(x):
    group = dist.group.WORLD.group_name
    g = fc.wait_tensor(fc.all_gather_into_tensor(x, 2, group))
    r = fc.wait_tensor(fc.reduce_scatter_tensor(g, "sum", 2, group))
    a = fc.all_reduce(r, "max", group)
    return fc.wait_tensor(a), a


def test_find_collectives_decodes_every_kind():
    with FakeTensorMode() as mode:
        gm = fwd_only(_collectives, [mode.from_tensor(torch.empty(4, 8))])
    found = find_collectives(gm.graph)
    assert [c.kind for c in found] == [CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER,
                                       CollectiveKind.ALL_REDUCE]
    ag, rs, ar = found
    assert (ag.group_name, ag.group_size, ag.reduce_op) == ("0", 2, None) and ag.wait is not None
    assert (rs.group_size, rs.reduce_op, rs.input) == (2, "sum", ag.wait)
    assert (ar.group_size, ar.reduce_op) == (None, "max")
    assert ar.wait is None  # read by a wait_tensor and by the graph output
    assert find_collectives(gm.graph, CollectiveKind.REDUCE_SCATTER) == [rs]


def test_insert_call_fills_fake_value_and_erase_if_unused():
    with FakeTensorMode() as mode:
        gm = fwd_only(lambda x: x.sin(), [mode.from_tensor(torch.empty(4, 8))])
    sin = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(sin):
        view = insert_call(gm.graph, aten.view.dtype, (sin, torch.int32))
    assert fake_value(view).dtype == torch.int32 and fake_value(view).shape == (4, 8)
    assert erase_if_unused([view, sin]) == 1 and len(gm.graph.nodes) == 3


def symbolic_view_graph() -> torch.fx.GraphModule:
    """``cos(view(view(sin(x), [x0 * x1]), [n, -1]))`` traced with symbolic sizes and a SymInt input ``n``
    (how Dynamo lifts a dynamic dimension): the inner view's size is a ``sym_size`` read times a size."""
    def f(x, n):
        a = x.sin()
        return a.view(a.shape[0] * a.shape[1]).view(n, -1).cos()
    return make_fx(f, tracing_mode="symbolic")(torch.randn(4, 6), 4)


def calls(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_erase_if_unused_also_takes_the_views_and_size_reads_only_erased_nodes_read():
    gm = symbolic_view_graph()
    (sin,) = gm.graph.find_nodes(op="call_function", target=aten.sin.default)
    (cos,) = gm.graph.find_nodes(op="call_function", target=aten.cos.default)
    outer = cos.args[0]
    cos.replace_input_with(outer, sin)
    # the outer view, then the inner view it read, the size product and the sym_size read it needed
    assert erase_if_unused([outer]) == 4
    assert calls(gm) == [aten.sin.default, aten.cos.default]
    assert [p.name for p in gm.graph.find_nodes(op="placeholder")] == ["x_1", "n_1"]  # inputs stay


def test_read_sizes_from_graph_inputs_frees_the_tensor_a_size_was_read_from():
    gm = symbolic_view_graph()
    graph = gm.graph
    (sin,) = graph.find_nodes(op="call_function", target=aten.sin.default)
    n_input = graph.find_nodes(op="placeholder")[1]
    outer = next(u for u in graph.nodes if u.op == "call_function" and u.target is aten.view.default
                 and n_input in u.args[1])
    with graph.inserting_before(outer):  # read the batch from an intermediate, as a traced replacement does
        read = insert_call(graph, aten.sym_size.int, (sin, 0))
    outer.update_arg(1, [read, -1])
    assert len(sin.users) == 2 and fake_value(read).node.expr == fake_value(n_input).node.expr
    assert read_sizes_from_graph_inputs(graph) == 1
    assert outer.args[1] == [n_input, -1] and len(sin.users) == 1 and read not in graph.nodes


def late_weight_graph() -> torch.fx.GraphModule:
    """``(x.sin() * (w.float() + 1)).cos()`` with ``w``'s computation traced after ``sin``."""
    def f(x, w):
        s = x.sin()
        return (s * (w.float() + 1)).cos()
    return fwd_only(f, [torch.randn(4, 8), torch.randn(8, dtype=torch.bfloat16)])


def test_hoist_before_moves_a_late_pure_computation_with_its_inputs():
    gm = late_weight_graph()
    graph = gm.graph
    (sin,) = graph.find_nodes(op="call_function", target=aten.sin.default)
    (add,) = graph.find_nodes(op="call_function", target=aten.add.Tensor)
    assert hoist_before(add, sin) is None
    order = [n.target for n in graph.nodes if n.op == "call_function"]
    assert order.index(aten.add.Tensor) < order.index(aten.sin.default)
    assert order.index(torch.ops.prims.convert_element_type.default) < order.index(aten.add.Tensor)
    graph.lint()
    gm.recompile()
    x, w = torch.randn(4, 8), torch.randn(8, dtype=torch.bfloat16)
    assert torch.equal(gm(x, w), (x.sin() * (w.float() + 1)).cos())


def test_hoist_before_refuses_to_move_what_the_caller_keeps():
    gm = late_weight_graph()
    graph = gm.graph
    (sin,) = graph.find_nodes(op="call_function", target=aten.sin.default)
    (add,) = graph.find_nodes(op="call_function", target=aten.add.Tensor)
    before = [n.name for n in graph.nodes]
    reason = hoist_before(add, sin, keep_out=[add])
    assert reason is not None and "cannot move" in reason and [n.name for n in graph.nodes] == before


def test_shapes_known_equal_compares_symbolic_sizes_without_guards():
    shape_env = ShapeEnv()
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC])
    x = FakeTensorMode(shape_env=shape_env).from_tensor(torch.empty(4, 6), symbolic_context=ctx)
    (a, b) = x.shape
    assert shapes_known_equal((a, 8), (a, 8)) and shapes_known_equal([a * b], (b * a,))
    assert not shapes_known_equal((a,), (b,)) and not shapes_known_equal((a, 8), (a,))
    assert not shapes_known_equal((a,), (4,))  # equal at the hint only: would need a guard
    assert not shape_env.guards


def test_match_recorder_counts_skips_and_snapshots(caplog):
    caplog.set_level(logging.DEBUG, logger="fp4fuse.test")
    rec = MatchRecorder("p", logging.getLogger("fp4fuse.test"))
    rec.matched("a")
    rec.matched("a", 2)
    rec.skipped("b", None, "why not")
    first = rec.counts
    assert first == {"p.a": 3} and rec.total == 3 and rec.skips[0].key == "p.b"
    assert caplog.records[-1].getMessage() == "fp4fuse: skipped p.b at node ?: why not"
    rec.reset()
    assert rec.counts == {} and rec.skips == [] and first == {"p.a": 3}


class _DoubleBeforeAllReduce(ReplacementPattern):
    """A toy pattern: ``all_reduce(x) * 2`` -> ``all_reduce(x * 2)`` for one group (a constructor
    argument); skips float16."""

    name = "double_before_all_reduce"

    def __init__(self, group_name: str) -> None:
        self.group_name = group_name

    def example_inputs(self):
        return [torch.empty(4, 8)]

    def pattern(self, x):
        return fc.wait_tensor(fc.all_reduce(x, "sum", self.group_name)) * 2

    def replacement(self, x):
        return fc.wait_tensor(fc.all_reduce(x * 2, "sum", self.group_name))

    def check(self, match):
        return "float16 is left alone" if fake_value(match.kwargs["x"]).dtype == torch.float16 else None


def test_replacement_pattern_registers_counts_and_skips(caplog):
    caplog.set_level(logging.DEBUG, logger="fp4fuse.test")
    rec = MatchRecorder("toy", logging.getLogger("fp4fuse.test"))
    pm_pass = pm.PatternMatcherPass(pass_name="toy")
    _DoubleBeforeAllReduce("0").register(pm_pass, rec)

    def fn(x, h):
        return fc.wait_tensor(fc.all_reduce(x, "sum", "0")) * 2, fc.wait_tensor(fc.all_reduce(h, "sum", "0")) * 2

    with FakeTensorMode() as mode:
        inputs = [mode.from_tensor(torch.empty(4, 8)), mode.from_tensor(torch.empty(4, 8, dtype=torch.float16))]
        gm = fwd_only(fn, inputs)
    assert pm_pass.apply(gm.graph) == 1
    assert rec.counts == {"toy.double_before_all_reduce": 1}
    assert [s.reason for s in rec.skips] == ["float16 is left alone"]
    first_reduce = next(n for n in gm.graph.nodes if n.target == fc.all_reduce.default)
    assert first_reduce.args[0].target == aten.mul.Tensor
