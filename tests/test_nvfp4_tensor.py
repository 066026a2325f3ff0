"""NVFP4Tensor: format, flatten/unflatten, dispatch table, amax groups, FSDP2 and DCP on gloo."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_on_ranks
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import fp4fuse
from fp4fuse.nvfp4.quantizer import NVFP4Quantizer, register_amax_group
from fp4fuse.nvfp4.format import global_scale_from_amax, quantize_reference
from fp4fuse.nvfp4.tensor import NVFP4Tensor, nvfp4_state_dict_for_dcp

TIMEOUT_S = 90
N, K = 64, 48


def _weight(seed: int = 0, n: int = N, k: int = K, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 3).to(dtype)


def _bits(t: NVFP4Tensor) -> tuple[torch.Tensor, ...]:
    return t.qdata, t.scale.view(torch.uint8), t.amax.view(torch.int32)


def _same(a: NVFP4Tensor, b: NVFP4Tensor) -> bool:
    return a.shape == b.shape and all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b)))


# -- format and structure ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_from_hp_matches_reference_bitwise(dtype):
    w = _weight(dtype=dtype)
    t = NVFP4Tensor.from_hp(w)
    amax = w.abs().amax().float().reshape(1)
    q, s = quantize_reference(w, global_scale_from_amax(amax))
    assert t.shape == w.shape and t.dtype == dtype and t.orig_dtype == dtype
    assert torch.equal(t.qdata, q) and torch.equal(t.scale.view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(t.amax, amax) and torch.equal(t.global_scale(), global_scale_from_amax(amax))
    d = t.dequantize()
    assert d.dtype == dtype and type(d) is torch.Tensor
    assert torch.equal(d, fp4fuse.dequantize_reference(q, s, global_scale_from_amax(amax), dtype))


def test_from_hp_rejects_bad_k():
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4Tensor.from_hp(torch.randn(4, 24))


def test_flatten_unflatten_and_replace():
    t = NVFP4Tensor.from_hp(_weight())._replace(amax_group=7)
    assert is_traceable_wrapper_subclass(t)
    names, meta = t.__tensor_flatten__()
    assert names == ["qdata", "scale", "amax"]
    assert meta == {"orig_dtype": torch.bfloat16, "amax_group": 7}
    r = NVFP4Tensor.__tensor_unflatten__({n: getattr(t, n) for n in names}, meta, t.shape, t.stride())
    assert _same(r, t) and r.amax_group == 7 and r.dtype == torch.bfloat16
    assert "NVFP4Tensor(shape=(64, 48)" in repr(t) and "amax_group=7" in repr(t)
    with pytest.raises(TypeError, match="unknown fields"):
        t._replace(group=None)
    with pytest.raises(TypeError, match="amax_group must be an int"):
        t._replace(amax_group=dist.group)


def test_pickle_deepcopy_torch_save_hold_no_process_group():
    t = NVFP4Tensor.from_hp(_weight())._replace(amax_group=12345)
    data = pickle.dumps(t)
    assert b"ProcessGroup" not in data
    for r in (pickle.loads(data), copy.deepcopy(t)):
        assert type(r) is NVFP4Tensor and _same(r, t) and r.amax_group == 12345
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    buf.seek(0)
    assert _same(torch.load(buf, weights_only=False)["w"], t)


# -- dispatch table -----------------------------------------------------------------------------

def test_row_views_split_chunk_slice_narrow():
    t = NVFP4Tensor.from_hp(_weight())
    for parts in (torch.chunk(t, 2), t.split(32), t.split([16, 48])):
        assert all(type(p) is NVFP4Tensor for p in parts)
        assert torch.equal(torch.cat([p.qdata for p in parts]), t.qdata)
        assert all(p.amax is t.amax for p in parts)
    s = t[8:24]
    assert s.shape == (16, K) and torch.equal(s.qdata, t.qdata[8:24])
    assert torch.equal(s.scale.view(torch.uint8), t.scale[8:24].view(torch.uint8))
    assert torch.equal(t.narrow(0, 40, 24).dequantize(), t.dequantize()[40:])
    with pytest.raises(NotImplementedError, match="dim 0 only"):
        t.split(16, dim=1)
    with pytest.raises(NotImplementedError, match="step 2"):
        t[::2]


def test_view_and_as_strided():
    t = NVFP4Tensor.from_hp(_weight())
    flat = t.view(-1)
    assert flat.shape == (N * K,) and torch.equal(flat.dequantize(), t.dequantize().view(-1))
    back = flat.view(N, K)
    assert _same(back, t) and back.qdata.data_ptr() == t.qdata.data_ptr()
    assert torch.equal(t.view(N // 2, 2 * K).dequantize(), t.dequantize().view(N // 2, 2 * K))
    with pytest.raises(NotImplementedError, match="multiple of 16"):
        t.view(N * K // 8, 8)
    assert _same(torch.as_strided(t, (N, K), (K, 1), 0), t)
    window = torch.as_strided(t, (8, K), (K, 1), 4 * K)
    assert torch.equal(window.qdata, t.qdata[4:12])
    with pytest.raises(NotImplementedError, match="as_strided"):
        torch.as_strided(t, (K, N), (1, K))


def test_new_tensors_copy_and_to_copy():
    t = NVFP4Tensor.from_hp(_weight())
    for z in (t.new_zeros((32, K)), torch.zeros_like(t)):
        assert type(z) is NVFP4Tensor and not z.qdata.any() and torch.equal(z.amax, t.amax)
    e = t.new_empty((16, K))
    assert type(e) is NVFP4Tensor and e.shape == (16, K)
    assert type(torch.empty_like(t)) is NVFP4Tensor
    assert type(t.new_zeros((4, K), dtype=torch.float32)) is torch.Tensor
    # the FSDP2 init pattern: pad, narrow, copy_ (amax flows through the shared view)
    padded = NVFP4Tensor.from_hp(torch.zeros(48, K))._replace(orig_dtype=torch.bfloat16)
    padded.narrow(0, 0, 40).copy_(t[:40])
    assert torch.equal(padded.qdata[:40], t.qdata[:40]) and torch.equal(padded.amax, t.amax)
    c = t.clone()
    assert _same(c, t) and c.qdata.data_ptr() != t.qdata.data_ptr()
    d = t.detach()
    assert type(d) is NVFP4Tensor and d.qdata.data_ptr() == t.qdata.data_ptr()
    plain = torch.empty(N, K, dtype=torch.bfloat16)
    plain.copy_(t)
    assert torch.equal(plain, t.dequantize())
    with pytest.raises(NotImplementedError, match="requantize"):
        t.copy_(plain)
    moved = t.to("cpu", copy=True)
    assert type(moved) is NVFP4Tensor and _same(moved, t)
    f32 = t.to(torch.float32)
    assert type(f32) is torch.Tensor and torch.equal(f32, t.dequantize().float())  # the logical bf16 values, cast
    # torch._has_compatible_shallow_copy_type does not dispatch (True for two NVFP4Tensors);
    # nn.Module._apply swaps traceable wrapper subclasses instead of assigning `.data`.
    assert torch._has_compatible_shallow_copy_type(t, t.clone())
    module = _Proj(t.clone()).to("cpu")
    assert isinstance(module.weight, NVFP4Tensor) and _same(module.weight, t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and streams need CUDA")
def test_pin_memory_record_stream_cuda():
    t = NVFP4Tensor.from_hp(_weight())
    p = t.pin_memory()
    assert type(p) is NVFP4Tensor and p.is_pinned()
    g = t.to("cuda")
    g.record_stream(torch.cuda.current_stream())
    assert _same(g.to("cpu"), t)


def test_matmuls_dequantize():
    t = NVFP4Tensor.from_hp(_weight())
    x = _weight(1, 5, K)
    ref = x @ t.dequantize().t()
    assert torch.equal(F.linear(x, t), ref)
    assert torch.equal(torch.mm(x, t.t()), ref)
    y = _weight(2, 5, N)
    assert torch.equal(torch.mm(y, t), y @ t.dequantize())
    bias = _weight(3, 1, K)[0]
    assert torch.equal(torch.addmm(bias, y, t), torch.addmm(bias, y, t.dequantize()))
    assert t.is_same_size(t.clone()) and _same(torch.ops.aten.alias(t), t)


def test_unsupported_op_names_op_and_types():
    t = NVFP4Tensor.from_hp(_weight())
    with pytest.raises(NotImplementedError, match=r"aten\.add\.Tensor.*\(NVFP4Tensor, Tensor\)"):
        torch.add(t, torch.ones(N, K, dtype=torch.bfloat16))


# -- distributed (gloo) ---------------------------------------------------------------------------

class _Mesh:
    """The one DeviceMesh method the hooks read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_fsdp_hooks_roundtrip_by_hand():
    t = NVFP4Tensor.from_hp(_weight())
    shards = torch.chunk(t, 2)
    gathered = []
    for shard in shards:
        inputs, meta = shard.fsdp_pre_all_gather(_Mesh(2), t.shape, t.stride(), None, None)
        assert [x.dtype for x in inputs] == [torch.uint8, torch.uint8]
        gathered.append(inputs)
    outputs = tuple(torch.cat(parts) for parts in zip(*gathered))  # what FSDP2's all-gather makes
    full, inner = shards[0].fsdp_post_all_gather(outputs, meta, torch.bfloat16)
    assert type(full) is NVFP4Tensor and _same(full, t) and inner == outputs
    assert full.qdata.data_ptr() == outputs[0].data_ptr()
    full.amax.zero_()
    assert shards[0].fsdp_post_all_gather(outputs, meta, torch.bfloat16, out=full) is None
    assert torch.equal(full.amax, t.amax)
    with pytest.raises(NotImplementedError, match="even row sharding"):
        t[:33].fsdp_pre_all_gather(_Mesh(2), (65, K), (K, 1), None, None)


def _amax_on_rank() -> dict:
    rank = dist.get_rank()
    group_id = register_amax_group()
    shard = _weight(0)[rank * N // 2:(rank + 1) * N // 2] * (rank + 1)  # different local amaxes
    t = NVFP4Tensor.from_hp(shard, amax_group=group_id)
    local = NVFP4Tensor.from_hp(shard)
    return {"amax": t.amax, "gs": t.global_scale(), "local_amax": local.amax, "group": group_id,
            "attr": t.amax_group, "pickled": pickle.dumps(t)}


def test_amax_shared_across_ranks():
    r0, r1 = run_on_ranks(_amax_on_rank, 2, timeout=TIMEOUT_S)
    assert not torch.equal(r0["local_amax"], r1["local_amax"])
    expected = torch.maximum(r0["local_amax"], r1["local_amax"])
    assert torch.equal(r0["amax"], expected) and torch.equal(r1["amax"], expected)
    assert torch.equal(r0["gs"], r1["gs"])
    assert r0["attr"] == r0["group"] == r1["group"] and isinstance(r0["attr"], int)
    restored = pickle.loads(r0["pickled"])
    assert restored.amax_group == r0["group"] and b"ProcessGroup" not in r0["pickled"]


class _Proj(torch.nn.Module):
    """``y = x @ W^T`` with an NVFP4Tensor weight (F.linear dequantizes it)."""

    def __init__(self, weight: NVFP4Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _ProjFP4(_Proj):
    """``y = x @ W^T`` through ``fp4fuse::mm_fp4``: x quantized per call, W's payload as is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        q, s, gs = NVFP4Quantizer().quantize(x)
        alpha = torch.reciprocal(gs * w.global_scale())
        return torch.ops.fp4fuse.mm_fp4(q, w.qdata, s, w.scale, alpha, torch.bfloat16)


def _layers(weight: NVFP4Tensor) -> torch.nn.Sequential:
    return torch.nn.Sequential(_Proj(weight), _ProjFP4(weight.clone()))


def _fsdp_model(weight: NVFP4Tensor) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = _layers(weight)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_on_rank() -> dict:
    w = NVFP4Tensor.from_hp(_weight(0, K, K))
    x = _weight(1, 6, K)
    reference = _layers(w.clone())(x)
    model = _fsdp_model(w.clone())
    local = model[0].weight.to_local()
    outs = [model(x), model(x)]  # the second forward re-gathers into the same buffers (out=)
    model[0].unshard()
    full = model[0].weight
    return {"outs": outs, "reference": reference, "local_type": type(local).__name__,
            "local_rows": local.shape[0], "full_type": type(full).__name__,
            "full_same": _same(full, w)}


def test_fsdp2_forward_bitwise():
    for r in run_on_ranks(_fsdp_on_rank, 2, timeout=TIMEOUT_S):
        assert r["local_type"] == "NVFP4Tensor" and r["local_rows"] == K // 2
        assert r["full_type"] == "NVFP4Tensor" and r["full_same"]
        assert all(torch.equal(o, r["reference"]) for o in r["outs"])


def _dcp_save_on_rank(sync_dir: str, async_dir: str) -> NVFP4Tensor:
    import torch.distributed.checkpoint as dcp
    w = NVFP4Tensor.from_hp(_weight(2, K, K))
    model = _fsdp_model(w.clone())
    state = nvfp4_state_dict_for_dcp(model.state_dict())
    assert set(state) == {f"{i}.weight.{p}" for i in (0, 1) for p in ("qdata", "scale", "amax")}
    dcp.save(state, checkpoint_id=sync_dir)
    dcp.async_save(state, checkpoint_id=async_dir).result()
    resharded = _fsdp_model(NVFP4Tensor.from_hp(torch.zeros(K, K, dtype=torch.bfloat16)))
    dcp.load(nvfp4_state_dict_for_dcp(resharded.state_dict()), checkpoint_id=sync_dir)
    local = resharded[1].weight.to_local()
    rows = slice(dist.get_rank() * K // 2, (dist.get_rank() + 1) * K // 2)
    assert type(local) is NVFP4Tensor and _same(local, w[rows])
    return w


def _dcp_load_on_rank(path: str) -> NVFP4Tensor:
    import torch.distributed.checkpoint as dcp
    blank = NVFP4Tensor.from_hp(torch.zeros(K, K, dtype=torch.bfloat16))
    model = _layers(blank.clone())
    dcp.load(nvfp4_state_dict_for_dcp(model.state_dict()), checkpoint_id=path)
    return model[1].weight.detach()


def test_dcp_save_two_ranks_load_one_and_two_ranks_lossless(tmp_path):
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    saved = run_on_ranks(_dcp_save_on_rank, 2, sync_dir, async_dir, timeout=TIMEOUT_S)[0]
    for path in (sync_dir, async_dir):
        loaded = run_on_ranks(_dcp_load_on_rank, 1, path, timeout=TIMEOUT_S)[0]
        assert type(loaded) is NVFP4Tensor and _same(loaded, saved)
