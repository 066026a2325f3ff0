"""``load_checkpoint``: a safetensors checkpoint (NVFP4 in the ModelOpt or compressed-tensors
layout, or unquantized) into a model that ``parallelize`` put on TP, each rank reading its slice.

    model = parallelize(AutoModelForCausalLM.from_config(config))   # random weights, replaced below
    report = load_checkpoint(model, "/path/to/nvfp4-checkpoint")     # on every rank

What each module reads (names as the model spells them, e.g. ``model.layers.0.mlp.up_proj``):

* NVFP4 linears (fp4fuse.tp.linear): codes, block scales, weight global scale and, when present,
  the input global scale of ``<name>`` in either layout (fp4fuse.tp.checkpoint_layouts; detected
  per module by its tensor names), scales converted to fp4fuse's encode convention. A
  column-parallel rank reads its output rows of every merged part, a row-parallel rank its input
  columns (``K / size`` is a multiple of 16, so whole bytes of codes and whole block scales). The
  global scales are per tensor, read whole by every rank: every shard keeps the full weight's
  scale. A checkpoint input scale becomes the layer's static ``input_global_scale`` buffer; without
  one the layer keeps what it had (dynamic by default).
* Model-dtype TP linears (fp4fuse.tp.dense): ``<name>.weight`` / ``.bias`` sliced the same way.
* Everything else in the state_dict (embeddings, norms, LM head): read whole, cast to the model
  tensor's dtype; tied tensors (an LM head sharing the embedding) are read once. A model whose
  config ties its word embeddings (``tie_word_embeddings``: Llama 3.2 1B/3B, small Qwen3, Gemma 3)
  stores only the input embedding; where ``parallelize`` sharded that embedding the LM head keeps
  a whole table of its own, read from the input embedding's tensor.

Missing tensors, shapes that do not match, scales that are not finite and > 0 (also once converted
to fp32 encode-convention values), global / input scales stored as integers (raw bits, not values),
an input scale that is neither per tensor nor one per merged part, a module holding both layouts'
names (with ``layout`` not given), a checkpoint bias for a linear without one, an NVFP4 layer
whose checkpoint entry is unquantized and a quantized (FP8, integer) entry for a floating tensor
outside the NVFP4 linears are errors naming the tensor. Tensors nothing read are
returned in the report (and logged).
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib

import torch
from torch import nn

from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.tp.checkpoint_layouts import (
    LAYOUT_NAMES, BlockScaleLayout, CheckpointLayout, LayoutNames, encode_global_scales, merge_part_scales,
)
from fp4fuse.tp.dense import ColumnParallelLinear, RowParallelLinear
from fp4fuse.tp.layers import VocabParallelEmbedding
from fp4fuse.tp.linear import ColumnParallelNVFP4Linear, NVFP4Linear, RowParallelNVFP4Linear
from fp4fuse.tp.safetensors_files import CheckpointFiles

__all__ = ["LoadReport", "load_checkpoint", "tied_word_embedding_keys"]

logger = logging.getLogger(__name__)

Range = tuple[int, int]
#: Dtypes of unquantized checkpoint tensors.
_UNQUANTIZED = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
#: Tensor names (relative to the module) only one NVFP4 layout uses.
_DISTINCT_NAMES = {CheckpointLayout.MODELOPT: ("weight_scale_2", "input_scale"),
                   CheckpointLayout.COMPRESSED_TENSORS: ("weight_packed", "weight_global_scale", "input_global_scale")}


@dataclasses.dataclass
class LoadReport:
    """``nvfp4_linears``: modules loaded from an NVFP4 payload (``static_input_scales``: those that
    got a static input scale); ``dense_linears``: model-dtype TP linears; ``tensors``: other state
    read whole; ``unexpected``: checkpoint tensors nothing read."""

    nvfp4_linears: list[str] = dataclasses.field(default_factory=list)
    static_input_scales: list[str] = dataclasses.field(default_factory=list)
    dense_linears: list[str] = dataclasses.field(default_factory=list)
    tensors: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Slice:
    """What one rank holds of a ``[full_rows, full_cols]`` linear: row ranges (one per merged part,
    in order) and one column range, in elements."""

    full_rows: int
    full_cols: int
    rows: tuple[Range, ...]
    cols: Range

    @property
    def part_rows(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.rows)


def _slice_of(layer: nn.Module) -> _Slice:
    rows_local, cols_local = layer.out_features, layer.in_features
    if isinstance(layer, (ColumnParallelNVFP4Linear, ColumnParallelLinear)):
        group = layer.group
        local_parts = getattr(layer, "local_parts", (rows_local,))
        ranges, offset = [], 0
        for local in local_parts:
            ranges.append((offset + group.rank * local, offset + (group.rank + 1) * local))
            offset += local * group.size
        return _Slice(offset, cols_local, tuple(ranges), (0, cols_local))
    if isinstance(layer, (RowParallelNVFP4Linear, RowParallelLinear)):
        rank, size = layer.group.rank, layer.group.size
        return _Slice(rows_local, cols_local * size, ((0, rows_local),), (rank * cols_local, (rank + 1) * cols_local))
    return _Slice(rows_local, cols_local, ((0, rows_local),), (0, cols_local))


def _scaled(r: Range, divisor: int) -> Range:
    return r[0] // divisor, r[1] // divisor


class _Loader:
    def __init__(self, files: CheckpointFiles, layout: CheckpointLayout | None,
                 block_scale_layout: BlockScaleLayout | None, device: torch.device | None) -> None:
        self.files, self.layout, self.block_scale_layout, self.device = files, layout, block_scale_layout, device
        self.read_names: set[str] = set()
        self.report = LoadReport()

    # -- reading -------------------------------------------------------------------------------

    def _expect(self, key: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], what: str) -> None:
        if key not in self.files:
            raise ValueError(f"load_checkpoint: the checkpoint has no {key!r} ({what})")
        got = self.files.shape(key)
        if got != shape:
            raise ValueError(f"load_checkpoint: {key} has shape {list(got)}, expected {list(shape)} ({what})")
        dtype = self.files.dtype(key)
        if dtype not in dtypes:
            raise ValueError(f"load_checkpoint: {key} is {dtype}, expected one of {dtypes} ({what})")

    def _rows(self, key: str, rows: tuple[Range, ...], cols: Range | None) -> torch.Tensor:
        self.read_names.add(key)
        return torch.cat([self.files.read(key, r, cols) for r in rows])

    def _whole(self, key: str) -> torch.Tensor:
        self.read_names.add(key)
        return self.files.read(key)

    # -- NVFP4 linears ------------------------------------------------------------------------

    def _layout_names(self, name: str) -> LayoutNames:
        if self.layout is not None:
            return LAYOUT_NAMES[self.layout]
        present = {layout: sorted(f"{name}.{n}" for n in _DISTINCT_NAMES[layout] if f"{name}.{n}" in self.files)
                   for layout in CheckpointLayout}
        if all(present.values()):  # which codes, which convention? (inverse conventions: a guess is 1/x off)
            raise ValueError(f"load_checkpoint: {name} has tensors of both NVFP4 layouts "
                             f"({'; '.join(f'{k.value}: {v}' for k, v in present.items())}); a module's payload "
                             f"must use one layout's names, or pass load_checkpoint(..., layout=...)")
        for layout in CheckpointLayout:
            names = LAYOUT_NAMES[layout]
            if f"{name}.{names.weight_global_scale}" in self.files:
                return names
        found = sorted(k for k in self.files.names() if k.startswith(f"{name}."))
        raise ValueError(f"load_checkpoint: {name} is an NVFP4 linear but the checkpoint holds no NVFP4 payload "
                         f"for it (neither weight_scale_2 nor weight_global_scale; found {found}); an unquantized "
                         f"layer loads into parallelize(..., weight_format=WeightFormat.BF16)")

    def _block_scales(self, key: str, sl: _Slice) -> torch.Tensor:
        rows, cols = sl.full_rows, sl.full_cols // nvfp4.BLOCK_SIZE
        swizzled_shape = nvfp4.swizzled_shape(rows, cols)
        layout = self.block_scale_layout
        if layout is None:
            layout = BlockScaleLayout.SWIZZLED if self.files.shape(key) == swizzled_shape != (rows, cols) \
                else BlockScaleLayout.LINEAR
        dtypes = (torch.float8_e4m3fn, torch.uint8)
        if layout is BlockScaleLayout.LINEAR:
            self._expect(key, (rows, cols), dtypes, "linear e4m3 block scales [N, K/16]")
            s = self._rows(key, sl.rows, _scaled(sl.cols, nvfp4.BLOCK_SIZE))
        else:  # 128x4 tiles interleave rows and columns: read whole, unswizzle, then slice
            self._expect(key, swizzled_shape, dtypes, "swizzled 128x4 e4m3 block scales")
            full = nvfp4.unswizzle_scales(self._whole(key).view(torch.uint8), rows, cols)
            c0, c1 = _scaled(sl.cols, nvfp4.BLOCK_SIZE)
            s = torch.cat([full[r0:r1, c0:c1] for r0, r1 in sl.rows])
        return s.view(torch.float8_e4m3fn).contiguous()

    def _global_scales(self, key: str, names: LayoutNames) -> torch.Tensor:
        dtype = self.files.dtype(key)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):  # U8 / I32: raw bits, not values
            raise ValueError(f"load_checkpoint: {key} is {dtype}; a global scale must be stored as a floating "
                             f"value (F32, F16, BF16, F64)")
        return encode_global_scales(self._whole(key), names.convention, key)

    def nvfp4_linear(self, name: str, layer: NVFP4Linear) -> None:
        names, sl = self._layout_names(name), _slice_of(layer)
        if sl.full_cols % 2 or any(c % nvfp4.BLOCK_SIZE for c in sl.cols):
            raise ValueError(f"load_checkpoint: {name}: input columns {sl.cols} do not fall on 16-element blocks")
        weight_key = f"{name}.{names.weight}"
        self._expect(weight_key, (sl.full_rows, sl.full_cols // 2), (torch.uint8,), "packed e2m1 codes [N, K/2]")
        q = self._rows(weight_key, sl.rows, _scaled(sl.cols, 2))
        s = self._block_scales(f"{name}.{names.block_scale}", sl)
        gs_key = f"{name}.{names.weight_global_scale}"
        gs = self._global_scales(gs_key, names)
        if gs.numel() > 1:
            s, gs = merge_part_scales(s, sl.part_rows, gs, gs_key)
        device = (self.device or torch.device("cpu")) if layer.weight_q.device.type == "meta" else layer.weight_q.device
        layer.load_quantized_weight(q.contiguous().to(device), s.to(device), gs.to(device))
        self._bias(name, layer, sl, layer.out_dtype)
        input_key = f"{name}.{names.input_global_scale}"
        if input_key in self.files:
            scales = self._global_scales(input_key, names)
            if scales.numel() not in (1, len(sl.part_rows)):  # one activation, one scale: not per channel
                raise ValueError(f"load_checkpoint: {input_key} holds {scales.numel()} input scales; {name} takes one "
                                 f"per tensor or one per merged part ({len(sl.part_rows)})")
            if bool((scales != scales.min()).any()):
                logger.warning("load_checkpoint: %s holds different input scales %s for merged parts; using the "
                               "largest amax", input_key, scales.tolist())
            layer.set_input_global_scale(scales.min())
            self.report.static_input_scales.append(name)
        self.report.nvfp4_linears.append(name)

    def _bias(self, name: str, layer: nn.Module, sl: _Slice, dtype: torch.dtype) -> None:
        key = f"{name}.bias"
        if layer.bias is None:
            if key in self.files:  # the checkpoint's layer adds it; this one would silently not
                raise ValueError(f"load_checkpoint: the checkpoint has {key!r} but the model's {name} has no bias")
            return
        self._expect(key, (sl.full_rows,), _UNQUANTIZED, "bias [N]")
        bias = self._rows(key, sl.rows, None).to(dtype)
        if isinstance(layer, NVFP4Linear):
            layer.set_bias(bias)
        else:
            self._assign(layer, "bias", bias)

    # -- model-dtype TP linears and plain state -----------------------------------------------

    def dense_linear(self, name: str, layer: nn.Module) -> None:
        sl, key = _slice_of(layer), f"{name}.weight"
        self._expect(key, (sl.full_rows, sl.full_cols), _UNQUANTIZED,
                     "an unquantized weight [N, K] (an NVFP4 checkpoint loads into WeightFormat.NVFP4 layers)")
        self._assign(layer, "weight", self._rows(key, sl.rows, sl.cols).to(layer.weight.dtype))
        self._bias(name, layer, sl, layer.weight.dtype)
        self.report.dense_linears.append(name)

    def vocab_embedding(self, name: str, layer: VocabParallelEmbedding) -> None:
        """This rank's rows ``[vocab_start, vocab_end)`` of the full embedding table."""
        key = f"{name}.weight"
        self._expect(key, (layer.num_embeddings, layer.weight.shape[1]),
                     _UNQUANTIZED, "an embedding table [vocab, hidden]")
        rows = self._rows(key, ((layer.vocab_start, layer.vocab_end),), None)
        self._assign(layer, "weight", rows.to(layer.weight.dtype))
        self.report.tensors.append(key)

    def _assign(self, module: nn.Module, attr: str, value: torch.Tensor) -> None:
        """Copy into ``module.attr`` in place (ties survive), or replace it where it is on meta."""
        current = getattr(module, attr)
        if tuple(current.shape) != tuple(value.shape):
            raise ValueError(f"load_checkpoint: {type(module).__name__}.{attr} has shape {list(current.shape)}, "
                             f"the checkpoint gives {list(value.shape)}")
        if current.device.type != "meta":
            with torch.no_grad():
                current.copy_(value)
            return
        value = value.to(device=self.device or "cpu", dtype=current.dtype)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value, requires_grad=current.requires_grad)
        else:
            module._buffers[attr] = value

    def _expect_plain(self, key: str, module: nn.Module, attr: str) -> None:
        """A tensor read whole and cast to the model's dtype must hold values, not codes: a floating
        model tensor takes fp16 / bf16 / fp32 / fp64 only (an FP8 or integer entry, e.g. a
        ModelOpt FP8 LM head with its ``weight_scale``, would load as raw codes), any other one
        exactly its own dtype."""
        want = getattr(module, attr).dtype
        got = self.files.dtype(key)
        allowed = _UNQUANTIZED if want.is_floating_point else (want,)
        if got not in allowed:
            raise ValueError(f"load_checkpoint: {key} is {got}; the model's {type(module).__name__}.{attr} "
                             f"({want}) takes one of {allowed}: quantized tensors load only into fp4fuse's "
                             "NVFP4 linears")

    def plain_state(self, model: nn.Module, skip: set[str]) -> None:
        """Every persistent parameter / buffer outside the TP linears, tied ones read once; a
        tensor the checkpoint lacks is read from the one the model's config ties it to."""
        ties = tied_word_embedding_keys(model)
        owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
        for mod_name, module in model.named_modules(remove_duplicate=False):
            if any(mod_name == s or mod_name.startswith(f"{s}.") for s in skip):
                continue
            persistent = [(k, t) for k, t in module._buffers.items() if k not in module._non_persistent_buffers_set]
            for attr, tensor in [*module._parameters.items(), *persistent]:
                if tensor is not None:
                    key = f"{mod_name}.{attr}" if mod_name else attr
                    owners.setdefault(id(tensor), []).append((key, module, attr))
        missing = []
        for aliases in owners.values():
            found = [key for key, _, _ in aliases if key in self.files]
            found += [ties[key] for key, _, _ in aliases if ties.get(key) in self.files]
            if not found:
                missing.append(aliases[0][0])
                continue
            self._expect_plain(found[0], aliases[0][1], aliases[0][2])
            value = self._whole(found[0])
            for _, module, attr in aliases:
                self._assign(module, attr, value.to(getattr(module, attr).dtype))
            self.report.tensors.append(found[0])
        if missing:
            raise ValueError(f"load_checkpoint: the checkpoint lacks {len(missing)} tensors of the model: {missing}")


def tied_word_embedding_keys(model: nn.Module) -> dict[str, str]:
    """``{output embedding weight key: input embedding weight key}`` for a model whose config says
    ``tie_word_embeddings`` (Hugging Face), found by module identity; ``{}`` otherwise."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return {}
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not (callable(get_in) and callable(get_out)):
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    inputs, outputs = get_in(), get_out()
    if id(inputs) not in names or id(outputs) not in names:
        return {}
    return {f"{names[id(outputs)]}.weight": f"{names[id(inputs)]}.weight"}


def load_checkpoint(model: nn.Module, path: str | pathlib.Path, *, layout: CheckpointLayout | None = None,
                    block_scale_layout: BlockScaleLayout | None = None,
                    device: torch.device | str | None = None) -> LoadReport:
    """Load the safetensors checkpoint at ``path`` (a file, or a directory with or without
    ``model.safetensors.index.json``) into ``model``; call on every rank, after ``parallelize``.

    ``layout``: force one NVFP4 layout (default: detected per module from its tensor names).
    ``block_scale_layout``: force linear or swizzled block scales (default: swizzled when the
    stored shape is the padded 128x4 one and differs from ``[N, K/16]``, else linear).
    ``device``: where tensors replacing meta-device ones go (default CPU); others keep theirs.
    Returns a :class:`LoadReport`. See the module docstring for what is read and what raises."""
    device = None if device is None else torch.device(device)
    with CheckpointFiles(path) as files:
        loader = _Loader(files, layout, block_scale_layout, device)
        tp_layers = {}
        for name, module in model.named_modules():
            if isinstance(module, NVFP4Linear):
                loader.nvfp4_linear(name, module)
                tp_layers[name] = module
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                loader.dense_linear(name, module)
                tp_layers[name] = module
            elif isinstance(module, VocabParallelEmbedding):
                loader.vocab_embedding(name, module)
                tp_layers[name] = module
        loader.plain_state(model, set(tp_layers))
        report = loader.report
        report.unexpected = sorted(files.names() - loader.read_names)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if still_meta:
        raise ValueError(f"load_checkpoint: {still_meta} are still on the meta device (not in the checkpoint, e.g. "
                         f"non-persistent buffers); build the model on a real device")
    if report.unexpected:
        logger.warning("load_checkpoint: %d checkpoint tensors were not used, e.g. %s", len(report.unexpected),
                       report.unexpected[:5])
    logger.info("load_checkpoint: %d NVFP4 linears (%d static input scales), %d model-dtype TP linears, %d other "
                "tensors from %s", len(report.nvfp4_linears), len(report.static_input_scales),
                len(report.dense_linears), len(report.tensors), path)
    return report
