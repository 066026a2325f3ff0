"""fp4fuse.nvfp4.quantizer: the amax-group registry and NVFP4Quantizer, single-process and on 2 gloo ranks."""
from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch.distributed as dist

import fp4fuse  # noqa: F401  (registers torch.ops.fp4fuse.*)
from dist_utils import run_on_ranks
from fp4fuse.nvfp4.quantizer import (
    AmaxGroup,
    NVFP4Quantizer,
    UnknownAmaxGroupError,
    abs_amax,
    amax_group,
    amax_group_id,
    register_amax_group,
)
from fp4fuse.nvfp4.format import global_scale_from_amax, quantize_reference

WORLD = 2
SHAPE = (32, 64)
TIMEOUT_S = 120.0


def _rank_data(rank: int) -> torch.Tensor:
    """Deterministic per-rank activations; rank 1 is 3x larger, so it holds the global amax."""
    gen = torch.Generator().manual_seed(1234 + rank)
    return (torch.randn(SHAPE, generator=gen) * (1 + 2 * rank)).to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same_bits(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def _expected(x: torch.Tensor, amax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gs = global_scale_from_amax(torch.tensor([amax], dtype=torch.float32))
    q, s = quantize_reference(x, gs)
    return q, s, gs


class _GraphRecorder:
    """Inductor post-grad pass that records the op targets of every graph it sees.

    A plain callable (not a CustomGraphPass), so Inductor bypasses the FX graph cache and the
    pass runs on every compile."""

    def __init__(self) -> None:
        self.graphs: list[list[str]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append([str(n.target) for n in graph.nodes if n.op == "call_function"])


# ---------------------------------------------------------------- value object, single process

def test_group_id_is_a_stable_positive_int63():
    gid = amax_group_id([0, 1])
    assert isinstance(gid, int) and 1 <= gid < 2**63
    assert amax_group_id((1, 0, 1)) == gid
    assert amax_group_id(range(2)) != amax_group_id([0]) != amax_group_id([1])
    # Pinned: the ID must not change between processes, Python versions or fp4fuse releases, or
    # pickled quantizers stop resolving.
    assert gid == 4823758393514785604
    with pytest.raises(ValueError):
        amax_group_id([])


def test_quantizer_is_a_value_object():
    a, b = NVFP4Quantizer(amax_group=7), NVFP4Quantizer(amax_group=7)
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != NVFP4Quantizer(amax_group=8) and a != NVFP4Quantizer()
    assert len({a, b, NVFP4Quantizer(), NVFP4Quantizer(global_scale=2.0)}) == 3
    assert copy.deepcopy(a) == a and copy.copy(a) == a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.amax_group = 8  # type: ignore[misc]
    static = NVFP4Quantizer(global_scale=2)
    assert type(static.global_scale) is float and static == NVFP4Quantizer(global_scale=2.0)
    assert pickle.loads(pickle.dumps(static)) == static


@pytest.mark.parametrize("kwargs, error", [
    ({"amax_group": "tp"}, TypeError),
    ({"amax_group": True}, TypeError),
    ({"amax_group": 0}, ValueError),
    ({"amax_group": 2**63}, ValueError),
    ({"global_scale": 0.0}, ValueError),
    ({"global_scale": -1.0}, ValueError),
    ({"global_scale": float("inf")}, ValueError),
    ({"global_scale": float("nan")}, ValueError),
    ({"global_scale": torch.tensor(1.0)}, TypeError),
    ({"global_scale": 1e39}, ValueError),   # finite as a Python float, inf as the fp32 quantize uses
    ({"global_scale": 1e-46}, ValueError),  # flushes to 0 in fp32
    ({"amax_group": 7, "global_scale": 1.0}, ValueError),
])
def test_quantizer_rejects_bad_fields(kwargs, error):
    with pytest.raises(error):
        NVFP4Quantizer(**kwargs)


def test_unknown_id_is_a_clear_error():
    with pytest.raises(UnknownAmaxGroupError, match=r"amax group 12345 .*fp4fuse\.register_amax_group\(group\)"):
        amax_group(12345)
    with pytest.raises(KeyError):
        NVFP4Quantizer(amax_group=12345).quantize(_rank_data(0))
    assert issubclass(UnknownAmaxGroupError, LookupError)


def test_unknown_id_under_compile_names_the_id():
    f = torch.compile(lambda x, q: q.quantize(x), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"amax group 12345 is not registered"):
        f(_rank_data(0), NVFP4Quantizer(amax_group=12345))


@pytest.mark.skipif(dist.is_initialized(), reason="needs an uninitialized torch.distributed")
def test_register_needs_init_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        register_amax_group()


def test_local_quantize_matches_reference_and_compiles():
    x = _rank_data(1)
    dynamic, static = NVFP4Quantizer(), NVFP4Quantizer(global_scale=100.0)
    eager_dyn, eager_static = dynamic.quantize(x), static.quantize(x)
    assert _same_bits(eager_dyn, _expected(x, x.float().abs().max().item()))
    assert eager_static[2].dtype == torch.float32 and eager_static[2].shape == (1,)
    assert _same_bits(eager_static, (*quantize_reference(x, torch.tensor([100.0])), torch.tensor([100.0])))

    compiled = torch.compile(lambda t: (dynamic.quantize(t), static.quantize(t)), fullgraph=True)
    got_dyn, got_static = compiled(x)
    assert _same_bits(got_dyn, eager_dyn) and _same_bits(got_static, eager_static)


@pytest.mark.parametrize("shape", [(37,), (5, 48), (3, 7, 32), (2, 3, 4, 16)])
def test_abs_amax_is_the_largest_magnitude(shape):
    """``abs_amax`` (row maxima first) is the largest |x| over every element, in x's dtype, for
    1-D to 4-D tensors, eager and compiled; NaN anywhere gives NaN, -inf gives inf."""
    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).pow(8) * 1e3).to(torch.bfloat16)
    want = x.double().abs().flatten().max()
    compiled = torch.compile(abs_amax, fullgraph=True)
    for fn in (abs_amax, compiled):
        got = fn(x)
        assert got.dtype == torch.bfloat16 and got.dim() == 0 and got.double() == want
        y = x.clone()
        y.view(-1)[len(y.view(-1)) // 2] = float("-inf")
        assert fn(y).item() == float("inf")
        y.view(-1)[-1] = float("nan")
        assert torch.isnan(fn(y))


def test_empty_input_quantizes_with_unit_scale():
    q, s, gs = NVFP4Quantizer().quantize(torch.empty(0, 64, dtype=torch.bfloat16))
    assert q.shape == (0, 32) and s.shape == (0, 4) and torch.equal(gs, torch.ones(1))


def test_nan_input_gives_nan_global_scale():
    x = _rank_data(0)
    x[3, 5] = float("nan")
    assert torch.isnan(NVFP4Quantizer().quantize(x)[2]).all()


# ---------------------------------------------------------------- 2 gloo ranks

def _quantize_on_rank(store_path: str) -> dict:
    """Rank body: register the world group, quantize eager and compiled, pickle the quantizer; last,
    the process group destroyed and initialized again (``store_path``: the new rendezvous)."""
    rank = dist.get_rank()
    gid = register_amax_group()
    record = amax_group(gid)
    assert register_amax_group(dist.group.WORLD) == gid and amax_group(gid) is record, "not idempotent"
    quantizer = NVFP4Quantizer(amax_group=gid)
    x = _rank_data(rank)
    eager = quantizer.quantize(x)

    recorder = _GraphRecorder()
    with torch._inductor.config.patch(post_grad_custom_post_pass=recorder):
        compiled = torch.compile(quantizer.quantize, fullgraph=True)(x)

    nan_x = x.clone()
    if rank == 0:
        nan_x[0, 0] = float("nan")
    nan_gs = quantizer.quantize(nan_x)[2]
    empty_rank0_gs = quantizer.quantize(x[:0] if rank == 0 else x)[2]

    # Subgroups: their own IDs; a rank outside a group cannot register it.
    singles = [dist.new_group([r]) for r in range(WORLD)]
    own_id = register_amax_group(singles[rank])
    with pytest.raises(ValueError, match="not a member"):
        register_amax_group(singles[1 - rank])
    local_quantizer = NVFP4Quantizer(amax_group=own_id)
    local = local_quantizer.quantize(x)

    # One compiled function, quantizers of two groups: the ID turns symbolic on the second
    # compile, the registry lookup specializes it, and each graph holds its own group's name.
    dynamo_graphs: list[list[str]] = []

    def record_group_names(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        dynamo_graphs.append([n.args[2] for n in gm.graph.nodes if "all_reduce" in str(n.target)])
        return gm.forward

    by_quantizer = torch.compile(lambda t, q: q.quantize(t), fullgraph=True, backend=record_group_names)
    alternating = [quantizer, local_quantizer, quantizer, local_quantizer]
    switched = [_same_bits(by_quantizer(x, q), q.quantize(x)) for q in alternating]
    with pytest.raises(Exception, match=r"amax group 12345 is not registered"):
        by_quantizer(x, NVFP4Quantizer(amax_group=12345))

    # Another group over the same ranks keeps the ID and takes over the entry.
    regroup = dist.new_group(list(range(WORLD)))
    same_id = register_amax_group(regroup)
    result = {
        "gid": gid, "ranks": record.ranks, "group_name": record.group_name,
        "record_repr": repr(record), "eager": eager, "compiled": compiled, "graphs": recorder.graphs,
        "nan_gs": nan_gs, "empty_rank0_gs": empty_rank0_gs, "own_id": own_id, "local": local,
        "switch": (switched, dynamo_graphs, [record.group_name, singles[rank].group_name]),
        "regroup": (same_id, amax_group(same_id).group_name, regroup.group_name),
        "pickled": pickle.dumps(quantizer),
    }
    result["after_reinit"] = _after_reinitializing(store_path, gid, x)
    return result


def _after_reinitializing(store_path: str, gid: int, x: torch.Tensor) -> tuple[bool, str, bool]:
    """After destroy_process_group and a new init, torch hands out group names from 1 again: the
    name recorded for the world's ranks (``regroup``'s) now names a group of rank 0 alone, where an
    all-reduce would return rank 0's own amax. Using the old ID is an error naming the fix; the
    same ranks registered again serve it."""
    rank = dist.get_rank()
    old_name = amax_group(gid).group_name
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    groups = [dist.new_group([0]), dist.new_group([1]), dist.new_group([0])]
    renamed = any(g.group_name == old_name for g in groups if g is not dist.GroupMember.NON_GROUP_MEMBER) \
        or rank == 1  # rank 1 is not a member of the single-rank groups of rank 0
    with pytest.raises(UnknownAmaxGroupError, match="destroyed") as raised:
        NVFP4Quantizer(amax_group=gid).quantize(x)
    again = register_amax_group()
    out = NVFP4Quantizer(amax_group=again).quantize(x)
    return renamed, str(raised.value), again == gid and _same_bits(out, _expected(x, _global_amax()))


def _restore_on_rank(pickled: bytes) -> dict:
    """Rank body in a fresh process group: unpickle, re-register the same ranks, quantize."""
    quantizer = pickle.loads(pickled)
    with pytest.raises(UnknownAmaxGroupError):
        quantizer.quantize(_rank_data(dist.get_rank()))
    gid = register_amax_group()
    return {"gid": gid, "quantizer": quantizer, "out": quantizer.quantize(_rank_data(dist.get_rank()))}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> list[dict]:
    store = tmp_path_factory.mktemp("reinit") / "store"
    return run_on_ranks(_quantize_on_rank, WORLD, str(store), timeout=TIMEOUT_S)


class _RecordingUnpickler(pickle.Unpickler):
    """Unpickler that records every (module, name) global the bytes refer to."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.found: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str):
        self.found.add((module, name))
        return super().find_class(module, name)


def _pickled_globals(data: bytes) -> set[tuple[str, str]]:
    unpickler = _RecordingUnpickler(data)
    unpickler.load()
    return unpickler.found


def _global_amax() -> float:
    return max(_rank_data(r).float().abs().max().item() for r in range(WORLD))


def test_same_id_on_every_rank(two_rank_run):
    ids = {r["gid"] for r in two_rank_run}
    assert ids == {amax_group_id(range(WORLD))}
    assert all(r["ranks"] == (0, 1) for r in two_rank_run)
    assert len({r["group_name"] for r in two_rank_run}) == 1
    assert "ProcessGroup" not in two_rank_run[0]["record_repr"]


def test_dynamic_scale_is_global_max(two_rank_run):
    amax = _global_amax()
    assert amax == _rank_data(1).float().abs().max().item()
    for rank, result in enumerate(two_rank_run):
        q, s, gs = result["eager"]
        assert gs.dtype == torch.float32 and gs.shape == (1,)
        assert gs.item() == pytest.approx(448 * 6 / amax, rel=1e-6)
        assert _same_bits((q, s, gs), _expected(_rank_data(rank), amax)), f"rank {rank}"
    assert torch.equal(two_rank_run[0]["eager"][2], two_rank_run[1]["eager"][2])


def test_nan_on_one_rank_gives_nan_scale_on_all(two_rank_run):
    assert all(torch.isnan(r["nan_gs"]).all() for r in two_rank_run)


def test_rank_without_tokens_still_joins_the_reduction(two_rank_run):
    expected = _expected(_rank_data(1), _rank_data(1).float().abs().max().item())[2]
    assert all(torch.equal(r["empty_rank0_gs"], expected) for r in two_rank_run)


def test_compiled_with_group_matches_eager_and_holds_all_reduce(two_rank_run):
    for rank, result in enumerate(two_rank_run):
        assert _same_bits(result["compiled"], result["eager"]), f"rank {rank}"
        (ops,) = result["graphs"]
        reduce_at = ops.index("_c10d_functional.all_reduce.default")
        wait_at = ops.index("_c10d_functional.wait_tensor.default")
        quant_at = ops.index("fp4fuse.scaled_fp4_quant.default")
        assert reduce_at < wait_at < quant_at, ops


def test_subgroups_have_their_own_ids(two_rank_run):
    for rank, result in enumerate(two_rank_run):
        assert result["own_id"] == amax_group_id([rank])
        assert _same_bits(result["local"], _expected(_rank_data(rank), _rank_data(rank).float().abs().max().item()))
        same_id, registered_name, regroup_name = result["regroup"]
        assert same_id == result["gid"] and registered_name == regroup_name != result["group_name"]


def test_one_compiled_function_serves_quantizers_of_different_groups(two_rank_run):
    for result in two_rank_run:
        switched, graphs, expected_names = result["switch"]
        assert switched == [True] * 4
        assert graphs == [[expected_names[0]], [expected_names[1]]], graphs


def test_pickled_quantizer_restores_in_fresh_process_group(two_rank_run):
    pickled = two_rank_run[0]["pickled"]
    assert all(r["pickled"] == pickled for r in two_rank_run)
    assert b"ProcessGroup" not in pickled and b"distributed" not in pickled
    assert _pickled_globals(pickled) == {("fp4fuse.nvfp4.quantizer", "NVFP4Quantizer")}

    restored = run_on_ranks(_restore_on_rank, WORLD, pickled, timeout=TIMEOUT_S)
    amax = _global_amax()
    for rank, result in enumerate(restored):
        quantizer = result["quantizer"]
        assert result["gid"] == two_rank_run[rank]["gid"] == quantizer.amax_group
        assert type(quantizer.amax_group) is int and quantizer.global_scale is None
        assert all(type(getattr(quantizer, f.name)) in (int, float, type(None)) for f in dataclasses.fields(quantizer))
        assert _same_bits(result["out"], _expected(_rank_data(rank), amax)), f"rank {rank}"


def test_amax_group_record_does_not_pickle():
    record = AmaxGroup(group_id=1, ranks=(0,), group_name="0", group=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(record)


def test_an_id_whose_group_was_destroyed_is_an_error_until_registered_again(two_rank_run):
    """Rank 0's recorded group name came back for a group of rank 0 alone after re-initialization:
    the old ID is refused on every rank (no reduction over the wrong ranks), a new registration of
    the same ranks gives the same ID and the global amax again."""
    for rank, r in enumerate(two_rank_run):
        renamed, message, served = r["after_reinit"]
        assert renamed and "register_amax_group" in message and served, (rank, message)
