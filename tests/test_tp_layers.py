"""fp4fuse.tp: seeded init, NVFP4 linears, norms, the vocab-parallel embedding and the Llama-style
decoder -- single process where no collective is needed, on 2 gloo ranks otherwise.

Expected values never come from fp4fuse's format code or ops: they come from ``nvfp4_oracle`` (the
format table in float64), from float64 math, from ``F.embedding``, or from the same model at TP=1.
Where a comparison is bitwise, the test says why exact equality holds; where it has a tolerance,
the tolerance is the rounding the contract allows.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp4fuse  # noqa: F401  (registers torch.ops.fp4fuse.*)
import nvfp4_oracle as oracle
from dist_utils import run_on_ranks
from fp4fuse.nvfp4.quantizer import NVFP4Quantizer
from fp4fuse.tp import (
    ColumnParallelNVFP4Linear, LlamaConfig, NormImpl, NVFP4Linear, RMSNorm, RowParallelNVFP4Linear, TPGroup,
    TPLlamaModel, VocabParallelEmbedding, quantize_weight, seeded_normal, shard,
)

WORLD = 2
TIMEOUT_S = 300.0
BF16, FP32 = torch.bfloat16, torch.float32
GS = 2.0 ** -3  # a power-of-two global scale: oracle.representable tensors quantize losslessly with it


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _is_encode_gs(gs: torch.Tensor, amax: torch.Tensor) -> bool:
    """``gs`` is ``448 * 6 / amax`` in fp32 to within one ulp (fp4fuse computes ``2688 * (1/amax)``,
    two roundings, as compressed-tensors does)."""
    exact = oracle.encode_gs(amax).double()
    return gs.shape == (1,) and gs.dtype == FP32 and bool((gs.double() - exact).abs() <= exact * 2.0 ** -23)


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


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_quantize_weight_is_the_format_and_shards_like_the_full_weight(dtype):
    w = (torch.randn(37, 96, generator=_gen(1)) * 0.3).to(dtype)
    q, s, gs = quantize_weight(w)
    assert q.shape == (37, 48) and q.dtype == torch.uint8 and s.shape == (37, 6) and s.dtype == torch.float8_e4m3fn
    assert _is_encode_gs(gs, w.double().abs().max())
    assert torch.equal(oracle.dequantize(q, s, gs), oracle.fake_quantize(w, gs))
    # a column shard quantized with the full weight's amax is the full weight's columns 32..63
    q2, s2, gs2 = quantize_weight(w[:, 32:64], w.float().abs().amax())
    assert torch.equal(gs2, gs) and torch.equal(oracle.dequantize(q2, s2, gs), oracle.fake_quantize(w, gs)[:, 32:64])


def _round_product(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ w^T`` in float64 rounded once; exact before rounding for oracle.representable operands."""
    return (x.double().reshape(-1, x.shape[-1]) @ w.double().t()).to(out_dtype).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("out_dtype", [BF16, FP32])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("lead", [(1, 7), (3, 5), (11,), ()], ids=["batch1", "batch3", "2d", "1d"])
def test_nvfp4_linear_is_exact_on_representable_operands(out_dtype, static, lead):
    """Inputs and weights NVFP4 holds exactly (nvfp4_oracle.representable), so quantization loses
    nothing, every product is exact and the float64 sum is exact in any order: the layer's output
    (CPU reference GEMM, rounded once to out_dtype) equals the float64 product rounded once, bit for
    bit, and the bias is one more rounding in out_dtype."""
    g = _gen(2)
    w = oracle.representable(40, 64, GS, g).to(out_dtype)
    x = oracle.representable(int(torch.tensor(lead).prod()), 64, GS, g).reshape(*lead, 64).to(out_dtype)
    bias = torch.randn(40, generator=g).to(out_dtype)
    layer = NVFP4Linear(w, NVFP4Quantizer(), out_dtype, bias=bias, input_global_scale=GS if static else None)
    out = layer(x)
    assert out.shape == (*lead, 40) and out.dtype == out_dtype
    assert torch.equal(out, _round_product(x, w, out_dtype) + bias)


@pytest.mark.parametrize("lead", [(5,), (2, 5)], ids=["2d", "3d"])
def test_nvfp4_linear_takes_non_contiguous_input_as_nn_linear_does(lead):
    """A transposed (non-contiguous) input gives its contiguous copy's output bit for bit, 2-D as 3-D."""
    g = _gen(4)
    layer = NVFP4Linear(torch.randn(24, 64, generator=g), NVFP4Quantizer(), FP32)
    x = torch.randn(*lead[:-1], 64, lead[-1], generator=g).transpose(-1, -2)
    assert not x.is_contiguous()
    assert torch.equal(layer(x), layer(x.contiguous()))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_nvfp4_linear_equals_the_spec_on_random_input(static):
    """Random operands: the expected value fake-quantizes both with the format table
    (nvfp4_oracle) and multiplies in float64. fp4fuse multiplies by ``alpha = 1/(gs_a*gs_w)``
    rounded to fp32 where the reference divides exactly: 1-2 fp32 ulps (rtol 1e-6)."""
    g = _gen(3)
    w = torch.randn(48, 80, generator=g) * 0.2
    x = torch.randn(3, 5, 80, generator=g) * 2
    layer = NVFP4Linear(w, NVFP4Quantizer(), FP32, input_global_scale=oracle.encode_gs(3.0) if static else None)
    gs_w = layer.weight_global_scale
    assert _is_encode_gs(gs_w, w.double().abs().max())
    # the dynamic activation scale is computed as the weight's is (checked above), from x's amax
    gs_x = oracle.encode_gs(3.0) if static else 2688.0 * torch.reciprocal(x.abs().amax().reshape(1))
    expected = oracle.fake_quantize(x.reshape(15, 80), gs_x) @ oracle.fake_quantize(w, gs_w).t()
    torch.testing.assert_close(layer(x), expected.reshape(3, 5, 48).float(), rtol=1e-6, atol=1e-6)


# The norm forms against float64: forms computing in fp32 round once to bf16 (half an ulp, 2**-8
# relative); TORCH_MANUAL rounds each of its 5 ops in the input dtype (5 * 2**-8 < 2.5e-2); fp32
# inputs round a handful of times at 2**-24.
_NORM_RTOL = {(BF16, NormImpl.TORCH_MANUAL): 2.5e-2, BF16: 2.0 ** -8 + 1e-6, FP32: 1e-6}


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("impl", list(NormImpl))
def test_rms_norm_forms_equal_float64(impl, dtype):
    w = seeded_normal(0, "w", (80,), std=0.1, mean=1.0).to(dtype)
    x, r = seeded_normal(0, "x", (9, 80)).to(dtype), seeded_normal(0, "r", (9, 80)).to(dtype)
    norm = RMSNorm(w, 1e-6, impl)
    rtol = _NORM_RTOL.get((dtype, impl), _NORM_RTOL[dtype])

    def reference(inp: torch.Tensor) -> torch.Tensor:
        v = inp.double()
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()

    torch.testing.assert_close(norm(x).double(), reference(x), rtol=rtol, atol=1e-6)
    out, total = norm(x, r)
    assert torch.equal(total, (x.double() + r.double()).to(dtype))  # the sum rounded once to x's dtype
    torch.testing.assert_close(out.double(), reference(total), rtol=rtol, atol=1e-6)


def test_config_errors_name_the_size():
    with pytest.raises(ValueError, match="num_heads = 4 is not divisible by the tensor-parallel size 3"):
        TPLlamaModel(LlamaConfig(num_layers=1, vocab_size=255), TPGroup("g", 3, 0))
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        TPLlamaModel(LlamaConfig(num_layers=1, num_kv_heads=3), TPGroup("g", 1, 0))


def test_row_parallel_rejects_a_block_straddling_two_ranks():
    with pytest.raises(ValueError, match="input features per rank = 40 must be a multiple of 16"):
        RowParallelNVFP4Linear(torch.randn(8, 80), TPGroup("g", 2, 0), NVFP4Quantizer(), FP32)


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


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t.contiguous())
    return out


def _column_checks(group: TPGroup, tp1: TPGroup) -> dict[str, bool]:
    rank, checks = group.rank, {}
    full = (torch.randn(96, 64, generator=_gen(4)) * 0.1).to(BF16)
    bias = torch.randn(96, generator=_gen(5)).to(BF16)
    col = ColumnParallelNVFP4Linear(full, group, NVFP4Quantizer(), BF16, parts=(64, 16, 16), full_bias=bias)
    rows = torch.cat([torch.arange(32 * rank, 32 * rank + 32), 64 + torch.arange(8 * rank, 8 * rank + 8),
                      80 + torch.arange(8 * rank, 8 * rank + 8)])
    gs = col.weight_global_scale
    checks["column_gs_is_the_full_weight's"] = _is_encode_gs(gs, full.double().abs().max())
    checks["column_payload_is_the_full_weight's_rows"] = col.local_parts == (32, 8, 8) and torch.equal(
        oracle.dequantize(col.weight_q, col.weight_scale, gs), oracle.fake_quantize(full, gs)[rows])
    checks["column_bias_is_sharded"] = torch.equal(col.bias, bias[rows])
    # TP=2 vs TP=1: the same codes (full-weight global scale), the same activation codes (the input
    # is replicated, so the dynamic amax is the same) and exact float64 sums per output element
    # (e2m1 x e4m3 products of one tensor's block scales span far fewer than 53 bits): bitwise.
    one = ColumnParallelNVFP4Linear(full, tp1, NVFP4Quantizer(), BF16, parts=(64, 16, 16), full_bias=bias)
    x = torch.randn(3, 5, 64, generator=_gen(6)).to(BF16)
    parts = [p.split(list(col.local_parts), dim=-1) for p in _gather(col(x))]
    gathered = torch.cat([torch.cat([p[i] for p in parts], dim=-1) for i in range(3)], dim=-1)
    checks["column_tp2_equals_tp1"] = torch.equal(gathered, one(x))
    # gather_output with parts: the whole output in the merged weight's row order (q, k, v), as at
    # TP=1 -- not rank by rank (q0 k0 v0 q1 k1 v1), which a plain feature gather would give
    merged = ColumnParallelNVFP4Linear(full, group, NVFP4Quantizer(), BF16, parts=(64, 16, 16), full_bias=bias,
                                       gather_output=True)
    checks["column_gathered_parts_in_weight_order"] = torch.equal(merged(x), one(x))
    # gather_output (colwise_gather_output): every rank returns the whole output, in feature order, and
    # the gather traces without a graph break (fullgraph; torch 2.11's funcol gather along the last
    # dimension broke the graph at every gathered linear)
    whole = ColumnParallelNVFP4Linear(full, group, NVFP4Quantizer(), BF16, full_bias=bias, gather_output=True)
    one_whole = ColumnParallelNVFP4Linear(full, tp1, NVFP4Quantizer(), BF16, full_bias=bias)
    compiled = torch.compile(whole, backend="aot_eager", fullgraph=True)
    for lead in ((3, 5), (7,), ()):
        xg = torch.randn(*lead, 64, generator=_gen(11)).to(BF16)
        expected = one_whole(xg)
        checks[f"column_gathered_{lead}"] = torch.equal(whole(xg), expected)
        checks[f"column_gathered_compiled_{lead}"] = torch.equal(compiled(xg), expected)
    return checks


def _row_checks(group: TPGroup) -> dict[str, bool]:
    """Row-parallel contract on representable operands (exact partial products): each rank's partial
    rounded to fp32, the fp32 sum over ranks, then the bias, bitwise; 3-D inputs, batch 1 and 3."""
    rank, checks = group.rank, {}
    w = oracle.representable(24, 128, GS, _gen(7)).float()
    bias = torch.randn(24, generator=_gen(8))
    row = RowParallelNVFP4Linear(w, group, NVFP4Quantizer(), FP32, full_bias=bias)
    for batch in (1, 3):
        x_local = oracle.representable(batch * 5, 64, GS, _gen(9 + rank)).float().reshape(batch, 5, 64)
        partials = [_round_product(x, w[:, 64 * r:64 * (r + 1)], FP32) for r, x in enumerate(_gather(x_local))]
        out = row(x_local)
        checks[f"row_batch{batch}"] = out.shape == (batch, 5, 24) and torch.equal(out, partials[0] + partials[1] + bias)
    return checks


def _embedding_checks(group: TPGroup) -> dict[str, bool]:
    checks = {}
    table = seeded_normal(0, "embed", (16, 8)).to(BF16)
    emb = VocabParallelEmbedding(table, group)
    ids = torch.tensor([[0, 7, 8, 15, 3], [12, 1, 9, 9, 4], [5, 6, 14, 2, 11]])
    checks["embedding"] = torch.equal(emb(ids), F.embedding(ids, table)) and torch.equal(emb(ids[0]), table[ids[0]])
    compiled = torch.compile(emb, fullgraph=True)
    checks["embedding_compiled"] = torch.equal(compiled(ids), F.embedding(ids, table))
    for bad in (16, -1):
        bad_ids = torch.tensor([[1, bad, 3]])
        try:
            emb(bad_ids)
            checks[f"eager_rejects_{bad}"] = False
        except IndexError as e:
            checks[f"eager_rejects_{bad}"] = "token ids must be in [0, 16)" in str(e) and str(bad) in str(e)
        try:  # compiled: torch._assert_async in the graph (RuntimeError on CPU), no graph break
            compiled(bad_ids)
            checks[f"compiled_rejects_{bad}"] = False
        except RuntimeError as e:
            checks[f"compiled_rejects_{bad}"] = "token ids must be in [0, 16)" in str(e)
    # both ranks raised before the all_reduce, so the group is still in step
    checks["still_in_step"] = torch.equal(emb(ids[:1]), F.embedding(ids[:1], table))
    return checks


def _model_checks(group: TPGroup, tp1: TPGroup) -> dict[str, bool | float]:
    """TPLlamaModel at TP=2 against TP=1, fp32 with a static activation scale: weights and every
    activation quantize identically (full-weight scales, one static scale), so the only difference
    is the rounding of the two row-parallel partials before their sum (fp32, ~1e-7 relative). A
    code flips only when a value sits within that of an e2m1 decision point: measured max relative
    difference 0 to 3e-7 here; a wrong shard, head split or scale is ~1 (bound 1e-4)."""
    cfg = LlamaConfig(num_layers=2, act_global_scale=40.0, dtype=FP32, vocab_size=100, hidden_size=96,
                      intermediate_size=160, num_heads=6, num_kv_heads=2)
    ids = torch.randint(0, 100, (21,), generator=_gen(10))
    out = TPLlamaModel(cfg, group)(ids)
    ref = TPLlamaModel(cfg, tp1)(ids)
    rel = float((out - ref).abs().max() / ref.abs().max())
    outs = _gather(out)
    return {"model_replicated": torch.equal(outs[0], outs[1]), "model_tp2_vs_tp1_rel": rel,
            "model_tp2_equals_tp1": rel < 1e-4}


def _rank_layers() -> dict[str, bool | float]:
    group = TPGroup.from_process_group()
    singles = [dist.new_group([r]) for r in range(WORLD)]
    tp1 = TPGroup.from_process_group(singles[group.rank])
    with torch.no_grad():
        return {**_column_checks(group, tp1), **_row_checks(group), **_embedding_checks(group),
                **_model_checks(group, tp1)}


def test_tp_layers_on_two_ranks():
    for rank, checks in enumerate(run_on_ranks(_rank_layers, WORLD, timeout=TIMEOUT_S)):
        failed = {k: v for k, v in checks.items() if v is False}
        assert not failed, f"rank {rank}: {checks}"
