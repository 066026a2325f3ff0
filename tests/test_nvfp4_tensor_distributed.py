"""NVFP4Tensor weights across ranks, exactly as users call it: FSDP2 (``fully_shard``), DCP
(``dcp.save(model.state_dict())``, ``dcp.async_save``, ``dcp.load(model.state_dict())``, 2 -> 1 and
2 -> 3 ranks), ``DTensor.full_tensor()`` / ``redistribute`` / ``get_model_state_dict`` (functional
collectives on the subclass), uneven row shards, and a QLoRA-style training step.

Anchored on TransformerEngine's FSDP2 tests (``run_fsdp2_model.py``: DCP output parity and
resharding). Every rank function runs on CPU gloo here; the ``nccl`` parameter runs the same code
on 2 GPUs (``multigpu``). One 2-rank run does the saving side and the same-world-size checks; the
loads into 1 process and into 3 ranks read its checkpoints.

Expected values are the payload saved (codes, scales, amax, bit for bit) and the forward output
before saving; gradients are checked against a float64 model built from ``decode64``."""
from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_on_ranks
from nvfp4_payload import decode64, same_payload, weight

from fp4fuse.nvfp4.quantizer import register_amax_group
from fp4fuse.nvfp4.tensor import NVFP4Tensor

TIMEOUT_S = 240
K = 32
# name: (rows, logical dtype). Rows over 2 and 3 ranks: 48 even; 37 -> 19/18 and 13/13/11 (not
# multiples of 16); 1 -> 1/0 and 1/0/0 (empty shards); 40 -> 20/20 and 14/14/12.
WEIGHTS = {"even": (48, torch.bfloat16), "odd": (37, torch.bfloat16), "one_row": (1, torch.bfloat16),
           "fp32": (40, torch.float32)}
BACKENDS = [pytest.param("gloo", id="gloo"),
            pytest.param("cpu:gloo,cuda:nccl", id="nccl", marks=pytest.mark.multigpu)]


# -- models -------------------------------------------------------------------------------------------

class _Proj(torch.nn.Module):
    """``y = x @ W^T`` through ``F.linear`` (frozen NVFP4 weight)."""

    def __init__(self, w: NVFP4Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class _ProjFP4(_Proj):
    """``y = x @ W^T`` through ``fp4fuse::mm_fp4``: x quantized per call, W's payload as gathered."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fp4fuse.nvfp4.quantizer import NVFP4Quantizer
        w = self.weight
        q, s, gs = NVFP4Quantizer().quantize(x.to(torch.bfloat16))
        return torch.ops.fp4fuse.mm_fp4(q, w.qdata, s, w.scale, torch.reciprocal(gs * w.global_scale()),
                                        torch.bfloat16)


class _Bank(torch.nn.Module):
    """One projection per weight of WEIGHTS, each applied to the same input; plus one through mm_fp4."""

    def __init__(self, weights: dict[str, NVFP4Tensor]) -> None:
        super().__init__()
        self.projs = torch.nn.ModuleDict({name: _Proj(w) for name, w in weights.items()})
        self.fp4 = _ProjFP4(weights["even"].clone())

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [p(x) for p in self.projs.values()] + [self.fp4(x)]


def _weights(seed: int, device: torch.device) -> dict[str, NVFP4Tensor]:
    return {name: NVFP4Tensor.from_hp(weight(seed + i, rows, K, dtype).to(device))
            for i, (name, (rows, dtype)) in enumerate(WEIGHTS.items())}


def _fqns() -> list[str]:
    return [f"projs.{name}.weight" for name in WEIGHTS] + ["fp4.weight"]


def _device() -> torch.device:
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    torch.cuda.set_device(dist.get_rank())
    return torch.device("cuda", dist.get_rank())


def _fully_shard(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for module in model.modules():
        if module is not model and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _x(device: torch.device) -> torch.Tensor:
    return weight(100, 5, K, torch.float32).to(device)


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj


def _local_shards(model: torch.nn.Module) -> dict[str, NVFP4Tensor]:
    return {fqn: value.to_local() for fqn, value in model.state_dict().items()}


# -- the 2-rank run: FSDP2, collectives, DCP save, same-world-size load, QLoRA, amax groups ---------

def _two_rank_suite(ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import Replicate
    device = _device()
    weights = _weights(0, device)
    x = _x(device)
    out: dict = {"saved": {fqn: w.clone() for fqn, w in zip(_fqns(), [*weights.values(), weights["even"]])}}
    out["unsharded_forward"] = _Bank({k: w.clone() for k, w in weights.items()})(x)
    model = _fully_shard(_Bank({k: w.clone() for k, w in weights.items()}), device)
    out["forward"] = [model(x), model(x)]  # the second gathers into re-allocated buffers (out=)

    state = model.state_dict()
    out["full_tensor"] = {fqn: dt.full_tensor() for fqn, dt in state.items()}
    out["redistribute"] = {fqn: dt.redistribute(placements=[Replicate()]).to_local()
                           for fqn, dt in state.items()}
    out["full_state_dict"] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    dcp.save(model.state_dict(), checkpoint_id=os.path.join(ckpt, "sync"))
    dcp.async_save(model.state_dict(), checkpoint_id=os.path.join(ckpt, "async")).result()
    reloaded = _fully_shard(_Bank(_weights(10, device)), device)  # other values, other amaxes
    dcp.load(reloaded.state_dict(), checkpoint_id=os.path.join(ckpt, "async"))
    out["reloaded_local"] = _local_shards(reloaded)
    out["reloaded_forward"] = reloaded(x)
    # Module.load_state_dict of a sharded state dict (copy_ into the padded uneven shards)
    assigned = _fully_shard(_Bank(_weights(20, device)), device)
    assigned.load_state_dict(model.state_dict())
    out["load_state_dict_forward"] = assigned(x)

    out["disagreeing"] = _disagreeing_shards(ckpt, device)
    out["per_rank_copies"] = _per_rank_copies(device)
    out["empty_shard_split_checkpoint"] = _empty_shard_split_checkpoint(ckpt, device)
    out["qlora"] = _qlora_steps(device)
    out["amax_group"] = _amax_group(device)
    out["rank"] = dist.get_rank()
    return _cpu(out)


def _disagreeing_shards(ckpt: str, device: torch.device) -> str:
    """A DTensor whose shards were quantized separately (different amaxes): full_tensor() must
    refuse; its checkpoint is written for the 2 -> 1 load test to refuse as well."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    local = NVFP4Tensor.from_hp(weight(30, 16, K).to(device) * (1 + dist.get_rank()))
    dt = DTensor.from_local(local, mesh, [Shard(0)])
    dcp.save({"w": dt}, checkpoint_id=os.path.join(ckpt, "disagreeing"))
    try:
        dt.full_tensor()
    except ValueError as e:
        return str(e)
    return "full_tensor() did not raise"


def _per_rank_copies(device: torch.device) -> dict:
    """FSDP2 models whose ranks each copy_ their own from_hp (a local amax) into their local shard:
    even rows (16 -> 8/8), uneven (5 -> 3/2); then the same with rank 1 copying zeros (amax 0).
    Returns each model's forward of the identity (row r of W^T is row r of the weight) twice (the
    second gathers with out=), and the hp rows each rank quantized."""
    results = {}
    rank = dist.get_rank()
    for name, rows in (("even", 16), ("uneven", 5)):
        for zeros in (False, True):
            per_rank = -(-rows // 2)
            start, stop = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
            local_hp = weight(70, rows, K)[start:stop] * (1 + 10 * rank)
            if zeros and rank == 1:
                local_hp = torch.zeros_like(local_hp)
            model = _fully_shard(_Proj(NVFP4Tensor.from_hp(torch.zeros(rows, K, dtype=torch.bfloat16))
                                       .to(device)), device)
            with torch.no_grad():
                model.weight.to_local().copy_(NVFP4Tensor.from_hp(local_hp.to(device)))
            eye = torch.eye(K, dtype=torch.bfloat16, device=device)
            results[name, zeros] = {"forward": [model(eye).t(), model(eye).t()],
                                    "local": NVFP4Tensor.from_hp(local_hp)}
    return results


def _empty_shard_split_checkpoint(ckpt: str, device: torch.device) -> dict:
    """A 1-row weight over 2 ranks (rank 1's shard empty): dcp.load sets rank 0's amax, never rank
    1's; saving through nvfp4_state_dict_for_dcp stored the stale one of rank 1 (DCP's planner
    picks the rank of a replicated entry) beside rank 0's codes. Returns the weight loaded and the
    one read back from the plain-tensor checkpoint, both gathered."""
    import torch.distributed.checkpoint as dcp
    from fp4fuse.nvfp4.tensor import nvfp4_state_dict_for_dcp
    source = _fully_shard(_Proj(NVFP4Tensor.from_hp(weight(80, 1, K).to(device) * 5)), device)
    dcp.save(source.state_dict(), checkpoint_id=os.path.join(ckpt, "one_row"))
    loaded = _fully_shard(_Proj(NVFP4Tensor.from_hp(weight(81, 1, K).to(device))), device)
    dcp.load(loaded.state_dict(), checkpoint_id=os.path.join(ckpt, "one_row"))
    dcp.save(nvfp4_state_dict_for_dcp(loaded.state_dict()), checkpoint_id=os.path.join(ckpt, "one_row_plain"))
    again = _fully_shard(_Proj(NVFP4Tensor.from_hp(weight(82, 1, K).to(device))), device)
    dcp.load(nvfp4_state_dict_for_dcp(again.state_dict()), checkpoint_id=os.path.join(ckpt, "one_row_plain"))
    return {"saved": source.weight.full_tensor(), "loaded": loaded.weight.full_tensor(),
            "read_back": again.weight.full_tensor()}


# QLoRA: frozen NVFP4 base + trainable low-rank adapters, FSDP2 over 2 ranks, SGD on the adapters.
LORA_IN, LORA_HIDDEN, LORA_OUT, LORA_RANK, LORA_BATCH, LORA_STEPS, LORA_LR = 32, 48, 16, 4, 6, 4, 0.05


class _LoRALinear(torch.nn.Module):
    def __init__(self, base: NVFP4Tensor, seed: int) -> None:
        super().__init__()
        out_features, in_features = base.shape
        self.weight = torch.nn.Parameter(base, requires_grad=False)
        g = torch.Generator().manual_seed(seed)
        self.lora_a = torch.nn.Parameter(torch.randn(LORA_RANK, in_features, generator=g) * 0.3)
        self.lora_b = torch.nn.Parameter(torch.randn(out_features, LORA_RANK, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def _qlora_model(device: torch.device | str) -> torch.nn.Sequential:
    """adapted -> tanh -> frozen only (its own FSDP2 unit: gradients pass through it) -> adapted."""
    shapes = [(LORA_HIDDEN, LORA_IN), (LORA_HIDDEN, LORA_HIDDEN), (LORA_OUT, LORA_HIDDEN)]
    bases = [NVFP4Tensor.from_hp(weight(40 + i, rows, cols, torch.float32).to(device) / (3 * cols ** 0.5))
             for i, (rows, cols) in enumerate(shapes)]
    return torch.nn.Sequential(_LoRALinear(bases[0], 42), torch.nn.Tanh(), _Proj(bases[1]),
                               _LoRALinear(bases[2], 43)).to(device)


def _qlora_batch(rank: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    return (weight(50 + rank, LORA_BATCH, LORA_IN, torch.float32).to(device) / 3,
            weight(60 + rank, LORA_BATCH, LORA_OUT, torch.float32).to(device) / 3)


def _qlora_steps(device: torch.device) -> dict:
    model = _qlora_model(device)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _fully_shard(model, device)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LORA_LR)
    x, y = _qlora_batch(dist.get_rank(), device)
    x.requires_grad_()
    losses, first_grads = [], None
    for step in range(LORA_STEPS):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if step == 0:
            first_grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()
                           if p.requires_grad}
            first_grads["x"] = x.grad.clone()
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / dist.get_world_size())
    frozen = all(p.grad is None for name, p in model.named_parameters() if not p.requires_grad)
    return {"initial": initial, "grads": first_grads, "losses": losses, "frozen_grads_none": frozen}


def _amax_group(device: torch.device) -> dict:
    group_id = register_amax_group()
    shard = weight(0, 16, K).to(device) * (dist.get_rank() + 1)  # different local amaxes
    return {"amax": NVFP4Tensor.from_hp(shard, amax_group=group_id).amax,
            "local_amax": NVFP4Tensor.from_hp(shard).amax, "group": group_id}


# -- loads into other world sizes ------------------------------------------------------------------

def _saved_bank(saved: dict[str, NVFP4Tensor], device: torch.device) -> _Bank:
    """The saved model, unsharded, from the saved payload: what a load must reproduce."""
    return _Bank({name: saved[f"projs.{name}.weight"].to(device) for name in WEIGHTS})


def _load_on_rank(ckpts: list[str], saved: dict[str, NVFP4Tensor]) -> list[dict]:
    """Load each checkpoint into a fresh FSDP2 model built from other weights; forward it and the
    saved model (same process, so the same CPU matmul kernels: bitwise comparable)."""
    import torch.distributed.checkpoint as dcp
    device = _device()
    x = _x(device)
    loaded = []
    for ckpt in ckpts:
        model = _fully_shard(_Bank(_weights(10, device)), device)
        dcp.load(model.state_dict(), checkpoint_id=ckpt)
        loaded.append(_cpu({"local": _local_shards(model), "forward": model(x),
                            "saved_forward": _saved_bank(saved, device)(x)}))
    return loaded


@dataclasses.dataclass
class _Run:
    backend: str
    ckpt: str
    ranks: list[dict]


@pytest.fixture(scope="module", params=BACKENDS)
def two_ranks(request, tmp_path_factory) -> _Run:
    ckpt = str(tmp_path_factory.mktemp(f"nvfp4_dcp_{request.param.replace(':', '_').replace(',', '_')}"))
    # hard_exit: after FSDP2 and DCP, destroy_process_group leaves the gloo group's threads running
    # (5 threads a rank after it, 2 after a plain all_reduce; torch 2.13 CPU), the state in which a
    # rank can abort during interpreter shutdown after saving its result (fp4fuse.launch,
    # _import_dynamo_before_process_groups). One full CPU run of the suite lost this fixture and its
    # 13 tests (twenty-sixth session; the run's output was not kept: the likely cause, not a proven one).
    return _Run(request.param, ckpt, run_on_ranks(_two_rank_suite, 2, ckpt, timeout=TIMEOUT_S,
                                                   backend=request.param, hard_exit=True))


def _rows_of(world: int, rows: int) -> list[slice]:
    """The row range of each rank's shard (torch.chunk, as FSDP2 and DTensor shard)."""
    size = -(-rows // world)
    return [slice(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world)]


def _assert_shards_are_saved_rows(ranks: list[dict], saved: dict[str, NVFP4Tensor], key: str = "local"):
    for fqn, full in saved.items():
        for rank, rows in enumerate(_rows_of(len(ranks), full.shape[0])):
            shard = ranks[rank][key][fqn]
            assert type(shard) is NVFP4Tensor, (fqn, rank)
            if rows.stop > rows.start:  # an empty shard holds no values (its amax is never loaded)
                assert same_payload(shard, full[rows]), (fqn, rank)


def _assert_forward_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


# -- tests ---------------------------------------------------------------------------------------------

def test_fsdp2_forward_equals_unsharded_including_uneven_and_empty_shards(two_ranks):
    for r in two_ranks.ranks:
        for forward in r["forward"]:
            _assert_forward_equal(forward, r["unsharded_forward"])


def test_full_tensor_redistribute_and_full_state_dict_are_the_nvfp4_payload(two_ranks):
    for r in two_ranks.ranks:
        for key in ("full_tensor", "redistribute", "full_state_dict"):
            assert set(r[key]) == set(_fqns()), key
            for fqn, got in r[key].items():
                assert type(got) is NVFP4Tensor and same_payload(got, r["saved"][fqn]), (key, fqn)


def test_full_tensor_refuses_shards_with_different_amax(two_ranks):
    for r in two_ranks.ranks:
        assert "shards carry different amax values" in r["disagreeing"]


def test_fsdp2_never_decodes_a_shard_under_another_ranks_amax(two_ranks):
    """Ranks that copy_ their own quantized rows into their local shards hold different amaxes;
    the unsharded weight took rank 0's for every row (wrong values, silently). Now it decodes to
    NaN; a rank holding zeros (0 under any amax) is no disagreement. Expected: decode64 of each
    rank's own quantized rows."""
    ranks = two_ranks.ranks
    for key in ranks[0]["per_rank_copies"]:
        expected = torch.cat([decode64(r["per_rank_copies"][key]["local"]) for r in ranks])
        for r in ranks:
            for forward in r["per_rank_copies"][key]["forward"]:
                if key[1]:  # rank 1 holds zeros
                    assert torch.equal(forward.double(), expected.to(torch.bfloat16).double()), key
                else:
                    assert torch.isnan(forward).all(), key


def test_state_dict_for_dcp_never_saves_an_empty_shards_amax(two_ranks):
    for r in two_ranks.ranks:
        got = r["empty_shard_split_checkpoint"]
        assert same_payload(got["loaded"], got["saved"])
        assert same_payload(got["read_back"], got["saved"])


def test_dcp_load_same_world_size_lossless(two_ranks):
    """dcp.async_save, then dcp.load into a model built from other weights."""
    saved = two_ranks.ranks[0]["saved"]
    _assert_shards_are_saved_rows(two_ranks.ranks, saved, "reloaded_local")
    for r in two_ranks.ranks:
        _assert_forward_equal(r["reloaded_forward"], r["forward"][0])
        _assert_forward_equal(r["load_state_dict_forward"], r["forward"][0])


def test_dcp_checkpoint_stores_the_logical_tensor_in_row_chunks(two_ranks):
    import torch.distributed.checkpoint as dcp
    md = dcp.FileSystemReader(os.path.join(two_ranks.ckpt, "sync")).read_metadata().state_dict_metadata
    for name, (rows, dtype) in WEIGHTS.items():
        entry = md[f"projs.{name}.weight"]
        assert entry.properties.dtype == dtype and tuple(entry.size) == (rows, K)
        chunks = sorted((c.offsets[0], c.sizes[0]) for c in entry.chunks if c.sizes[0] > 0)
        assert chunks == [(s.start, s.stop - s.start) for s in _rows_of(2, rows) if s.stop > s.start]


@contextlib.contextmanager
def _one_rank_world(backend: str, tmp_path):
    """A 1-rank process group in this process (FSDP2 needs one), destroyed on exit."""
    assert not dist.is_initialized(), "another test left a process group initialized"
    dist.init_process_group(backend, store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("which,sharded", [("sync", False), ("async", True)])
def test_dcp_load_two_ranks_into_one_process(two_ranks, which, sharded, tmp_path):
    """2 -> 1: dcp.load(model.state_dict()) in this process, into a plain model (sync checkpoint)
    and into an FSDP2 model on a 1-rank mesh (async checkpoint)."""
    import torch.distributed.checkpoint as dcp
    device = torch.device("cuda", 0) if "nccl" in two_ranks.backend else torch.device("cpu")
    saved = two_ranks.ranks[0]["saved"]
    x = _x(device)
    with _one_rank_world(two_ranks.backend, tmp_path) if sharded else contextlib.nullcontext():
        model = _Bank(_weights(10, device))
        if sharded:
            _fully_shard(model, device)
        dcp.load(model.state_dict(), checkpoint_id=os.path.join(two_ranks.ckpt, which))
        for fqn, value in _local_shards(model).items() if sharded else model.state_dict().items():
            assert same_payload(value, saved[fqn]), fqn
        _assert_forward_equal(_cpu(model(x)), _cpu(_saved_bank(saved, device)(x)))


def test_dcp_load_refuses_chunks_with_different_amax(two_ranks):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    target = {"w": NVFP4Tensor.from_hp(weight(0, 32, K))}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, checkpoint_id=os.path.join(two_ranks.ckpt, "disagreeing"))
    (error, _), = info.value.failures.values()
    assert isinstance(error, ValueError) and "chunks of this weight carry different amax" in str(error)


def test_dcp_load_two_ranks_into_three(two_ranks):
    """2 -> 3, sync and async checkpoints (TransformerEngine's tests mark DCP resharding an
    expected failure)."""
    if "nccl" in two_ranks.backend and torch.cuda.device_count() < 3:
        pytest.skip("3 ranks on NCCL need 3 GPUs")
    saved = two_ranks.ranks[0]["saved"]
    ckpts = [os.path.join(two_ranks.ckpt, which) for which in ("sync", "async")]
    per_rank = run_on_ranks(_load_on_rank, 3, ckpts, saved, timeout=TIMEOUT_S, backend=two_ranks.backend,
                            hard_exit=True)  # as two_ranks: DCP leaves the group's threads running
    for i in range(len(ckpts)):
        ranks = [loads[i] for loads in per_rank]
        _assert_shards_are_saved_rows(ranks, saved)
        for r in ranks:
            _assert_forward_equal(r["forward"], r["saved_forward"])


def _qlora_reference(initial: dict, world: int) -> tuple[dict, list[float]]:
    """Float64 gradients (step 0) and losses of the QLoRA run: plain tensors, the NVFP4 bases
    decoded by decode64, FSDP2's gradient = the mean over ranks of each rank's gradient."""
    params = {k: (decode64(v) if isinstance(v, NVFP4Tensor) else v.double()) for k, v in initial.items()}
    trainable = [k for k in params if "lora" in k]
    for k in trainable:
        params[k].requires_grad_()
    batches = [tuple(t.double() for t in _qlora_batch(rank, "cpu")) for rank in range(world)]

    def adapted(i: int, x: torch.Tensor) -> torch.Tensor:
        lora = F.linear(F.linear(x, params[f"{i}.lora_a"]), params[f"{i}.lora_b"])
        return F.linear(x, params[f"{i}.weight"]) + lora

    def forward(x: torch.Tensor) -> torch.Tensor:
        return adapted(3, F.linear(torch.tanh(adapted(0, x)), params["2.weight"]))

    losses, grads = [], {}
    for step in range(LORA_STEPS):
        xs = [x.clone().requires_grad_() for x, _ in batches]
        per_rank = [F.mse_loss(forward(x), y) for x, (_, y) in zip(xs, batches)]
        loss = sum(per_rank) / world
        loss.backward()
        if step == 0:
            grads = {k: params[k].grad.clone() for k in trainable}
            grads["x"] = [x.grad * world for x in xs]  # each rank's x.grad is of its own loss
        with torch.no_grad():
            for k in trainable:
                params[k] -= LORA_LR * params[k].grad
                params[k].grad = None
        losses.append(loss.item())
    return grads, losses


def test_qlora_step_under_fsdp2_matches_float64_and_learns(two_ranks):
    ranks = two_ranks.ranks
    grads, losses = _qlora_reference(ranks[0]["qlora"]["initial"], len(ranks))
    for r in ranks:
        q = r["qlora"]
        assert q["frozen_grads_none"]
        for name, ref in grads.items():
            got = q["grads"][name] if name != "x" else q["grads"]["x"]
            ref = ref if name != "x" else ref[r["rank"]]
            atol = 1e-5 * float(ref.abs().max())  # fp32 against float64, relative to the largest entry
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=atol, msg=name)
        torch.testing.assert_close(torch.tensor(q["losses"], dtype=torch.float64),
                                   torch.tensor(losses, dtype=torch.float64), rtol=1e-4, atol=0)
        assert q["losses"][-1] < 0.9 * q["losses"][0], q["losses"]


def test_amax_shared_across_ranks(two_ranks):
    r0, r1 = (r["amax_group"] for r in two_ranks.ranks)
    assert not torch.equal(r0["local_amax"], r1["local_amax"])
    expected = torch.maximum(r0["local_amax"], r1["local_amax"])
    assert torch.equal(r0["amax"], expected) and torch.equal(r1["amax"], expected)
    assert r0["group"] == r1["group"] and isinstance(r0["group"], int)
