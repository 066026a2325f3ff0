"""fp4fuse.patterns.base: the helpers every pass builds on."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch._inductor import pattern_matcher as pm
from torch._inductor.pattern_matcher import fwd_only
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from fp4fuse.patterns.base import (
    CollectiveKind, MatchRecorder, ReplacementPattern, erase_if_unused, fake_value, find_collectives, insert_call,
    token_count_reason,
)

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


def test_token_count_reason_symbolic_needs_a_proof():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC])
    s0 = mode.from_tensor(torch.empty(6), symbolic_context=ctx).shape[0]
    assert isinstance(s0, torch.SymInt)
    assert "dynamic token count" in token_count_reason(s0, 2, 0, require_divisible=True)
    assert token_count_reason(2 * s0, 2, 0, require_divisible=True) is None
    assert "below min_tokens=5" in token_count_reason(2 * s0, 2, 5, require_divisible=True)
    assert token_count_reason(2 * s0, 2, 4, require_divisible=True) is None  # a dynamic size is >= 2


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
