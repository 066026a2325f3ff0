"""fp4fuse.tp: seeded init, NVFP4 linears, norms, the vocab-parallel embedding and the Llama-style
decoder -- single process where no collective is needed, on 2 gloo ranks otherwise."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp4fuse  # noqa: F401  (registers torch.ops.fp4fuse.*)
from dist_utils import run_on_ranks
from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.nvfp4.quantizer import NVFP4Quantizer
from fp4fuse.tp import (
    ColumnParallelNVFP4Linear, LlamaConfig, NormImpl, NVFP4Linear, RMSNorm, RowParallelNVFP4Linear, TPGroup,
    TPLlamaModel, VocabParallelEmbedding, quantize_weight, seeded_normal, shard,
)

WORLD = 2
TIMEOUT_S = 180.0
BF16 = torch.bfloat16


def _dense_reference(x: torch.Tensor, layer: NVFP4Linear) -> torch.Tensor:
    """What an NVFP4 linear computes: the dequantized activation times the dequantized weight."""
    q, s, gs = layer.act_quantizer.quantize(x)
    a = nvfp4.dequantize_reference(q, s, gs, torch.float64)
    b = nvfp4.dequantize_reference(layer.weight_q, layer.weight_scale, layer.weight_global_scale, torch.float64)
    return (a @ b.t()).to(layer.out_dtype)


# --------------------------------------------------------------------------- single process


def test_seeded_normal_depends_only_on_seed_name_and_shape():
    a = seeded_normal(0, "w", (4, 8))
    assert torch.equal(a, seeded_normal(0, "w", (4, 8)))
    assert not torch.equal(a, seeded_normal(1, "w", (4, 8)))
    assert not torch.equal(a, seeded_normal(0, "v", (4, 8)))
    assert torch.allclose(seeded_normal(0, "w", (4, 8), std=2.0, mean=1.0), 2 * a + 1)


def test_shard_takes_this_ranks_chunk_and_names_what_does_not_divide():
    full = torch.arange(24.0).reshape(6, 4)
    assert torch.equal(shard(full, 0, TPGroup("g", 3, 1), "rows"), full[2:4])
    assert torch.equal(shard(full, 1, TPGroup("g", 2, 1), "cols"), full[:, 2:])
    with pytest.raises(ValueError, match="output features = 6 is not divisible by the tensor-parallel size 4"):
        TPGroup("g", 4, 0).split(6, "output features")


def test_quantize_weight_round_trips_within_nvfp4_error():
    w = seeded_normal(0, "w", (32, 64)).to(BF16)
    q, s, gs = quantize_weight(w)
    assert q.shape == (32, 32) and q.dtype == torch.uint8
    assert s.shape == (32, 4) and s.dtype == torch.float8_e4m3fn
    assert torch.equal(gs, nvfp4.global_scale_from_amax(w.float().abs().amax().reshape(1)))
    back = nvfp4.dequantize_reference(q, s, gs)
    assert (back - w.float()).norm() / w.float().norm() < 0.15


@pytest.mark.parametrize("act", [NVFP4Quantizer(), NVFP4Quantizer(global_scale=50.0)], ids=["dynamic", "static"])
def test_nvfp4_linear_equals_its_dequantized_product(act):
    layer = NVFP4Linear(seeded_normal(0, "w", (48, 64)).to(BF16), act, BF16)
    x = seeded_normal(0, "x", (10, 64)).to(BF16)
    torch.testing.assert_close(layer(x), _dense_reference(x, layer), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("impl", list(NormImpl))
def test_rms_norm_forms_agree(impl):
    w = seeded_normal(0, "w", (64,), std=0.1, mean=1.0).to(BF16)
    x, r = seeded_normal(0, "x", (8, 64)).to(BF16), seeded_normal(0, "r", (8, 64)).to(BF16)
    norm, ref = RMSNorm(w, 1e-6, impl), RMSNorm(w, 1e-6, NormImpl.FP4FUSE)
    torch.testing.assert_close(norm(x), ref(x), rtol=2e-2, atol=2e-2)
    out, total = norm(x, r)
    assert torch.equal(total, x + r)
    torch.testing.assert_close(out, ref(x + r), rtol=2e-2, atol=2e-2)


def test_config_errors_name_the_size():
    with pytest.raises(ValueError, match="num_heads = 4 is not divisible by the tensor-parallel size 3"):
        TPLlamaModel(LlamaConfig(num_layers=1, vocab_size=255), TPGroup("g", 3, 0))
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        TPLlamaModel(LlamaConfig(num_layers=1, num_kv_heads=3), TPGroup("g", 1, 0))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_model_init_is_deterministic():
    cfg = LlamaConfig(num_layers=1)
    state_a = TPLlamaModel(cfg, TPGroup("g", 2, 1)).state_dict()
    state_b = TPLlamaModel(cfg, TPGroup("g", 2, 1)).state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(_bits(state_a[k]), _bits(state_b[k])) for k in state_a)
    other = TPLlamaModel(dataclasses.replace(cfg, seed=1), TPGroup("g", 2, 1)).state_dict()
    assert not torch.equal(other["embed.weight"], state_a["embed.weight"])


# --------------------------------------------------------------------------- 2 gloo ranks


def _rank_layers() -> dict[str, bool]:
    group = TPGroup.from_process_group()
    rank = group.rank
    checks: dict[str, bool] = {}

    full = seeded_normal(0, "qkv", (96, 64)).to(BF16)
    col = ColumnParallelNVFP4Linear(full, group, NVFP4Quantizer(), BF16, parts=(64, 16, 16))
    q, k, v = full.split([64, 16, 16])
    local = torch.cat([q[32 * rank:32 * (rank + 1)], k[8 * rank:8 * (rank + 1)], v[8 * rank:8 * (rank + 1)]])
    checks["column_parts"] = col.local_parts == (32, 8, 8) and torch.equal(col.weight_q, quantize_weight(local, full.float().abs().amax())[0])
    x = seeded_normal(0, "x", (12, 64)).to(BF16)
    checks["column_forward"] = torch.equal(col(x), torch.ops.fp4fuse.mm_fp4(
        *_operands(col, x), BF16))

    row = RowParallelNVFP4Linear(seeded_normal(0, "o", (32, 128)).to(BF16), group, NVFP4Quantizer(), BF16)
    x_local = seeded_normal(rank, "x_local", (12, 64)).to(BF16)
    partial = row.matmul(x_local)
    partials = [torch.empty_like(partial) for _ in range(WORLD)]
    dist.all_gather(partials, partial)
    summed = torch.stack(partials).float().sum(0).to(BF16)
    checks["row_all_reduce"] = torch.equal(torch.as_tensor(row(x_local)), summed)

    table = seeded_normal(0, "embed", (16, 8)).to(BF16)
    emb = VocabParallelEmbedding(table, group)
    ids = torch.tensor([0, 7, 8, 15, 3, 12])
    checks["embedding"] = torch.equal(torch.as_tensor(emb(ids)), F.embedding(ids, table))

    out = torch.as_tensor(TPLlamaModel(LlamaConfig(num_layers=2), group)(torch.arange(24) % 256))
    outs = [torch.empty_like(out) for _ in range(WORLD)]
    dist.all_gather(outs, out)
    checks["model_replicated"] = torch.equal(outs[0], outs[1]) and bool(out.isfinite().all())
    checks["model_shape"] = out.shape == (24, 128) and out.dtype == BF16
    for impl in (NormImpl.TORCH_FUNCTIONAL, NormImpl.TORCH_MANUAL):
        alt = torch.as_tensor(TPLlamaModel(LlamaConfig(num_layers=1, norm_impl=impl, act_global_scale=8.0), group)(
            torch.arange(16)))
        checks[f"model_{impl.value}"] = bool(alt.isfinite().all())
    return checks


def _operands(layer: NVFP4Linear, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, s, gs = layer.act_quantizer.quantize(x)
    return q, layer.weight_q, s, layer.weight_scale, torch.reciprocal(gs * layer.weight_global_scale)


def test_tp_layers_on_two_ranks():
    for rank, checks in enumerate(run_on_ranks(_rank_layers, WORLD, timeout=TIMEOUT_S)):
        assert all(checks.values()), f"rank {rank}: {checks}"
