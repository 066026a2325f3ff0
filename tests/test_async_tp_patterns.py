"""AsyncTP patterns on traced graphs, fake process group (world 2): exact match counts, the ops
before and after, and the logged reason for every match left alone."""
from __future__ import annotations

import collections
import logging

import pytest
import torch
import torch.distributed as dist
from torch._inductor.pattern_matcher import fwd_only
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import fp4fuse  # noqa: F401  (registers torch.ops.fp4fuse.*)
from fp4fuse.config import FusionConfig
from fp4fuse.passes.async_tp import AsyncTPPass
from fp4fuse.patterns.async_tp_fp4 import AllGatherMmFp4, MmFp4ReduceScatter

W = 2
K = 64
N = 32
U8, F8, BF16 = torch.uint8, torch.float8_e4m3fn, torch.bfloat16
fc = torch.ops._c10d_functional
fp4 = torch.ops.fp4fuse
aten = torch.ops.aten


# a 2-rank fake process group (tests/conftest.py): graphs with collectives trace without ranks
pytestmark = pytest.mark.usefixtures("fake_group")


def group() -> str:
    return dist.group.WORLD.group_name


# --------------------------------------------------------------------------- graph building


def gather(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """All-gather along ``dim`` as funcol writes it: gather rows, then move them to ``dim``."""
    rows = fc.wait_tensor(fc.all_gather_into_tensor(x, W, group()))
    return rows if dim == 0 else torch.cat(torch.chunk(rows, W, dim=0), dim=dim)


def gather_scales(s: torch.Tensor, wire_uint8: bool = True) -> torch.Tensor:
    """Scales as gloo sends them (uint8 view and back), or directly in float8."""
    if wire_uint8:
        return gather(s.view(U8)).view(F8)
    return gather(s)


def reduce_scatter(x: torch.Tensor, op: str = "sum", dim: int = 0) -> torch.Tensor:
    """Reduce-scatter along ``dim`` as funcol writes it: move ``dim``'s chunks to rows first."""
    if dim != 0:
        x = torch.cat(torch.chunk(x, W, dim=dim))
    return fc.wait_tensor(fc.reduce_scatter_tensor(x, op, W, group()))


def mm_fp4(q, s, b, bs, alpha):
    return fp4.mm_fp4(q, b, s, bs, alpha, BF16)


def fp4_inputs(mode: FakeTensorMode, rows: int, weights: int = 1, device: str = "cpu") -> list[torch.Tensor]:
    with mode:
        out = [torch.empty(rows, K // 2, dtype=U8, device=device), torch.empty(rows, K // 16, dtype=F8, device=device)]
        for _ in range(weights):
            out += [torch.empty(N, K // 2, dtype=U8, device=device), torch.empty(N, K // 16, dtype=F8, device=device)]
        out.append(torch.empty(1, device=device))
    return out


def trace(fn, inputs: list[torch.Tensor], mode: FakeTensorMode) -> torch.fx.GraphModule:
    """A post-grad-like graph (make_fx + Inductor's decompositions + no-op removal), fake values."""
    with mode:
        return fwd_only(fn, inputs)


def ops(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target).replace("torch.ops.", "").replace(".default", "")
                               for n in gm.graph.nodes if n.op == "call_function")


def run_pass(gm: torch.fx.GraphModule, **cfg) -> AsyncTPPass:
    p = AsyncTPPass(FusionConfig(enable_async_tp=True, **cfg))
    p(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return p


@pytest.fixture
def debug_log(caplog):
    caplog.set_level(logging.DEBUG, logger="fp4fuse")
    return caplog


def assert_skipped(p: AsyncTPPass, caplog, key: str, *fragments: str) -> None:
    assert p.match_counts == {}
    assert [s.key for s in p.skips] == [key]
    for fragment in fragments:
        assert fragment in p.skips[0].reason
        assert any(fragment in r.getMessage() and r.levelno == logging.DEBUG and r.name == "fp4fuse.passes.async_tp"
                   for r in caplog.records)


# --------------------------------------------------------------------------- all-gather + mm_fp4


@pytest.mark.parametrize("wire_uint8", [True, False], ids=["scales_as_uint8", "scales_as_fp8"])
def test_all_gather_mm_fp4(wire_uint8):
    mode = FakeTensorMode()
    q, s, b, bs, alpha = fp4_inputs(mode, rows=8)

    def fn(q, s, b, bs, alpha):
        return mm_fp4(gather(q), gather_scales(s, wire_uint8), b, bs, alpha)

    gm = trace(fn, [q, s, b, bs, alpha], mode)
    before = ops(gm)
    assert before["_c10d_functional.all_gather_into_tensor"] == 2 and before["fp4fuse.mm_fp4"] == 1
    assert before["aten.view.dtype"] == (2 if wire_uint8 else 0)
    p = run_pass(gm)
    assert p.match_counts == {"async_tp.all_gather_mm_fp4": 1} and p.skips == []
    assert ops(gm) == {"fp4fuse.fused_all_gather_fp4_matmul": 1}
    fused = next(n for n in gm.graph.nodes if n.op == "call_function")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert fused.args == (*placeholders[:2], *placeholders[2:5], BF16, group())
    assert fused.meta["val"].shape == (8 * W, N) and fused.meta["val"].dtype == BF16


def test_two_mm_fp4_readers_use_the_gathered_companion():
    """q/k/v-style: two GEMMs of one gathered activation. Match count = 1 per gathered pair; the
    first GEMM is fused, the second reads the gathered codes/scales the fused op returns."""
    mode = FakeTensorMode()
    q, s, b1, bs1, b2, bs2, alpha = fp4_inputs(mode, rows=8, weights=2)

    def fn(q, s, b1, bs1, b2, bs2, alpha):
        qa, sa = gather(q), gather_scales(s)
        return mm_fp4(qa, sa, b1, bs1, alpha), mm_fp4(qa, sa, b2, bs2, alpha)

    gm = trace(fn, [q, s, b1, bs1, b2, bs2, alpha], mode)
    p = run_pass(gm)
    assert p.match_counts == {"async_tp.all_gather_mm_fp4_gathered": 1}
    assert ops(gm) == {"fp4fuse.fused_all_gather_fp4_matmul_gathered": 1, "<built-in function getitem>": 3,
                       "fp4fuse.mm_fp4": 1}
    fused = next(n for n in gm.graph.nodes if n.target == fp4.fused_all_gather_fp4_matmul_gathered.default)
    second = next(n for n in gm.graph.nodes if n.target == fp4.mm_fp4.default)
    assert [a.args for a in (second.args[0], second.args[2])] == [(fused, 1), (fused, 2)]
    assert second.args[0].meta["val"].shape == (8 * W, K // 2) and second.args[2].meta["val"].dtype == F8


def test_gathered_scales_read_as_uint8_elsewhere_get_a_view():
    mode = FakeTensorMode()
    q, s, b, bs, alpha = fp4_inputs(mode, rows=8)

    def fn(q, s, b, bs, alpha):
        s_wire = gather(s.view(U8))
        return mm_fp4(gather(q), s_wire.view(F8), b, bs, alpha), s_wire

    gm = trace(fn, [q, s, b, bs, alpha], mode)
    p = run_pass(gm)
    assert p.match_counts == {"async_tp.all_gather_mm_fp4_gathered": 1}
    assert ops(gm)["_c10d_functional.all_gather_into_tensor"] == 0
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][1]
    assert out.target == aten.view.dtype and out.args[1] == U8 and out.meta["val"].shape == (8 * W, K // 16)


def test_all_gather_along_dim1_left_alone(debug_log):
    mode = FakeTensorMode()
    q, s, b, bs, alpha = fp4_inputs(mode, rows=16)
    with mode:
        q_half = torch.empty(16, K // 4, dtype=U8)

    def fn(q_half, s, b, bs, alpha):
        return mm_fp4(gather(q_half, dim=1), s, b, bs, alpha)

    gm = trace(fn, [q_half, s, b, bs, alpha], mode)
    before = ops(gm)
    assert before["aten.cat"] == 1
    p = run_pass(gm)
    assert ops(gm) == before
    assert_skipped(p, debug_log, "async_tp.all_gather_mm_fp4", "a_scale is not")


def test_all_gather_both_along_dim1_left_alone(debug_log):
    mode = FakeTensorMode()
    _, _, b, bs, alpha = fp4_inputs(mode, rows=16)
    with mode:
        q_half, s_half = torch.empty(16, K // 4, dtype=U8), torch.empty(16, K // 32, dtype=F8)

    def fn(q_half, s_half, b, bs, alpha):
        s_full = gather(s_half.view(U8), dim=1).view(F8)
        return mm_fp4(gather(q_half, dim=1), s_full, b, bs, alpha)

    gm = trace(fn, [q_half, s_half, b, bs, alpha], mode)
    before = ops(gm)
    p = run_pass(gm)
    assert ops(gm) == before
    assert_skipped(p, debug_log, "async_tp.all_gather_mm_fp4", "along dim 1", "gathers along dim 0")


def test_all_gather_below_min_tokens_left_alone(debug_log):
    mode = FakeTensorMode()
    inputs = fp4_inputs(mode, rows=8)

    def fn(q, s, b, bs, alpha):
        return mm_fp4(gather(q), gather_scales(s), b, bs, alpha)

    gm = trace(fn, inputs, mode)
    before = ops(gm)
    p = run_pass(gm, min_tokens=17)
    assert ops(gm) == before
    assert_skipped(p, debug_log, "async_tp.all_gather_mm_fp4", "token count 16 is below min_tokens=17")
    gm = trace(fn, inputs, mode)
    assert run_pass(gm, min_tokens=16).match_counts == {"async_tp.all_gather_mm_fp4": 1}


# --------------------------------------------------------------------------- mm_fp4 + reduce-scatter


def test_mm_fp4_reduce_scatter():
    mode = FakeTensorMode()
    inputs = fp4_inputs(mode, rows=8)

    def fn(q, s, b, bs, alpha):
        return reduce_scatter(mm_fp4(q, s, b, bs, alpha))

    gm = trace(fn, inputs, mode)
    assert ops(gm) == {"fp4fuse.mm_fp4": 1, "_c10d_functional.reduce_scatter_tensor": 1,
                       "_c10d_functional.wait_tensor": 1}
    p = run_pass(gm)
    assert p.match_counts == {"async_tp.mm_fp4_reduce_scatter": 1}
    assert ops(gm) == {"fp4fuse.fused_fp4_matmul_reduce_scatter": 1}
    fused = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert fused.args[5:] == (BF16, group()) and fused.meta["val"].shape == (8 // W, N)


def test_layer_counts():
    """A TP MLP block: gathered input -> column-parallel GEMM -> row-parallel GEMM -> reduce-scatter.
    Counts: one all-gather fusion per gathered activation, one reduce-scatter fusion per scattered
    GEMM; for L such blocks 2L rewrites."""
    mode = FakeTensorMode()
    q, s, b1, bs1, b2, bs2, alpha = fp4_inputs(mode, rows=8, weights=2)
    with mode:
        gs = torch.empty(1)

    def block(q, s, b1, bs1, b2, bs2, alpha, gs):
        h = mm_fp4(gather(q), gather_scales(s), b1, bs1, alpha)
        hq, hs = fp4.scaled_fp4_quant(h[:, :K].contiguous(), gs)
        return reduce_scatter(mm_fp4(hq, hs, b2, bs2, alpha))

    def fn(q, s, b1, bs1, b2, bs2, alpha, gs):
        y = block(q, s, b1, bs1, b2, bs2, alpha, gs)
        yq, ys = fp4.scaled_fp4_quant(y[:, :K].contiguous(), gs)
        return block(yq, ys, b1, bs1, b2, bs2, alpha, gs)

    with mode:
        b1 = torch.empty(2 * K, K // 2, dtype=U8)
        bs1 = torch.empty(2 * K, K // 16, dtype=F8)
        b2 = torch.empty(2 * K, K // 2, dtype=U8)
        bs2 = torch.empty(2 * K, K // 16, dtype=F8)
    gm = trace(fn, [q, s, b1, bs1, b2, bs2, alpha, gs], mode)
    p = run_pass(gm)
    assert p.match_counts == {"async_tp.all_gather_mm_fp4": 2, "async_tp.mm_fp4_reduce_scatter": 2}
    after = ops(gm)
    assert after["fp4fuse.mm_fp4"] == 0 and after["_c10d_functional.wait_tensor"] == 0


def test_indivisible_tokens_left_alone(debug_log):
    mode = FakeTensorMode()
    inputs = fp4_inputs(mode, rows=7)

    def fn(q, s, b, bs, alpha):
        return reduce_scatter(mm_fp4(q, s, b, bs, alpha))

    gm = trace(fn, inputs, mode)
    before = ops(gm)
    p = run_pass(gm)
    assert ops(gm) == before
    assert_skipped(p, debug_log, "async_tp.mm_fp4_reduce_scatter", "token count 7 is not divisible by the group size 2")


def test_reduce_scatter_along_dim1_left_alone(debug_log):
    mode = FakeTensorMode()
    inputs = fp4_inputs(mode, rows=8)

    def fn(q, s, b, bs, alpha):
        return reduce_scatter(mm_fp4(q, s, b, bs, alpha), dim=1)

    gm = trace(fn, inputs, mode)
    before = ops(gm)
    assert before["aten.split.Tensor"] == 1 and before["aten.cat"] == 1
    p = run_pass(gm)
    assert ops(gm) == before
    assert_skipped(p, debug_log, "async_tp.mm_fp4_reduce_scatter", "along dim 1", "scatters along dim 0")


@pytest.mark.parametrize("variant", ["other_reader", "max"])
def test_reduce_scatter_other_reader_or_op_left_alone(debug_log, variant):
    mode = FakeTensorMode()
    inputs = fp4_inputs(mode, rows=8)

    def fn(q, s, b, bs, alpha):
        p = mm_fp4(q, s, b, bs, alpha)
        if variant == "max":
            return reduce_scatter(p, op="max")
        return reduce_scatter(p), p

    gm = trace(fn, inputs, mode)
    before = ops(gm)
    p = run_pass(gm)
    assert ops(gm) == before
    reason = "other readers" if variant == "other_reader" else "reduce op is 'max'"
    assert_skipped(p, debug_log, "async_tp.mm_fp4_reduce_scatter", reason)


def _symbolic(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    return mode.from_tensor(t, symbolic_context=ctx)


def test_dynamic_tokens(debug_log):
    """A symbolic token count fires only where the shape env proves divisibility: rows 2*s0 yes,
    rows s0 no (left alone with the reason). The all-gather side always divides."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    q = _symbolic(mode, torch.zeros(8, K // 2, dtype=U8))
    s = _symbolic(mode, torch.zeros(8, K // 16, dtype=F8))
    _, _, b, bs, alpha = fp4_inputs(mode, rows=1)

    def unproven(q, s, b, bs, alpha):
        return reduce_scatter(mm_fp4(q, s, b, bs, alpha))

    def doubled(q, s, b, bs, alpha):
        q2, s2 = torch.cat([q, q]), torch.cat([s.view(U8), s.view(U8)]).view(F8)
        return reduce_scatter(mm_fp4(q2, s2, b, bs, alpha)), mm_fp4(gather(q), gather_scales(s), b, bs, alpha)

    gm = trace(unproven, [q, s, b, bs, alpha], mode)
    p = run_pass(gm)
    assert_skipped(p, debug_log, "async_tp.mm_fp4_reduce_scatter", "dynamic token count", "not proven")
    gm = trace(doubled, [q, s, b, bs, alpha], mode)
    p = run_pass(gm)
    assert p.match_counts == {"async_tp.mm_fp4_reduce_scatter": 1, "async_tp.all_gather_mm_fp4": 1}


def test_find_is_pure():
    mode = FakeTensorMode()
    inputs = fp4_inputs(mode, rows=8)

    def fn(q, s, b, bs, alpha):
        y = mm_fp4(gather(q), gather_scales(s), b, bs, alpha)
        return reduce_scatter(mm_fp4(q, s, b, bs, alpha)), y

    gm = trace(fn, inputs, mode)
    code = gm.code
    cfg = FusionConfig(enable_async_tp=True)
    (ag,) = AllGatherMmFp4(cfg).find(gm.graph)
    (rs,) = MmFp4ReduceScatter(cfg).find(gm.graph)
    assert ag.data.gather_dim == 0 and ag.scale.collective.group_size == W and len(ag.mms) == 1
    assert rs.scatter.scatter_dim == 0 and rs.scatter.collective.reduce_op == "sum"
    gm.recompile()
    assert gm.code == code


# --------------------------------------------------------------------------- bf16 -> symm_mem


def _bf16_fn(a_shard, b1, b2, a_full, b3):
    gathered = gather(a_shard)
    return aten.mm(gathered, b1), aten.mm(gathered, b2), reduce_scatter(aten.mm(a_full, b3))


def _bf16_inputs(mode: FakeTensorMode, device: str) -> list[torch.Tensor]:
    with mode:
        return [torch.empty(8, K, dtype=BF16, device=device), torch.empty(K, N, dtype=BF16, device=device),
                torch.empty(K, N, dtype=BF16, device=device), torch.empty(16, K, dtype=BF16, device=device),
                torch.empty(K, N, dtype=BF16, device=device)]


def test_bf16_on_cpu_left_alone_with_reason(debug_log):
    mode = FakeTensorMode()
    gm = trace(_bf16_fn, _bf16_inputs(mode, "cpu"), mode)
    before = ops(gm)
    p = run_pass(gm, enable_bf16_async_tp=True)
    assert ops(gm) == before and p.match_counts == {}
    assert sorted(s.key for s in p.skips) == ["async_tp.all_gather_mm", "async_tp.mm_reduce_scatter"]
    assert all("no kernel for device cpu" in s.reason for s in p.skips)


def test_bf16_off_by_default():
    mode = FakeTensorMode()
    gm = trace(_bf16_fn, _bf16_inputs(mode, "cpu"), mode)
    p = run_pass(gm)
    assert p.match_counts == {} and p.skips == []


def test_bf16_on_cuda_graph_rewritten():
    """Structure only (fake CUDA tensors; nothing runs): both GEMMs of one gather become one
    fused_all_gather_matmul with two weights; mm + reduce-scatter becomes fused_matmul_reduce_scatter."""
    mode = FakeTensorMode()
    gm = trace(_bf16_fn, _bf16_inputs(mode, "cuda"), mode)
    p = run_pass(gm, enable_bf16_async_tp=True)
    assert p.match_counts == {"async_tp.all_gather_mm": 1, "async_tp.mm_reduce_scatter": 1}
    after = ops(gm)
    assert after["symm_mem.fused_all_gather_matmul"] == 1 and after["symm_mem.fused_matmul_reduce_scatter"] == 1
    assert after["aten.mm"] == 0 and after["_c10d_functional.wait_tensor"] == 0
    ag = next(n for n in gm.graph.nodes if n.target == torch.ops.symm_mem.fused_all_gather_matmul.default)
    assert len(ag.args[1]) == 2 and ag.args[2:] == (0, group()) and ag.kwargs == {"return_A": False}
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [o.meta["val"].shape for o in outputs] == [(16, N), (16, N), (8, N)]


def test_gather_paired_with_two_scale_gathers_left_alone(debug_log):
    """Overlapping matches (one gathered a, two different gathered scales) are all skipped."""
    mode = FakeTensorMode()
    q, s, b, bs, alpha = fp4_inputs(mode, rows=8)
    with mode:
        s2 = torch.empty_like(s)

    def fn(q, s, s2, b, bs, alpha):
        qa = gather(q)
        return mm_fp4(qa, gather_scales(s), b, bs, alpha), mm_fp4(qa, gather_scales(s2), b, bs, alpha)

    gm = trace(fn, [q, s, s2, b, bs, alpha], mode)
    before = ops(gm)
    p = run_pass(gm)
    assert ops(gm) == before and p.match_counts == {}
    assert [s.key for s in p.skips] == ["async_tp.all_gather_mm_fp4"] * 2
    assert all("pairs it with a different gather" in s.reason for s in p.skips)


# --------------------------------------------------------------------------- adversarial review


def test_scale_shard_computed_from_a_reader_of_the_gathered_codes_left_alone(debug_log):
    """The fused op goes before the first reader of either gathered tensor and reads both shards;
    a scale shard computed from such a reader of the gathered codes can only come after it (the
    rewrite would read it before it is computed: a cycle no topological sort fixes)."""
    mode = FakeTensorMode()
    q, s, b, bs, alpha = fp4_inputs(mode, rows=8)

    def fn(q, s, b, bs, alpha):
        qa = gather(q)
        offset = qa[:1, :1].to(torch.int32).sum().to(U8) * 0
        s2 = (s.view(U8) + offset).view(F8)
        return mm_fp4(qa, gather_scales(s2), b, bs, alpha)

    gm = trace(fn, [q, s, b, bs, alpha], mode)
    before = ops(gm)
    p = run_pass(gm)  # lints the graph
    assert ops(gm) == before
    assert_skipped(p, debug_log, "async_tp.all_gather_mm_fp4", "the shard of a_scale is computed after")


def test_bf16_gather_of_a_dtype_view_left_alone():
    """``all_gather(shard.view(bf16))`` read by an ``mm``: symm_mem gathers the shard as it is, in
    its own dtype, which would change the product's dtype (fp16 here) and multiply fp16 rows by a
    bf16 weight. Structure only (fake CUDA tensors)."""
    mode = FakeTensorMode()
    with mode:
        inputs = [torch.empty(8, K, dtype=torch.float16, device="cuda"),
                  torch.empty(K, N, dtype=BF16, device="cuda")]

    def fn(a_shard, b):
        return aten.mm(gather(a_shard.view(BF16)), b)

    gm = trace(fn, inputs, mode)
    before = ops(gm)
    p = run_pass(gm, enable_bf16_async_tp=True)
    assert ops(gm) == before and p.match_counts == {}
    assert [s.key for s in p.skips] == ["async_tp.all_gather_mm"]
    assert "sent in another dtype" in p.skips[0].reason
    (output,) = torch.utils._pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args)
    assert output.meta["val"].dtype == BF16
