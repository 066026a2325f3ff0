"""fp4fuse.tp.load_checkpoint: NVFP4 safetensors checkpoints in the ModelOpt and compressed-tensors
layouts, written here by hand, loaded into parallelized HF models at TP=2.

Writing: each planned linear's weight is quantized with fp4fuse's reference quantizer (global
scale ``448 * 6 / amax``) and stored under the layout's names and conventions as their exporters
write them (tests/test_checkpoint.py's ``_write``: ModelOpt ``weight_scale_2`` / ``input_scale``
= ``1 / gs``, the decode convention ``amax / (448 * 6)``; compressed-tensors ``weight_global_scale``
/ ``input_global_scale`` = ``gs``); embeddings, norms, biases and the LM head in bf16.

Expected value: the HF model in float64 built from the file alone (nvfp4_oracle's decoder applied to
the stored codes and block scales with the file's own dequantization rule: ModelOpt
``code * s * weight_scale_2``, compressed-tensors ``code * s / weight_global_scale``; the stored
input scales, or dynamic ones), never from the loader. The loaded TP=2 model differs from it only by
fp32 roundings (same argument and bound as tests/test_parallelize.py: measured ~2e-7, bound 2e-3;
a misread layout or convention is off by 0.2 or more).
"""
from __future__ import annotations

import json
import logging
import pathlib

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="the test extra installs transformers (pip install -e '.[test]')")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="the test extra installs safetensors")

import fp4fuse  # noqa: E402,F401
import hf_tiny  # noqa: E402
import nvfp4_oracle as oracle  # noqa: E402
from dist_utils import run_on_ranks  # noqa: E402
from fp4fuse.nvfp4 import format as nvfp4  # noqa: E402
from fp4fuse.nvfp4.quantizer import NVFP4Quantizer  # noqa: E402
from fp4fuse.tp import ColumnParallelNVFP4Linear, NVFP4Linear, TPGroup, WeightFormat, parallelize  # noqa: E402
from fp4fuse.tp.checkpoint import load_checkpoint  # noqa: E402

WORLD = 2
TIMEOUT_S = 400.0
QUANTIZED = 2e-3
EXACT_SPLIT_SUM = 1e-5
MODELOPT, COMPRESSED = "modelopt", "compressed-tensors"


# --------------------------------------------------------------------------- writing by hand


def _swizzle(s: torch.Tensor) -> torch.Tensor:
    """Linear ``[M, C]`` e4m3 -> the padded 128x4 layout, from docs/design.md's offset formula."""
    m, c = s.shape
    mp, cp = -(-m // 128) * 128, -(-c // 4) * 4
    r, k = torch.meshgrid(torch.arange(m), torch.arange(c), indexing="ij")
    offset = ((r // 128 * (cp // 4) + k // 4) * 32 + r % 32) * 16 + (r % 128) // 32 * 4 + k % 4
    out = torch.zeros(mp * cp, dtype=torch.uint8)
    out[offset.flatten()] = s.view(torch.uint8).flatten()
    return out.reshape(mp, cp).view(torch.float8_e4m3fn)


def _unswizzle(raw: torch.Tensor, m: int, c: int) -> torch.Tensor:
    cp = -(-c // 4) * 4
    r, k = torch.meshgrid(torch.arange(m), torch.arange(c), indexing="ij")
    offset = ((r // 128 * (cp // 4) + k // 4) * 32 + r % 32) * 16 + (r % 128) // 32 * 4 + k % 4
    return raw.view(torch.uint8).flatten()[offset].view(torch.float8_e4m3fn)


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gs = oracle.encode_gs(w.double().abs().max())
    q, s = nvfp4.quantize_reference(w.float(), gs)
    return q, s, gs


def _nvfp4_entries(module: str, w: torch.Tensor, layout: str, input_gs: float | None, swizzle: bool) -> dict:
    q, s, gs = _quantize(w)
    s = _swizzle(s) if swizzle else s
    decode = (1.0 / gs.double()).float()
    if layout == MODELOPT:  # scalars, decode convention amax / (448 * 6)
        out = {f"{module}.weight": q, f"{module}.weight_scale": s, f"{module}.weight_scale_2": decode.reshape(())}
        if input_gs is not None:
            out[f"{module}.input_scale"] = torch.tensor(1.0 / input_gs, dtype=torch.float64).float()
        return out
    out = {f"{module}.weight_packed": q, f"{module}.weight_scale": s, f"{module}.weight_global_scale": gs}
    if input_gs is not None:
        out[f"{module}.input_global_scale"] = torch.tensor([input_gs], dtype=torch.float32)
    return out


def _write(model: nn.Module, path: pathlib.Path, layout: str | None, input_scales: dict[str, float] | None,
           swizzle: bool = False, files: int = 1) -> pathlib.Path:
    """``layout`` None writes the model unquantized (bf16). Returns the file or directory to load."""
    planned = hf_tiny.planned()
    tensors: dict[str, torch.Tensor] = {}
    tied = hf_tiny.ties_lm_head(model)
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":  # stored once, as the input embedding (what HF writes)
            continue
        module, _, attr = name.rpartition(".")
        if layout is not None and module in planned and attr == "weight":
            tensors.update(_nvfp4_entries(module, t, layout, None if input_scales is None else input_scales[module],
                                          swizzle))
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    if layout == MODELOPT:  # a KV-cache scale fp4fuse does not use: reported, not fatal
        tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    path.mkdir(parents=True)
    if files == 1:
        safetensors_torch.save_file(tensors, path / "model.safetensors")
        return path / "model.safetensors"
    names = sorted(tensors)
    weight_map = {n: f"model-{i % files:05d}-of-{files:05d}.safetensors" for i, n in enumerate(names)}
    for file in set(weight_map.values()):
        safetensors_torch.save_file({n: tensors[n] for n in names if weight_map[n] == file}, path / file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _read_all(path: pathlib.Path) -> dict[str, torch.Tensor]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    return {k: v for f in files for k, v in safetensors_torch.load_file(f).items()}


def _reference(kind: str, path: pathlib.Path, layout: str | None, tp: int) -> nn.Module:
    """The float64 model the file describes (see the module docstring), built from the file alone."""
    stored = _read_all(path)
    model = hf_tiny.build(kind, seed=99)
    planned = hf_tiny.planned()
    quantized = {f"{m}.weight" for m in planned} if layout is not None else set()
    plain = {k: v.float() for k, v in stored.items() if k in model.state_dict() and k not in quantized}
    missing, _ = model.load_state_dict(plain, strict=False)
    assert set(missing) - ({"lm_head.weight"} if hf_tiny.ties_lm_head(model) else set()) == quantized
    if layout is None:
        return model.double()
    weights, input_scales = {}, {}
    for m in planned:
        n, k = model.get_submodule(m).weight.shape
        codes = stored[f"{m}.weight" if layout == MODELOPT else f"{m}.weight_packed"]
        s = stored[f"{m}.weight_scale"]
        s = _unswizzle(s, n, k // 16) if s.shape != (n, k // 16) else s
        if layout == MODELOPT:
            weights[m] = oracle.dequantize(codes, s, 1.0) * float(stored[f"{m}.weight_scale_2"])
            scale = stored.get(f"{m}.input_scale")
            input_scales[m] = None if scale is None else 1.0 / float(scale)
        else:
            weights[m] = oracle.dequantize(codes, s, stored[f"{m}.weight_global_scale"])
            scale = stored.get(f"{m}.input_global_scale")
            input_scales[m] = None if scale is None else float(scale)
    static = None if any(v is None for v in input_scales.values()) else input_scales
    return hf_tiny.nvfp4_reference(model, weights, static, tp)


# --------------------------------------------------------------------------- 2 gloo ranks

CASES = {
    # name: (model, layout, static input scales, swizzled block scales, files)
    "llama-modelopt": ("llama", MODELOPT, True, False, 1),
    "qwen2-compressed-tensors-2-files": ("qwen2", COMPRESSED, True, False, 2),
    "llama-compressed-tensors-swizzled-dynamic": ("llama", COMPRESSED, False, True, 1),
    "qwen2-unquantized-into-bf16": ("qwen2", None, False, False, 1),
    # the LM head tied to the input embedding: the file holds the embedding only
    "llama-tied-modelopt": ("llama-tied", MODELOPT, True, False, 1),
}


def _rank_load(paths: dict[str, str]) -> dict[str, dict]:
    out = {}
    for case, path in paths.items():
        kind, layout = CASES[case][:2]
        fmt = WeightFormat.NVFP4 if layout is not None else WeightFormat.BF16
        model = parallelize(hf_tiny.build(kind, seed=5), weight_format=fmt)   # other random weights, replaced
        report = load_checkpoint(model, path)
        out[case] = {"report": report, **{f"batch{b}": hf_tiny.logits(model, hf_tiny.token_ids(b)) for b in (1, 3)}}
    return out


def test_checkpoints_load_at_tp2_and_equal_the_model_the_file_describes(tmp_path):
    paths = {}
    for case, (kind, layout, static, swizzle, files) in CASES.items():
        model = hf_tiny.build(kind)
        scales = hf_tiny.calibrate(model, hf_tiny.token_ids(3)) if static else None
        paths[case] = str(_write(model, tmp_path / case, layout, scales, swizzle, files))
    results = run_on_ranks(_rank_load, WORLD, paths, timeout=TIMEOUT_S)
    for case, path in paths.items():
        kind, layout = CASES[case][:2]
        reference = _reference(kind, pathlib.Path(path), layout, WORLD)
        bound = QUANTIZED if layout is not None else EXACT_SPLIT_SUM
        for rank, result in enumerate(results):
            report = result[case]["report"]
            assert len(report.nvfp4_linears if layout else report.dense_linears) == len(hf_tiny.planned())
            assert len(report.static_input_scales) == (len(hf_tiny.planned()) if CASES[case][2] else 0)
            assert report.unexpected == (["model.layers.0.self_attn.k_proj.k_scale"] if layout == MODELOPT else [])
            for batch in (1, 3):
                err = hf_tiny.rel_error(result[case][f"batch{batch}"], hf_tiny.logits(reference, hf_tiny.token_ids(batch)))
                assert err < bound, f"{case}, rank {rank}, batch {batch}: relative error {err:.3g} >= {bound}"


# --------------------------------------------------------------------------- single process


class _Tiny(nn.Module):
    """An NVFP4 linear and a norm weight, no process group needed."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = NVFP4Linear(torch.randn(32, 48), NVFP4Quantizer(), torch.float32)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(48))


def _tiny_file(tmp_path: pathlib.Path, **overrides: torch.Tensor | None) -> pathlib.Path:
    tensors = {**_nvfp4_entries("proj", torch.randn(32, 48), COMPRESSED, 50.0, False), "norm.weight": torch.ones(48)}
    for key, value in overrides.items():
        key = key.replace("__", ".")
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    path = tmp_path / "tiny.safetensors"
    safetensors_torch.save_file(tensors, path)
    return path


@pytest.mark.parametrize("overrides, error", [
    ({"norm__weight": None}, r"lacks 1 tensors of the model: \['norm.weight'\]"),
    ({"proj__weight_packed": torch.zeros(32, 20, dtype=torch.uint8)},
     r"proj.weight_packed has shape \[32, 20\], expected \[32, 24\]"),
    ({"proj__weight_global_scale": torch.tensor([0.0])}, r"proj.weight_global_scale must hold finite global scales > 0"),
    ({"proj__input_global_scale": torch.tensor([float("inf")])}, "proj.input_global_scale must hold finite"),
    ({"proj__weight_global_scale": None, "proj__weight_packed": None, "proj__weight_scale": None,
      "proj__weight": torch.randn(32, 48)}, "holds no NVFP4 payload for it"),
    # a ModelOpt-style FP8 tensor outside the NVFP4 linears would otherwise load as raw codes cast to the
    # model's dtype (448 where the values are about 1)
    ({"norm__weight": torch.ones(48).to(torch.float8_e4m3fn)}, r"norm.weight is torch.float8_e4m3fn; .* takes one of"),
    ({"norm__weight": torch.ones(48, dtype=torch.int8)}, r"norm.weight is torch.int8"),
], ids=["missing", "shape", "zero-scale", "inf-input-scale", "unquantized", "fp8-plain", "int8-plain"])
def test_bad_checkpoints_are_clear_errors(tmp_path, overrides, error):
    with pytest.raises(ValueError, match=error):
        load_checkpoint(_Tiny(), _tiny_file(tmp_path, **overrides))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_linear_loads_its_payload_bitwise(tmp_path, device):
    path = _tiny_file(tmp_path)
    stored = _read_all(path)
    with torch.device(device):
        model = _Tiny()
    report = load_checkpoint(model, path)   # tensors on meta are replaced, on CPU
    assert report.nvfp4_linears == ["proj"] and report.static_input_scales == ["proj"] and report.tensors == ["norm.weight"]
    assert torch.equal(model.proj.weight_q, stored["proj.weight_packed"])
    assert torch.equal(model.proj.weight_scale.view(torch.uint8), stored["proj.weight_scale"].view(torch.uint8))
    assert torch.equal(model.proj.weight_global_scale, stored["proj.weight_global_scale"])
    assert torch.equal(model.proj.input_global_scale, torch.tensor([50.0]))
    assert torch.equal(model.norm.weight, stored["norm.weight"]) and model.norm.weight.device.type == "cpu"


@pytest.mark.parametrize("ratios, exact", [((1.0, 1.0, 1.0), True), ((1.0, 4.0, 2.0), True), ((1.0, 1.7, 1.3), False)],
                         ids=["equal", "powers-of-two", "other"])
def test_merged_parts_with_their_own_global_scales_are_requantized(tmp_path, caplog, ratios, exact):
    """A merged q/k/v weight whose parts carry their own ModelOpt ``weight_scale_2`` (part i
    quantized with ``gs / ratio_i``): the loaded payload decodes to each part's own dequantization
    exactly when the scales agree or differ by a power of two, else within half an e4m3 step
    (2**-4 relative) of each block, with a warning."""
    parts = (64, 32, 32)
    w = torch.randn(128, 48, generator=torch.Generator().manual_seed(11))
    gs = oracle.encode_gs(w.double().abs().max())
    codes, scales, decode = [], [], []
    for part, ratio in zip(w.split(list(parts)), ratios):
        q, s = nvfp4.quantize_reference(part, gs / ratio)
        codes.append(q), scales.append(s), decode.append(float(ratio / gs.double()))
    stored = {"qkv.weight": torch.cat(codes), "qkv.weight_scale": torch.cat(scales),
              "qkv.weight_scale_2": torch.tensor(decode, dtype=torch.float32)}
    path = tmp_path / "merged.safetensors"
    safetensors_torch.save_file(stored, path)
    file_weight = torch.cat([oracle.dequantize(q, s, 1.0) * float(torch.tensor(d, dtype=torch.float32))
                             for q, s, d in zip(codes, scales, decode)])
    for rank in range(WORLD):
        model = nn.Module()
        model.qkv = ColumnParallelNVFP4Linear(w, TPGroup("g", WORLD, rank), NVFP4Quantizer(), torch.float32, parts=parts)
        with caplog.at_level(logging.WARNING, logger="fp4fuse.tp.checkpoint_layouts"):
            load_checkpoint(model, path)
        rows = torch.cat([torch.arange(32 * rank, 32 * rank + 32), 64 + torch.arange(16 * rank, 16 * rank + 16),
                          96 + torch.arange(16 * rank, 16 * rank + 16)])
        loaded = oracle.dequantize(model.qkv.weight_q, model.qkv.weight_scale, model.qkv.weight_global_scale)
        expected = file_weight[rows]
        # 1 / weight_scale_2 rounds to fp32 once: the weights agree to that (2**-23), not bitwise
        rel = ((loaded - expected).abs() / expected.abs().clamp_min(1e-30)).where(expected != 0, loaded.abs())
        assert float(rel.max()) <= (2.0 ** -22 if exact else 2.0 ** -4 + 2.0 ** -22)
    assert ("requantized to the common scale" in caplog.text) is not exact


# --------------------------------------------------------------------------- payloads that would load as something else


@pytest.mark.parametrize("overrides, error", [
    # ModelOpt's decode-convention name beside compressed-tensors' encode one: which is meant is a guess, and
    # the wrong guess is off by 1 / gs**2 (the ModelOpt scale was taken, the rest reported as unused)
    ({"proj__weight_scale_2": torch.tensor(1.0 / 600.0)}, r"proj has tensors of both NVFP4 layouts"),
    # a per-channel static input scale: one activation tensor takes one scale (the smallest gs was taken)
    ({"proj__input_global_scale": torch.linspace(40.0, 60.0, 48)}, r"proj.input_global_scale holds 48 input scales"),
    # raw bits stored as integers were read as values (e.g. an e4m3 byte 0x38 = 1.0 as 56)
    ({"proj__weight_global_scale": torch.tensor([56], dtype=torch.uint8)},
     r"proj.weight_global_scale is torch.uint8; a global scale must be stored as a floating value"),
    ({"proj__input_global_scale": torch.tensor([50], dtype=torch.int32)}, r"proj.input_global_scale is torch.int32"),
    # the checkpoint's layer adds a bias the model's layer lacks: it was dropped with only a warning
    ({"proj__bias": torch.ones(32)}, r"the checkpoint has 'proj.bias' but the model's proj has no bias"),
    # a decode scale whose inverse overflows fp32: the error names the checkpoint tensor
    ({"proj__weight_packed": None, "proj__weight_global_scale": None, "proj__input_global_scale": None,
      "proj__weight": torch.zeros(32, 24, dtype=torch.uint8), "proj__weight_scale_2": torch.tensor(1e-41)},
     r"proj.weight_scale_2 = .* is out of fp32 range"),
], ids=["both-layouts", "per-channel-input-scale", "u8-global-scale", "int-input-scale", "unused-bias",
        "decode-scale-overflows"])
def test_payloads_that_would_load_as_something_else_are_errors(tmp_path, overrides, error):
    with pytest.raises(ValueError, match=error):
        load_checkpoint(_Tiny(), _tiny_file(tmp_path, **overrides))


def test_merged_layer_takes_one_input_scale_per_part_and_the_largest_amax(tmp_path):
    """One input scale per merged part still loads (the smallest encode-convention scale, i.e. the
    largest amax, from the file's values), and two scales for three parts is an error."""
    w = torch.randn(128, 48, generator=torch.Generator().manual_seed(3))
    q, s, gs = _quantize(w)
    stored = {"qkv.weight": q, "qkv.weight_scale": s, "qkv.weight_scale_2": (1.0 / gs.double()).float().reshape(()),
              "qkv.input_scale": torch.tensor([0.01, 0.04, 0.02])}
    safetensors_torch.save_file(stored, tmp_path / "qkv.safetensors")
    model = nn.Module()
    model.qkv = ColumnParallelNVFP4Linear(w, TPGroup("g", WORLD, 1), NVFP4Quantizer(), torch.float32, parts=(64, 32, 32))
    load_checkpoint(model, tmp_path / "qkv.safetensors")
    assert float(model.qkv.input_global_scale) == pytest.approx(1.0 / float(torch.tensor(0.04)), rel=2.0 ** -23)
    stored["qkv.input_scale"] = torch.tensor([0.01, 0.04])
    safetensors_torch.save_file(stored, tmp_path / "qkv2.safetensors")
    with pytest.raises(ValueError, match=r"qkv.input_scale holds 2 input scales; qkv takes one per tensor or one per merged part \(3\)"):
        load_checkpoint(model, tmp_path / "qkv2.safetensors")
