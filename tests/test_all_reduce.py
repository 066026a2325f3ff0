"""``fp4fuse::all_reduce_sum`` and the all-reduce pass (fp4fuse.passes.all_reduce).

Expected sums never come from a collective: every rank regenerates every rank's seeded input and
adds them in float64 (exact for the values used), rounded once to the dtype. On CPU the op runs
the functional all-reduce on gloo ranks; the ``multigpu`` test runs PyTorch's symmetric-memory
one-shot / two-shot kernels on NCCL ranks and also compares them with NCCL bit for bit. The graph
tests trace on the 2-rank fake process group of conftest.py (nothing runs).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._inductor.pattern_matcher import fwd_only
from torch._subclasses.fake_tensor import FakeTensorMode

import fp4fuse  # noqa: F401  (registers torch.ops.fp4fuse.*)
from dist_utils import run_on_ranks
from fp4fuse.config import FusionConfig
from fp4fuse.distributed.symm_mem import all_reduce as symm_all_reduce
from fp4fuse.distributed.symm_mem import workspace
from fp4fuse.passes.all_reduce import SymmAllReducePass

ops = torch.ops.fp4fuse
KEY = "all_reduce.symm_mem"


# --------------------------------------------------------------------------- the rewrite (fake group)


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _run_pass(fn, *shapes_dtypes) -> tuple[torch.fx.GraphModule, SymmAllReducePass]:
    with FakeTensorMode() as mode:
        inputs = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes_dtypes]
        gm = fwd_only(fn, inputs)
    del mode
    p = SymmAllReducePass(FusionConfig())
    p(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, p


def test_sums_of_two_ranks_become_the_op(fake_group):
    def fn(x, y):
        a = funcol.all_reduce(x * 2, "sum", fake_group)
        b = funcol.all_reduce(y, "sum", fake_group)
        return a + 1, b

    gm, p = _run_pass(fn, ((5, 48), torch.float32), ((3, 4, 16), torch.bfloat16))
    targets = _targets(gm)
    assert p.match_counts == {KEY: 2} and p.skips == []
    assert targets.count("fp4fuse.all_reduce_sum.default") == 2
    assert not any("_c10d_functional" in t for t in targets), targets
    summed = [n for n in gm.graph.nodes if n.target is ops.all_reduce_sum.default]
    assert [tuple(n.meta["val"].shape) for n in summed] == [(5, 48), (3, 4, 16)]
    assert [n.args[1] for n in summed] == [fake_group, fake_group]


def test_what_could_change_bits_stays_nccl_with_the_reason(fake_group):
    one_rank = dist.new_group([0]).group_name

    def fn(x, h):
        return (funcol.all_reduce(x, "max", fake_group),      # not a sum
                funcol.all_reduce(h, "sum", fake_group),      # float16: no symmetric-memory kernel
                funcol.all_reduce(x, "sum", one_rank))        # not two ranks

    gm, p = _run_pass(fn, ((6, 32), torch.float32), ((6, 32), torch.float16))
    assert p.match_counts == {} and "fp4fuse.all_reduce_sum.default" not in _targets(gm)
    reasons = [s.reason for s in p.skips]
    assert [s.key for s in p.skips] == [KEY] * 3
    assert "only sums" in reasons[0] and "torch.float16" in reasons[1] and "1 ranks" in reasons[2], reasons


def test_an_all_reduce_above_the_limit_at_the_compiled_size_stays_functional(fake_group, monkeypatch):
    """Larger than FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES at the size the graph is compiled for: NCCL
    either way, so the graph keeps its own (in-place) all-reduce. At the limit or below, the op
    decides per call; a symbolic size is judged at its example value."""
    monkeypatch.setenv(symm_all_reduce.ENV_MAX_BYTES, "4096")

    def fn(big, at_limit, small):
        return (funcol.all_reduce(big, "sum", fake_group), funcol.all_reduce(at_limit, "sum", fake_group),
                funcol.all_reduce(small, "sum", fake_group))

    gm, p = _run_pass(fn, ((33, 32), torch.float32), ((32, 32), torch.float32), ((5, 48), torch.bfloat16))
    assert p.match_counts == {KEY: 2}
    assert [n.meta["val"].shape[0] for n in gm.graph.nodes if n.target is ops.all_reduce_sum.default] == [32, 5]
    assert [s.key for s in p.skips] == [KEY]
    assert "4224 bytes at the size this graph is compiled for > FP4FUSE_SYMM_ALL_REDUCE_MAX_BYTES=4096" \
        in p.skips[0].reason

    def symbolic(x):
        return funcol.all_reduce(x * 2, "sum", fake_group)

    for rows, rewritten in ((300, False), (31, True)):  # 300 x 32 x 4 bytes above the limit, 31 x 32 x 4 below
        gm = torch.fx.experimental.proxy_tensor.make_fx(symbolic, tracing_mode="symbolic")(torch.ones(rows, 32))
        assert any(isinstance(n.meta.get("val"), torch.Tensor) and not isinstance(n.meta["val"].shape[0], int)
                   for n in gm.graph.nodes)  # the row count is symbolic
        p = SymmAllReducePass(FusionConfig())
        p(gm.graph)
        assert (p.match_counts == {KEY: 1}) == rewritten, (rows, p.skips)
        assert rewritten or "38400 bytes at the size this graph is compiled for" in p.skips[0].reason


def test_unserved_reason_names_the_rule():
    assert symm_all_reduce.unserved_reason(2, torch.bfloat16) is None
    assert symm_all_reduce.unserved_reason(2, torch.float32) is None
    assert "rank order" in symm_all_reduce.unserved_reason(4, torch.bfloat16)
    assert "float16" in symm_all_reduce.unserved_reason(2, torch.float16)


# --------------------------------------------------------------------------- the op on gloo ranks

CPU_CASES = (((7, 33), torch.float32), ((3, 5, 16), torch.float32), ((4, 40), torch.bfloat16), ((0, 8), torch.float32))


def _rank_input(shape, dtype, rank: int, seed: int, integers: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * seed + rank)
    x = torch.randint(-50, 50, shape, generator=g).float() if integers else torch.randn(shape, generator=g) * 3
    return x.to(dtype)


def _expected(shape, dtype, seed: int, integers: bool, device) -> torch.Tensor:
    total = sum(_rank_input(shape, dtype, r, seed, integers).double() for r in range(dist.get_world_size()))
    return total.to(dtype).to(device)


def _cpu_op_cases() -> int:
    group = dist.group.WORLD.group_name
    integers = dist.get_world_size() > 2  # more than two addends: exact in any order
    for seed, (shape, dtype) in enumerate(CPU_CASES):
        x = _rank_input(shape, dtype, dist.get_rank(), seed, integers)
        before = x.clone()
        out = ops.all_reduce_sum(x, group)
        assert torch.equal(out, _expected(shape, dtype, seed, integers, "cpu")), (shape, dtype)
        assert out.is_contiguous() and out.dtype == dtype and torch.equal(x, before)
        assert out.numel() == 0 or out.data_ptr() != x.data_ptr()
    t = _rank_input((16, 9), torch.float32, dist.get_rank(), 50, integers).t()  # non-contiguous input
    assert torch.equal(ops.all_reduce_sum(t, group), _expected((16, 9), torch.float32, 50, integers, "cpu").t())
    # no gradient formula: an input that requires one is refused while autograd records (on every
    # rank, before any collective), and summed under no_grad
    leaf = _rank_input((4, 32), torch.float32, dist.get_rank(), 51, integers).requires_grad_()
    with pytest.raises(RuntimeError, match="all_reduce_sum has no gradient formula, and x requires a gradient"):
        ops.all_reduce_sum(leaf, group)
    with torch.no_grad():
        assert torch.equal(ops.all_reduce_sum(leaf, group), _expected((4, 32), torch.float32, 51, integers, "cpu"))
    return len(CPU_CASES) + 1


@pytest.mark.parametrize("world", [2, 3])
def test_op_is_the_sum_over_the_ranks_on_cpu(world, request):
    if world == 2:  # the spawn shared with the compiled-graph test
        checked = [r["op_cases"] for r in request.getfixturevalue("two_ranks")]
    else:
        checked = run_on_ranks(_cpu_op_cases, world)
    assert checked == [len(CPU_CASES) + 1] * world


def _cpu_compiled() -> dict:
    group = dist.group.WORLD.group_name
    w = _rank_input((24, 40), torch.float32, dist.get_rank(), 7, False)

    def row_parallel(x):
        return funcol.all_reduce(x @ w, "sum", group) * 0.5

    x = _rank_input((6, 24), torch.float32, 0, 8, False)
    fusion = fp4fuse.FusionPass(FusionConfig())
    out = torch.compile(row_parallel, options={"post_grad_custom_post_pass": fusion})(x)
    return {"same_as_eager": torch.equal(out, row_parallel(x)), "counts": dict(fusion.match_counts),
            "training": _cpu_compiled_training(group)}


def _cpu_compiled_training(group: str) -> dict:
    """A training graph: the pass rewrites the forward's all-reduce and the backward's (the gradient
    of a sum all-reduce), and the op, which refuses inputs that require a gradient in eager calls,
    runs inside the compiled autograd function, where nothing records: the output and the weight's
    gradient are eager's."""
    w = _rank_input((24, 40), torch.float32, dist.get_rank(), 9, False).requires_grad_()

    def row_parallel(x):
        return funcol.all_reduce(x @ w, "sum", group) * 0.5

    x = _rank_input((6, 24), torch.float32, 0, 10, False)
    fusion = fp4fuse.FusionPass(FusionConfig())
    out = torch.compile(row_parallel, options={"post_grad_custom_post_pass": fusion})(x)
    out.sum().backward()
    grad, w.grad = w.grad, None
    expected = row_parallel(x)
    expected.sum().backward()
    return {"same_as_eager": torch.equal(out, expected) and torch.equal(grad, w.grad),
            "counts": dict(fusion.match_counts)}


def _two_rank_checks() -> dict:
    return {"op_cases": _cpu_op_cases(), "compiled": _cpu_compiled()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """The two-rank op cases and the compiled graph in one spawn (one process start for both)."""
    return run_on_ranks(_two_rank_checks, 2, timeout=240)


def test_compiled_graph_with_the_pass_matches_eager_on_two_ranks(two_ranks):
    for r in (checks["compiled"] for checks in two_ranks):
        assert r["same_as_eager"] and r["counts"] == {KEY: 1}, r
        assert r["training"]["same_as_eager"] and r["training"]["counts"] == {KEY: 2}, r


# --------------------------------------------------------------------------- symmetric memory on GPUs

GPU_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", workspace.ENV_TIMEOUT_MS: "60000"}
# (shape, dtype): one-shot sizes, two-shot sizes (above 1 MiB), the 16 MiB limit itself, and calls
# that run NCCL: float16, a size that is not a multiple of 16 bytes, a non-contiguous input.
GPU_CASES = (((1, 4096), torch.bfloat16), ((16, 4096), torch.bfloat16), ((300, 4096), torch.bfloat16),
             ((5, 4096), torch.float32), ((3, 7, 64), torch.bfloat16), ((1000, 4096), torch.bfloat16),
             ((2048, 4096), torch.bfloat16), ((16, 4096), torch.float16), ((3, 7), torch.bfloat16))


def _check_gpu_sum(x: torch.Tensor, expected: torch.Tensor, group: str) -> None:
    out = ops.all_reduce_sum(x, group)
    nccl = x.clone(memory_format=torch.contiguous_format)  # NCCL takes contiguous tensors only
    dist.all_reduce(nccl)
    assert torch.equal(out, expected) and torch.equal(out, nccl), (tuple(x.shape), x.dtype)


def _gpu_cases() -> dict:
    rank, group = dist.get_rank(), dist.group.WORLD.group_name
    device = torch.device("cuda", rank)
    for seed, (shape, dtype) in enumerate(GPU_CASES):
        x = _rank_input(shape, dtype, rank, seed, False).to(device)
        _check_gpu_sum(x, _expected(shape, dtype, seed, False, device), group)
    t = _rank_input((64, 4096), torch.bfloat16, rank, 40, False).to(device).t()
    _check_gpu_sum(t, _expected((64, 4096), torch.bfloat16, 40, False, device).t(), group)
    leaf = _rank_input((16, 4096), torch.float32, rank, 41, False).to(device).requires_grad_()
    with pytest.raises(RuntimeError, match="all_reduce_sum has no gradient formula, and x requires a gradient"):
        ops.all_reduce_sum(leaf, group)  # refused on every rank before any collective
    ws = workspace._REGISTRY[(group, rank)][1]
    capacity = ws.capacity  # the 2048 x 4096 bf16 call (16 MiB) went through the workspace
    os.environ[symm_all_reduce.ENV_MAX_BYTES] = "65536"  # the same on both ranks: larger calls run NCCL
    x = _rank_input((300, 4096), torch.bfloat16, rank, 2, False).to(device)
    _check_gpu_sum(x, _expected((300, 4096), torch.bfloat16, 2, False, device), group)
    os.environ.pop(symm_all_reduce.ENV_MAX_BYTES)
    # CUDA graph: a one-shot and a two-shot call captured, replayed on new values
    shapes = ((16, 4096), (700, 4096))
    static = [_rank_input(s, torch.bfloat16, rank, 60 + i, False).to(device) for i, s in enumerate(shapes)]
    for s in static:
        ops.all_reduce_sum(s, group)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [ops.all_reduce_sum(s, group) for s in static]
    replays = 0
    for seed in (70, 80):
        for i, (s, shape) in enumerate(zip(static, shapes)):
            s.copy_(_rank_input(shape, torch.bfloat16, rank, seed + i, False).to(device))
        graph.replay()
        for i, (out, shape) in enumerate(zip(outs, shapes)):
            assert torch.equal(out, _expected(shape, torch.bfloat16, seed + i, False, device)), (seed, shape)
        replays += 1
    torch.cuda.synchronize()
    return {"capacity": capacity, "replays": replays, "two_streams": _two_streams(rank, group, device),
            "other_device": _from_another_current_device(rank, group, device)}


def _from_another_current_device(rank: int, group: str, device: torch.device) -> int:
    """A call made while the current device is the other GPU: the sum is still NCCL's, and the
    current device and each device's current stream are what they were before the call."""
    other = torch.device("cuda", 1 - rank)
    calls = 0
    with torch.cuda.device(other):
        before = (torch.cuda.current_stream(device), torch.cuda.current_stream(other))
        for seed, shape in ((100, (16, 4096)), (101, (700, 4096))):  # one-shot, two-shot
            x = _rank_input(shape, torch.bfloat16, rank, seed, False).to(device)
            _check_gpu_sum(x, _expected(shape, torch.bfloat16, seed, False, device), group)
            calls += 1
        assert torch.cuda.current_device() == other.index
        assert (torch.cuda.current_stream(device), torch.cuda.current_stream(other)) == before
    return calls


def _two_streams(rank: int, group: str, device: torch.device) -> int:
    """Two calls from two streams, each rank delaying a different one on the device: the sums must
    pair the ranks' first calls and their second calls (the host order, as NCCL does), not whichever
    kernels happen to run first on each rank through the one shared buffer."""
    shape = (16, 4096)
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    xs = [_rank_input(shape, torch.bfloat16, rank, 90 + i, False).to(device) for i in range(2)]
    outs = []
    for i, stream in enumerate(streams):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if i == rank:
                torch.cuda._sleep(50_000_000)  # tens of ms: this rank's call on this stream starts late
            outs.append(ops.all_reduce_sum(xs[i], group))
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    for i, out in enumerate(outs):
        assert torch.equal(out, _expected(shape, torch.bfloat16, 90 + i, False, device)), i
    return len(outs)


@pytest.mark.multigpu
def test_symmetric_memory_sum_is_nccls_bit_for_bit_on_two_gpus():
    results = run_on_ranks(_gpu_cases, 2, backend="nccl", timeout=300, env=GPU_ENV, hard_exit=True)
    for r in results:
        assert r["capacity"] >= 2048 * 4096 * 2 and r["replays"] == 2 and r["two_streams"] == 2, r
        assert r["other_device"] == 2, r


def _sum_after_reinitializing(store_path: str) -> dict:
    """A sum through the workspace, then the process group destroyed and initialized again: torch
    numbers group names from a counter, so the new default group may carry the old one's name."""
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    shape = (16, 4096)
    old_name = dist.group.WORLD.group_name
    x = _rank_input(shape, torch.bfloat16, rank, 110, False).to(device)
    _check_gpu_sum(x, _expected(shape, torch.bfloat16, 110, False, device), old_name)
    old = workspace._REGISTRY[(old_name, rank)][1]
    torch.cuda.synchronize()
    dist.destroy_process_group()
    dist.init_process_group("nccl", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    name = dist.group.WORLD.group_name
    x = _rank_input(shape, torch.bfloat16, rank, 111, False).to(device)
    _check_gpu_sum(x, _expected(shape, torch.bfloat16, 111, False, device), name)
    torch.cuda.synchronize()
    return {"same_name": name == old_name, "rebuilt": workspace._REGISTRY[(name, rank)][1] is not old}


@pytest.mark.multigpu
def test_a_group_name_reused_after_reinitialization_gets_a_new_workspace(tmp_path):
    """The workspace built for a destroyed group is not served for the new group of the same name
    (its rank, world size and peer mappings are the old group's)."""
    results = run_on_ranks(_sum_after_reinitializing, 2, str(tmp_path / "store2"), backend="nccl", timeout=120,
                           env=GPU_ENV, hard_exit=True)
    for r in results:
        assert r == {"same_name": True, "rebuilt": True}, r
