"""NVFP4Tensor in one process: format, structure, dispatch table, copies into views, autograd,
serialization, and the FSDP2 / DCP hooks called by hand as FSDP2 and DCP call them.

The distributed runs (FSDP2 on gloo ranks, DCP save / load / resharding, functional collectives,
a QLoRA step) are in tests/test_nvfp4_tensor_distributed.py."""
from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from nvfp4_payload import bits, decode64, same_payload, weight
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import fp4fuse
from fp4fuse.nvfp4.format import global_scale_from_amax, quantize_reference
from fp4fuse.nvfp4.tensor import NVFP4Tensor, nvfp4_state_dict_for_dcp

N, K = 64, 48


def _t(seed: int = 0, rows: int = N, cols: int = K, dtype: torch.dtype = torch.bfloat16,
       scale: float = 1.0) -> NVFP4Tensor:
    return NVFP4Tensor.from_hp(weight(seed, rows, cols, dtype) * scale)


# -- format and structure ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_from_hp_matches_reference_bitwise(dtype):
    w = weight(0, N, K, dtype)
    t = NVFP4Tensor.from_hp(w)
    amax = w.abs().amax().float().reshape(1)
    q, s = quantize_reference(w, global_scale_from_amax(amax))
    assert t.shape == w.shape and t.dtype == dtype and t.orig_dtype == dtype
    assert torch.equal(t.qdata, q) and torch.equal(t.scale.view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(t.amax, amax) and torch.equal(t.global_scale(), global_scale_from_amax(amax))
    d = t.dequantize()
    assert d.dtype == dtype and type(d) is torch.Tensor
    assert torch.equal(d, fp4fuse.dequantize_reference(q, s, global_scale_from_amax(amax), dtype))
    torch.testing.assert_close(t.dequantize(torch.float64), decode64(t), rtol=1e-6, atol=0)


def test_from_hp_rejects_bad_k():
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4Tensor.from_hp(torch.randn(4, 24))


@pytest.mark.parametrize("orig_dtype", [torch.uint8, torch.int32, torch.float8_e4m3fn, torch.bool])
def test_constructor_refuses_a_dtype_it_cannot_dequantize_to(orig_dtype):
    t = NVFP4Tensor.from_hp(weight(0, N, K, torch.float32))
    with pytest.raises(TypeError, match="orig_dtype"):
        NVFP4Tensor(t.qdata, t.scale, t.amax, orig_dtype)


def test_a_negative_amax_decodes_to_nan_not_to_flipped_signs():
    """A stored amax below 0 (a corrupt state dict: amaxes are maxima of magnitudes) poisons the tensor,
    as a non-finite one does; its global scale would otherwise be finite and negative."""
    w = weight(0, N, K, torch.float32)
    t = NVFP4Tensor.from_hp(w)
    bad = NVFP4Tensor(t.qdata, t.scale, -t.amax, torch.float32)
    assert torch.isnan(bad.global_scale()).all()
    assert torch.isnan(bad.dequantize()).all()
    assert torch.isnan(torch.nn.functional.linear(torch.ones(2, K), bad)).all()
    zero = NVFP4Tensor(t.qdata, t.scale, torch.tensor([-0.0]), torch.float32)  # -0.0 is 0: scale 1
    assert torch.equal(zero.global_scale(), torch.ones(1))


def test_flatten_unflatten_and_replace():
    t = _t()._replace(amax_group=7)
    assert is_traceable_wrapper_subclass(t)
    names, meta = t.__tensor_flatten__()
    assert names == ["qdata", "scale", "amax"]
    assert meta == {"orig_dtype": torch.bfloat16, "amax_group": 7}
    r = NVFP4Tensor.__tensor_unflatten__({n: getattr(t, n) for n in names}, meta, t.shape, t.stride())
    assert same_payload(r, t) and r.amax_group == 7 and r.dtype == torch.bfloat16
    assert "NVFP4Tensor(shape=(64, 48)" in repr(t) and "amax_group=7" in repr(t)
    with pytest.raises(TypeError, match="unknown fields"):
        t._replace(group=None)
    with pytest.raises(TypeError, match="amax_group must be an int"):
        t._replace(amax_group=dist.group)


def test_payload_helpers_see_every_part():
    """same_payload / bits, which the tests compare payloads with, notice a flipped bit anywhere."""
    t = _t()
    for name in ("qdata", "scale", "amax"):
        changed = t.clone()
        getattr(changed, name).view(torch.uint8).view(-1)[0] ^= 1
        assert not same_payload(changed, t)


# -- serialization ------------------------------------------------------------------------------

def test_pickle_deepcopy_and_weights_only_load():
    t = _t()._replace(amax_group=12345)
    data = pickle.dumps(t)
    assert b"ProcessGroup" not in data
    for r in (pickle.loads(data), copy.deepcopy(t)):
        assert type(r) is NVFP4Tensor and same_payload(r, t) and r.amax_group == 12345
    module = _Proj(t)
    for obj in (t, {"w": t, "plain": torch.arange(3)}, module.state_dict()):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        got = loaded if isinstance(loaded, NVFP4Tensor) else loaded.get("w", loaded.get("weight"))
        assert type(got) is NVFP4Tensor and same_payload(got, t) and got.amax_group == 12345


def test_weights_only_load_needs_only_import_fp4fuse(tmp_path):
    t = _t()
    path = tmp_path / "w.pt"
    torch.save({"layer.weight": t}, path)
    script = ("import pickle, sys, torch, fp4fuse\n"
              f"w = torch.load({str(path)!r}, weights_only=True)['layer.weight']\n"
              "parts = (type(w).__name__, w.qdata, w.scale.view(torch.uint8), w.amax.view(torch.int32))\n"
              "sys.stdout.buffer.write(pickle.dumps(parts))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    name, *payload = pickle.loads(proc.stdout)
    assert name == "NVFP4Tensor"
    assert all(torch.equal(x, y) for x, y in zip(payload, bits(t)))


# -- dispatch table -----------------------------------------------------------------------------

def test_row_views_split_chunk_slice_narrow():
    t = _t()
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


def _split_outcome(fn):
    try:
        return [tuple(p.shape) for p in fn()], None
    except (RuntimeError, ValueError) as e:
        return None, type(e)


@pytest.mark.parametrize("rows", [0, 5, 64])
def test_split_sizes_and_errors_are_torchs(rows):
    """Expected: what torch does with a plain tensor of the same shape (issue 9: split(0) raised
    a bare range() error)."""
    t, plain = _t(rows=rows), torch.zeros(rows, K)
    calls = [("split", s) for s in (0, 1, 7, 64, 100, -1)]
    calls += [("split_with_sizes", s) for s in ([rows], [0, rows], [rows - 1, 1], [rows + 1, -1], [1, 1])]
    for name, arg in calls:
        got = _split_outcome(lambda: getattr(t, name)(arg))
        assert got == _split_outcome(lambda: getattr(plain, name)(arg)), (name, arg)
        if got[0] is not None:
            pieces = getattr(t, name)(arg)
            assert torch.equal(torch.cat([p.dequantize() for p in pieces]), t.dequantize())


def test_view_and_as_strided():
    t = _t()
    flat = t.view(-1)
    assert flat.shape == (N * K,) and torch.equal(flat.dequantize(), t.dequantize().view(-1))
    back = flat.view(N, K)
    assert same_payload(back, t) and back.qdata.data_ptr() == t.qdata.data_ptr()
    assert torch.equal(t.view(N // 2, 2 * K).dequantize(), t.dequantize().view(N // 2, 2 * K))
    with pytest.raises(NotImplementedError, match="multiple of 16"):
        t.view(N * K // 8, 8)
    assert same_payload(torch.as_strided(t, (N, K), (K, 1), 0), t)
    window = torch.as_strided(t, (8, K), (K, 1), 4 * K)
    assert torch.equal(window.qdata, t.qdata[4:12])
    with pytest.raises(NotImplementedError, match="as_strided"):
        torch.as_strided(t, (K, N), (1, K))


def test_view_shapes_and_errors_are_torchs_and_as_strided_refuses_negative_offsets():
    """Expected: what torch does with a plain contiguous tensor of the same shape (view(0, -1) of
    an empty tensor is ambiguous; it returned shape (0, 0)); as_strided at a negative offset read
    rows from the end of the payload."""
    t = _t(rows=5)
    for source, shape in ((t, (-1, 16)), (t, (3, -1)), (t[:0], (0, -1)), (t[:0], (-1,)), (t, (7, -1))):
        plain = torch.zeros(source.shape)
        try:
            expected = plain.view(shape).shape
        except RuntimeError:
            with pytest.raises(RuntimeError, match="invalid|ambiguous"):
                source.view(shape)
            continue
        got = source.view(shape)
        assert got.shape == expected and torch.equal(decode64(got), decode64(source).view(shape))
    with pytest.raises(NotImplementedError, match="storage_offset=-240"):
        torch.as_strided(t, (1, 16), (16, 1), -5 * K)


def test_pad_appends_zero_rows_only():
    t = _t(rows=5)
    p = F.pad(t, [0, 0, 0, 3])
    assert type(p) is NVFP4Tensor and p.shape == (8, K) and torch.equal(p.amax, t.amax)
    assert torch.equal(p.qdata[:5], t.qdata) and not p.qdata[5:].any()
    assert torch.equal(decode64(p)[5:], torch.zeros(3, K, dtype=torch.float64))
    for pad, value in (([0, 16, 0, 0], 0.0), ([0, 0, 1, 0], 0.0), ([0, 0, 0, 1], 1.0)):
        with pytest.raises(NotImplementedError, match="zero rows appended on dim 0"):
            F.pad(t, pad, value=value)


def test_new_tensors_copy_and_to_copy():
    t = _t()
    for z in (t.new_zeros((32, K)), torch.zeros_like(t), t.new_empty((16, K)), torch.empty_like(t)):
        assert type(z) is NVFP4Tensor and not z.qdata.any() and torch.equal(z.amax, t.amax)
    assert type(t.new_zeros((4, K), dtype=torch.float32)) is torch.Tensor
    meta = NVFP4Tensor.from_hp(torch.empty(N, K, device="meta"))
    real = torch.empty_like(meta, device="cpu")  # Module.to_empty: a meta amax cannot be read
    assert real.device.type == "cpu" and not real.qdata.any() and real.amax.item() == 0
    # the FSDP2 init pattern: pad, narrow, copy_ (same amax: new_zeros copied it)
    padded = t.new_zeros((N + 8, K))
    padded.narrow(0, 0, N).copy_(t)
    assert torch.equal(padded.qdata[:N], t.qdata) and torch.equal(padded.amax, t.amax)
    c = t.clone()
    assert same_payload(c, t) and c.qdata.data_ptr() != t.qdata.data_ptr()
    d = t.detach()
    assert type(d) is NVFP4Tensor and d.qdata.data_ptr() == t.qdata.data_ptr()
    plain = torch.empty(N, K, dtype=torch.bfloat16)
    plain.copy_(t)
    assert torch.equal(plain, t.dequantize())
    with pytest.raises(NotImplementedError, match="requantize"):
        t.copy_(plain)
    moved = t.to("cpu", copy=True)
    assert type(moved) is NVFP4Tensor and same_payload(moved, t)
    f32 = t.to(torch.float32)
    assert type(f32) is torch.Tensor and torch.equal(f32, t.dequantize().float())
    # torch._has_compatible_shallow_copy_type does not dispatch (True for two NVFP4Tensors);
    # nn.Module._apply swaps traceable wrapper subclasses instead of assigning `.data`.
    assert torch._has_compatible_shallow_copy_type(t, t.clone())
    module = _Proj(t.clone()).to("cpu")
    assert isinstance(module.weight, NVFP4Tensor) and same_payload(module.weight, t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and streams need CUDA")
def test_pin_memory_record_stream_cuda():
    t = _t()
    p = t.pin_memory()
    assert type(p) is NVFP4Tensor and p.is_pinned()
    g = t.to("cuda")
    g.record_stream(torch.cuda.current_stream())
    assert same_payload(g.to("cpu"), t)


def test_matmuls_dequantize():
    t = _t()
    x = weight(1, 5, K)
    ref = x @ t.dequantize().t()
    assert torch.equal(F.linear(x, t), ref)
    assert torch.equal(torch.mm(x, t.t()), ref)
    y = weight(2, 5, N)
    assert torch.equal(torch.mm(y, t), y @ t.dequantize())
    bias = weight(3, 1, K)[0]
    assert torch.equal(torch.addmm(bias, y, t), torch.addmm(bias, y, t.dequantize()))
    assert t.is_same_size(t.clone()) and same_payload(torch.ops.aten.alias(t), t)


def test_unsupported_op_names_op_and_types():
    t = _t()
    with pytest.raises(NotImplementedError, match=r"aten\.add\.Tensor.*\(NVFP4Tensor, Tensor\)"):
        torch.add(t, torch.ones(N, K, dtype=torch.bfloat16))


# -- copy_ into views (issue 9 item 6) ------------------------------------------------------------

def test_copy_into_row_view_with_another_amax_is_refused_and_writes_nothing():
    base, other = _t(0), _t(1, scale=40.0)  # amaxes ~49x apart: the rows outside would rescale
    before = [x.clone() for x in bits(base)]
    with pytest.raises(ValueError, match="sharing its amax with other rows"):
        base[:16].copy_(other[:16])
    assert all(torch.equal(x, y) for x, y in zip(bits(base), before))


def test_copy_into_row_view_that_is_exact():
    base, other = _t(0), _t(1, scale=40.0)
    value = decode64(base)
    # same amax: a plain payload copy
    base[:16].copy_(base.clone()[16:32])
    assert torch.equal(decode64(base)[:16], value[16:32]) and torch.equal(decode64(base)[16:], value[16:])
    # the rest holds zero codes (0 under any amax): the amax may follow the source
    zeros = NVFP4Tensor.from_hp(torch.zeros(N, K, dtype=torch.bfloat16))
    zeros[8:24].copy_(other[:16])
    assert torch.equal(zeros.amax, other.amax)
    assert torch.equal(decode64(zeros)[8:24], decode64(other)[:16])
    assert not decode64(zeros)[:8].any() and not decode64(zeros)[24:].any()
    # the whole tensor: everything is replaced
    base.copy_(other)
    assert same_payload(base, other)
    # a non-finite amax is not "0 under any amax" for the zero rows
    inf = NVFP4Tensor.from_hp(torch.full((16, K), float("inf"), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="sharing its amax"):
        NVFP4Tensor.from_hp(torch.zeros(N, K, dtype=torch.bfloat16))[:16].copy_(inf)


# -- autograd ---------------------------------------------------------------------------------------

def test_linear_backpropagates_to_input_and_bias_only():
    w = _t(0, rows=24, cols=32, dtype=torch.float32)
    x = weight(1, 6, 32, torch.float32).requires_grad_()
    bias = weight(2, 1, 24, torch.float32)[0].requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = F.linear(x, w, bias)
    grad_out = weight(3, 6, 24, torch.float64)
    out.backward(grad_out.float())
    # the only tensor kept for backward is the NVFP4 weight, not a decoded copy of it
    assert [type(t) for t in saved] == [NVFP4Tensor]
    w64, x64, b64 = decode64(w), x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    ref = F.linear(x64, w64, b64)
    ref.backward(grad_out)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(bias.grad.double(), b64.grad, rtol=1e-6, atol=1e-5)
    assert torch.equal(F.linear(input=x, weight=w, bias=bias), out)  # arguments by name
    with pytest.raises(TypeError, match="input dtype torch.bfloat16 differs"):
        F.linear(x.detach().bfloat16(), w)


def test_requires_grad_is_refused():
    t = _t()
    refused = (lambda: torch.nn.Parameter(t), lambda: t.requires_grad_(),
               lambda: setattr(t, "requires_grad", True))
    for make in refused:
        with pytest.raises(RuntimeError, match="NVFP4 weights are frozen"):
            make()
    p = torch.nn.Parameter(t, requires_grad=False)
    assert type(p) is NVFP4Tensor and not p.requires_grad and not t.requires_grad_(False).requires_grad


# -- FSDP2 hooks, called as FSDP2 calls them ----------------------------------------------------------

class _Mesh:
    """The one DeviceMesh method the hooks read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def _gather_by_hand(t: NVFP4Tensor, world: int):
    """FSDP2's all-gather of ``t`` over ``world`` ranks: torch.chunk shards, each padded to the
    first shard's rows (FSDP2's new_zeros + narrow + copy_), ``fsdp_pre_all_gather`` on every
    rank, every input concatenated on dim 0. Returns (outputs, metadata)."""
    shards = torch.chunk(t, world)
    padded_rows = shards[0].shape[0]
    gathered, meta = [], None
    for rank in range(world):
        shard = shards[rank] if rank < len(shards) else t[:0]
        padded = t.new_zeros((padded_rows, *t.shape[1:]))
        padded[:shard.shape[0]].copy_(shard)
        local = padded[:shard.shape[0]]
        inputs, meta = local.fsdp_pre_all_gather(_Mesh(world), t.shape, t.stride(), None, None)
        if shard.shape[0] != padded_rows:  # what FSDP2 asserts for an unevenly sharded parameter
            assert all(x.shape == (padded_rows, *t.shape[1:]) for x in inputs)
        gathered.append(inputs)
    return tuple(torch.cat(parts) for parts in zip(*gathered)), meta


@pytest.mark.parametrize("rows,world", [(64, 2), (37, 2), (40, 3), (1, 2), (5, 4), (7, 1)])
def test_fsdp_hooks_roundtrip_by_hand(rows, world):
    t = _t(rows=rows)
    outputs, meta = _gather_by_hand(t, world)
    full, inner = t.fsdp_post_all_gather(outputs, meta, torch.bfloat16)
    assert type(full) is NVFP4Tensor and same_payload(full, t) and full.dtype == torch.bfloat16
    aliased = rows % world == 0 and world > 1
    assert len(outputs) == (3 if aliased else 1)
    if aliased:  # even rows: the unsharded tensor aliases the gather outputs
        assert inner == outputs and full.qdata.data_ptr() == outputs[0].data_ptr()
    # Later iterations: FSDP2 frees the inner tensors' storage, re-allocates it (zeros stand for
    # the fresh memory), all-gathers into its output buffers again and passes out=.
    for x in inner:
        x.zero_()
    again, meta = _gather_by_hand(t, world)
    if aliased:
        for x, y in zip(outputs, again):
            x.copy_(y)
        again = outputs
    assert t.fsdp_post_all_gather(again, meta, torch.bfloat16, out=full) is None
    assert same_payload(full, t)


def test_fsdp_hooks_take_the_mixed_precision_param_dtype():
    t = _t(dtype=torch.float32)
    full, _ = t.fsdp_post_all_gather(*_gather_by_hand(t, 2), torch.bfloat16)
    assert full.dtype == torch.bfloat16 and torch.equal(full.dequantize(), t.dequantize(torch.bfloat16))


def _gather_shards(shards: list[NVFP4Tensor], rows: int) -> tuple:
    """FSDP2's all-gather of per-rank ``shards`` (each its own payload, as after each rank
    copy_'d its own tensor into its local shard) of a ``[rows, K]`` weight, like _gather_by_hand."""
    world, padded_rows = len(shards), shards[0].shape[0]
    gathered, meta = [], None
    for shard in shards:
        padded = shard.new_zeros((padded_rows, K))
        padded[:shard.shape[0]].copy_(shard)
        inputs, meta = padded[:shard.shape[0]].fsdp_pre_all_gather(_Mesh(world), torch.Size((rows, K)),
                                                                    (K, 1), None, None)
        gathered.append(inputs)
    return tuple(torch.cat(parts) for parts in zip(*gathered)), meta


@pytest.mark.parametrize("sizes", [(16, 16), (3, 3, 2), (2, 1, 0)])  # even; uneven; an empty shard
def test_fsdp_hooks_never_decode_a_shard_under_another_shards_amax(sizes):
    """Shards quantized separately (each rank from_hp'd its own rows) carry different amaxes, and
    the unsharded tensor has one: it took rank 0's, decoding the other rows scaled wrong (issue:
    silent). Now they decode to NaN; a shard of zeros (0 under any amax) or an empty one is no
    disagreement. Expected values: decode64 of each shard (float64, from the format)."""
    rows = sum(sizes)
    shards = [NVFP4Tensor.from_hp(weight(i, n, K) * (1 + 10 * i)) for i, n in enumerate(sizes)]
    outputs, meta = _gather_shards(shards, rows)
    full, inner = shards[0].fsdp_post_all_gather(outputs, meta, torch.bfloat16)
    assert torch.isnan(decode64(full)).all()
    # later iterations (out=) decide again: agreeing shards give their amax, then NaN again
    agreeing = [NVFP4Tensor.from_hp(weight(i, n, K)) for i, n in enumerate(sizes)]
    for a in agreeing[1:]:
        a.amax.copy_(agreeing[0].amax)  # as if quantized with one group amax (the codes differ; fine)
    outputs2, _ = _gather_shards(agreeing, rows)
    if len(outputs2) == 3:  # even rows: out's inner tensors alias the gather outputs
        for x, y in zip(outputs, outputs2):
            x.copy_(y)
        outputs2 = outputs
    assert shards[0].fsdp_post_all_gather(outputs2, meta, torch.bfloat16, out=full) is None
    assert torch.equal(decode64(full), torch.cat([decode64(a) for a in agreeing]))
    # zeros with their own amax (0) beside a shard with values: still that shard's amax
    zero_first = [NVFP4Tensor.from_hp(torch.zeros(sizes[0], K, dtype=torch.bfloat16))] + shards[1:2] + [
        NVFP4Tensor.from_hp(torch.zeros(n, K, dtype=torch.bfloat16)) for n in sizes[2:]]
    full, _ = zero_first[0].fsdp_post_all_gather(*_gather_shards(zero_first, rows), torch.bfloat16)
    assert torch.equal(decode64(full), torch.cat([decode64(z) for z in zero_first]))


# -- DCP hooks, called as dcp.load calls them --------------------------------------------------------

def _dcp_copy(target: NVFP4Tensor, start: int, chunk: NVFP4Tensor) -> None:
    """What dcp.load does with one checkpoint chunk (FileSystemReader.read_data)."""
    target.__get_tensor_shard__(None).narrow(0, start, chunk.shape[0]).detach().copy_(chunk)


def test_dcp_load_restores_amax_once_per_load():
    target, saved = _t(0), _t(1, scale=40.0)
    _dcp_copy(target, 0, saved[:16])
    # mid-load: rows not loaded yet read 0, never another amax's values
    assert torch.equal(target.amax, saved.amax) and not target.qdata[16:].any()
    assert torch.equal(decode64(target)[:16], decode64(saved)[:16])
    _dcp_copy(target, 16, saved[16:40])
    _dcp_copy(target, 40, saved[40:])
    assert same_payload(target, saved)
    # the load is complete: the next one may bring another amax ...
    other = _t(2)
    _dcp_copy(target, 32, other[32:])
    assert torch.equal(target.amax, other.amax)
    # ... but all its chunks must bring the same one
    with pytest.raises(ValueError, match="checkpoint chunks of this weight carry different amax"):
        _dcp_copy(target, 0, saved[:32])
    # views the user takes are not restore views
    with pytest.raises(ValueError, match="sharing its amax"):
        target[:16].copy_(saved[:16])


def test_dcp_load_into_views_of_one_payload(tmp_path):
    """Parameters that are row views of one NVFP4Tensor share its amax. Loading a checkpoint whose
    entries carry different amaxes set the amax once per view, so the rows loaded first decoded
    under the last view's amax (issue: silent). Now that is a ValueError; a checkpoint of the fused
    tensor loads exactly, into a model holding other values and another amax. Expected values:
    the saved payload, decode64 of it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def fused_model(base: NVFP4Tensor) -> dict[str, torch.nn.Parameter]:
        return {"q": torch.nn.Parameter(base[:16], requires_grad=False),
                "k": torch.nn.Parameter(base[16:], requires_grad=False)}

    q, k = _t(0, rows=16), _t(1, rows=16, scale=10.0)
    dcp.save({"q": q, "k": k}, checkpoint_id=str(tmp_path / "separate"))
    for init in (_t(2, rows=32), NVFP4Tensor.from_hp(torch.zeros(32, K, dtype=torch.bfloat16))):
        with pytest.raises(CheckpointException) as info:
            dcp.load(fused_model(init), checkpoint_id=str(tmp_path / "separate"))
        (error, _), = info.value.failures.values()
        assert isinstance(error, ValueError) and "shares its payload and amax" in str(error)
    fused = _t(3, rows=32)
    dcp.save(fused_model(fused), checkpoint_id=str(tmp_path / "fused"))
    for init in (_t(4, rows=32, scale=5.0), NVFP4Tensor.from_hp(torch.zeros(32, K, dtype=torch.bfloat16))):
        dcp.load(fused_model(init), checkpoint_id=str(tmp_path / "fused"))
        assert same_payload(init, fused) and torch.equal(decode64(init), decode64(fused))
        dcp.load(fused_model(init), checkpoint_id=str(tmp_path / "fused"))  # a second load
        assert same_payload(init, fused)
    # separate targets still take each entry's own amax
    targets = {"q": _t(5, rows=16), "k": _t(6, rows=16)}
    dcp.load(targets, checkpoint_id=str(tmp_path / "separate"))
    assert same_payload(targets["q"], q) and same_payload(targets["k"], k)


def test_dcp_save_load_in_one_process_lossless(tmp_path):
    import torch.distributed.checkpoint as dcp
    t = _t(0)
    model = _Proj(t)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path))
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata["weight"]
    assert md.properties.dtype == torch.bfloat16 and tuple(md.size) == (N, K)  # the logical tensor
    target = _Proj(_t(1))
    dcp.load(target.state_dict(), checkpoint_id=str(tmp_path))
    assert same_payload(target.weight, t)


def test_state_dict_for_dcp_writes_plain_safetensors(tmp_path):
    """nvfp4_state_dict_for_dcp's reason to exist: DCP's safetensors writer cannot hold a tensor
    subclass; the converted dict stores the payload as plain tensors any reader can open."""
    import safetensors.torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    t = _t(0)
    dcp.save(nvfp4_state_dict_for_dcp({"w": t}), storage_writer=HuggingFaceStorageWriter(str(tmp_path)))
    stored = {}
    for f in tmp_path.glob("*.safetensors"):
        stored.update(safetensors.torch.load_file(f))
    assert set(stored) == {"w.qdata", "w.scale", "w.amax"}
    assert all(torch.equal(x, y) for x, y in zip((stored["w.qdata"], stored["w.scale"],
                                                   stored["w.amax"].view(torch.int32)), bits(t)))


class _Proj(torch.nn.Module):
    """``y = x @ W^T`` with an NVFP4Tensor weight."""

    def __init__(self, weight: NVFP4Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
