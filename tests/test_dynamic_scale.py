"""fp4fuse.passes.dynamic_scale: the dynamic global scale of fp4fuse's quantizer is recognized in the
graphs Inductor hands to post-grad passes, and nothing else is."""
from __future__ import annotations

import math

import pytest
import torch
from torch._inductor.pattern_matcher import fwd_only
from torch._subclasses.fake_tensor import FakeTensorMode

from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.nvfp4.quantizer import NVFP4Quantizer, group_amax
from fp4fuse.passes.dynamic_scale import scale_of_maxima

aten = torch.ops.aten


def _trace(fn, *shapes_dtypes):
    with FakeTensorMode() as mode:
        inputs = [mode.from_tensor(torch.empty(shape, dtype=dtype)) for shape, dtype in shapes_dtypes]
        return fwd_only(fn, inputs)


def _output_nodes(gm) -> list[torch.fx.Node]:
    out = gm.graph.find_nodes(op="output")[0].args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _row_maxima_node(gm) -> torch.fx.Node:
    amaxes = gm.graph.find_nodes(op="call_function", target=aten.amax.default)
    (node,) = [n for n in amaxes if list(n.args[1:2]) == [[-1]]]
    return node


@pytest.mark.parametrize("shape,dtype", [((16, 64), torch.bfloat16), ((5, 48), torch.float16), ((7, 32), torch.float32),
                                         ((2, 3, 64), torch.bfloat16)])
def test_the_quantizers_dynamic_scale_is_recognized(shape, dtype):
    """``NVFP4Quantizer().global_scale_for(x)`` (row maxima, then the scale): the match starts at the
    row maxima and holds every node from their maximum to the scale, its constants included."""
    gm = _trace(lambda x: NVFP4Quantizer().global_scale_for(x), (shape, dtype))
    (gs,) = _output_nodes(gm)
    match = scale_of_maxima(gs)
    assert match is not None
    assert match.maxima is _row_maxima_node(gm)
    inside = set(match.nodes)
    assert gs in inside and match.maxima not in inside
    # everything after the row maxima is the scale's: nothing else is computed from them
    after = [n for n in gm.graph.nodes if n.op == "call_function" and n > match.maxima]
    assert set(after) == inside
    assert sum(n.target is aten.full.default for n in inside) == 3


def test_it_is_recognized_in_the_graph_inductor_passes_on():
    """The same on the post-grad graph of a compiled NVFP4 linear (CPU; what a post-grad pass sees)."""
    seen = []

    def capture(graph: torch.fx.Graph) -> None:
        quant = graph.find_nodes(op="call_function", target=torch.ops.fp4fuse.scaled_fp4_quant.default)
        seen.extend(scale_of_maxima(node.args[1]) for node in quant)

    def linear(x, w):
        q, s, gs = NVFP4Quantizer().quantize(torch.nn.functional.silu(x) * w)
        return q, s, gs

    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=capture, fx_graph_cache=False):
        torch.compile(linear)(torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16))
    assert len(seen) == 1 and seen[0] is not None


def _scale_with(numerator: float):
    def fn(x):
        amax = group_amax(x, None)
        gs = numerator / amax
        gs = torch.where(amax == 0, torch.ones_like(gs), gs)
        return torch.where(torch.isfinite(amax), gs, torch.full_like(gs, math.nan))
    return fn


def test_other_forms_are_not_recognized():
    """Not the quantizer's scale: another numerator, a static scale, a maximum over one dim only, and
    the right form whose intermediate value is also read elsewhere (Inductor would compute it anyway)."""
    x = ((16, 64), torch.bfloat16)
    (gs,) = _output_nodes(_trace(_scale_with(nvfp4.E4M3_MAX * nvfp4.E2M1_MAX), x))
    assert scale_of_maxima(gs) is not None  # the control: this is the quantizer's formula written out
    (gs,) = _output_nodes(_trace(_scale_with(1000.0), x))
    assert scale_of_maxima(gs) is None
    (gs,) = _output_nodes(_trace(lambda t: NVFP4Quantizer(global_scale=3.0).global_scale_for(t), x))
    assert scale_of_maxima(gs) is None
    (gs,) = _output_nodes(_trace(lambda t: nvfp4.global_scale_from_amax(t.abs().amax(dim=0).float()), x))
    assert scale_of_maxima(gs) is None

    def also_reads_amax(t):
        amax = group_amax(t, None)
        return nvfp4.global_scale_from_amax(amax), amax * 2

    gs, _ = _output_nodes(_trace(also_reads_amax, x))
    assert scale_of_maxima(gs) is None


@pytest.mark.parametrize("shape", [(1,), (), (1, 1)])
def test_a_one_element_scale_of_another_shape_is_not_recognized(shape):
    """The quantization launch that takes the scale over writes an fp32 ``[1]`` tensor, which every
    reader of the scale then reads: a 0-d or ``[1, 1]`` scale (one element too, which
    ``scaled_fp4_quant`` accepts) would change the shape of what they compute, a returned scale's
    included. Only ``[1]`` (the quantizer's) is recognized."""
    def fn(x):
        a = x.abs().amax(dim=-1).amax().float().reshape(shape)
        return nvfp4.global_scale_from_amax(torch.where(torch.isnan(a), torch.full_like(a, math.inf), a))

    (gs,) = _output_nodes(_trace(fn, ((16, 64), torch.bfloat16)))
    assert tuple(gs.meta["val"].shape) == shape
    assert (scale_of_maxima(gs) is not None) == (shape == (1,))
