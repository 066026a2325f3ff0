"""The randomized differential check's own machinery (``tests/fuzz_fusion.py``, run by hand, not in
CI): the cases cited in tests, the README and ``benchmarks/results/`` must keep their draws, and
the helpers that narrow a difference down must report what they say. No TP model is compiled here."""
from __future__ import annotations

import pytest
import torch

import fuzz_fusion as fuzz

#: (seed, index, device) -> fields of the case as it ran where it is cited
CITED = {
    # tests/test_sp_patterns.py: the bf16 manual norm that lost its eager-rounding marks
    (2, 6, "cpu"): dict(model="tp_llama", dtype="bfloat16", norm="torch_manual", sp=True, async_tp=False,
                        dynamic=True, shapes=((8,), (156,))),
    # tests/test_sp_patterns.py: the LayerNorm at one row per rank
    (2, 37, "cpu"): dict(model="starcoder2", dtype="float32", sp=True, async_tp=False, shapes=((1, 2), (3, 2))),
    # benchmarks/results/2026-11-28-gpu-test-runs.md: the two CUDA differences
    (0, 1, "cuda"): dict(model="llama", dtype="float32", static_scale=True, sp=True, async_tp=True,
                         cudagraphs=False, shapes=((3, 2),)),
    (0, 3, "cuda"): dict(model="qwen2", dtype="float32", sp=True, async_tp=False, cudagraphs=True, shapes=((3, 8),)),
}


@pytest.mark.parametrize("seed, index, device", sorted(CITED))
def test_cited_cases_keep_their_draws(seed, index, device):
    case = fuzz.draw(index, seed, device)
    assert {field: getattr(case, field) for field in CITED[seed, index, device]} == CITED[seed, index, device]


def test_the_fields_added_later_are_drawn_only_from_their_seed():
    early = [fuzz.draw(i, fuzz.FIRST_WEIGHT_FORMAT_SEED - 1) for i in range(40)]
    assert all(c.weight_format == "nvfp4" and not c.bf16_async_tp for c in early)
    assert all(c.sizes == () for c in early if c.model != "tp_llama")
    late = [fuzz.draw(i, fuzz.FIRST_WEIGHT_FORMAT_SEED) for i in range(40)]
    hf = [c for c in late if c.model != "tp_llama"]
    assert {c.weight_format for c in hf} == {"nvfp4", "bf16"} and {c.sizes for c in hf} == {(1,), (2,)}
    assert any(c.bf16_async_tp for c in late) and all(c.async_tp for c in late if c.bf16_async_tp)
    assert not any(c.static_scale for c in hf if c.weight_format == "bf16")


def test_override_sets_fields_from_json_and_names_an_unknown_one():
    case = fuzz.draw(1, 0)
    changed = fuzz._override(case, ["sp=false", "shapes=[[4, 2], [1, 5]]", 'norm="fp4fuse"'])
    assert (changed.sp, changed.shapes, changed.norm) == (False, ((4, 2), (1, 5)), "fp4fuse")
    assert changed.model == case.model and changed.index == case.index
    with pytest.raises(SystemExit, match="no field 'spp'"):
        fuzz._override(case, ["spp=true"])


def test_where_they_differ_counts_elements_rows_and_columns_and_not_shared_nans():
    ref = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    out = ref.clone()
    assert fuzz._where_they_differ(out, ref) == {}
    out[0, 0, 0] = ref[0, 0, 0] = float("nan")
    assert fuzz._where_they_differ(out, ref) == {}
    out[1, 2, 4] += 1.0
    out[0, 1, 6] = float("nan")
    assert fuzz._where_they_differ(out, ref) == {"elements": 2, "rows": [1, 5], "columns": [4, 6]}


def test_same_values_is_bitwise_with_shared_nans_and_needs_one_shape_and_dtype():
    ref = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    ref[1, 3] = float("nan")
    out = ref.clone()
    assert fuzz._same_values(out, ref)
    out[2, 0] = torch.nextafter(out[2, 0], torch.tensor(float("inf")))
    assert not fuzz._same_values(out, ref)
    assert not fuzz._same_values(ref.double(), ref) and not fuzz._same_values(ref[:2], ref[:2].reshape(3, 4))


def _compiled_modules(fn, x):
    return fuzz._calls_and_loaded_modules(lambda: torch.compile(fn)(x), 1)[1]


@torch._inductor.config.patch(fx_graph_cache=False)  # each compile writes its own module: ids differ
def test_compiled_code_comparison_tells_the_same_source_from_another():
    torch._dynamo.reset()
    x = torch.randn(5, 9, generator=torch.Generator().manual_seed(1))
    first = _compiled_modules(lambda t: (t.sin() * 3).sum(-1), x)
    again = _compiled_modules(lambda t: (t.sin() * 3).sum(-1), x)
    other = _compiled_modules(lambda t: (t.cos() * 3).amax(-1), x)
    assert first and again and other
    same = fuzz._compiled_code_comparison(first, again)
    assert same == {"tested_modules": len(first), "reference_modules": len(again), "same_source": True,
                    "configs_differ": []}
    assert fuzz._compiled_code_comparison(first, other)["same_source"] is False
    assert fuzz._compiled_code_comparison(first, [])["reference_modules"] == 0
