"""Column- and row-parallel linears with NVFP4 weights and activations.

Weights are quantized once, for the local shard, with the global scale of the **full** weight
(``fp4fuse.nvfp4.quantizer.quantize_weight``): the shard's codes and block scales are exactly the
full weight's rows (column-parallel) or 16-aligned columns (row-parallel), at any TP size, the same
as a checkpoint's payload sliced per rank. Buffers (model state, in the state_dict):

* ``weight_q`` uint8 ``[N_local, K_local/2]``, ``weight_scale`` e4m3 ``[N_local, K_local/16]``,
  ``weight_global_scale`` fp32 ``[1]`` (encode convention ``448 * 6 / amax``);
* ``bias`` ``[N_local]`` (column-parallel) or ``[N]`` (row-parallel) in ``out_dtype``, or None;
* ``input_global_scale`` fp32 ``[1]`` or None: a static activation global scale (encode
  convention). When set, each call quantizes the input with it (a tensor in the compiled graph,
  not a Python constant); when None, the layer's ``NVFP4Quantizer`` computes one per call.

Each call runs ``scaled_fp4_quant`` and ``mm_fp4`` with ``alpha = 1 / (gs_a * gs_w)`` on the
input's rows (``[..., K]`` flattened to ``[T, K]``, fp4fuse.tp.rows).

* ``ColumnParallelNVFP4Linear``: the weight (and bias) is split by output rows; the input is the
  full, replicated activation; the output holds this rank's output features. ``parts`` splits a
  merged weight (qkv, gate_up) part by part, so each rank holds matching slices of every part.
* ``RowParallelNVFP4Linear``: the weight is split by input columns; the input holds this rank's
  features; the partial products are summed with a functional ``all_reduce`` (which sequence
  parallelism later turns into a reduce-scatter) and the bias is added once, after the sum.
* ``gather_output=True`` (column) all-gathers the output features, so every rank returns the whole
  output; ``input_is_parallel=False`` (row) takes a whole input and multiplies this rank's features
  of it (the plan styles ``colwise_gather_output`` / ``rowwise_split_input``, fp4fuse.tp.plan).

Activation quantizers: a column-parallel input is replicated, so a dynamic scale from the local
amax is the same on every rank (``NVFP4Quantizer()``); a row-parallel input is a different slice on
each rank, and each rank's partial product carries its own alpha, so a local amax is right there
too (it differs from the TP=1 model's scale: dynamic row-parallel numerics depend on the TP size;
a static ``input_global_scale`` does not).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.nvfp4.quantizer import NVFP4Quantizer, quantize_weight
from fp4fuse.tp.parallel import TPGroup, shard
from fp4fuse.tp.rows import from_rows, gather_features, local_features, row_parallel_sum, to_rows

__all__ = ["ColumnParallelNVFP4Linear", "NVFP4Linear", "RowParallelNVFP4Linear", "global_scale_tensor",
           "quantize_weight"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def global_scale_tensor(value: float | torch.Tensor, what: str) -> torch.Tensor:
    """An encode-convention global scale as fp32 ``[1]``: a float, or a tensor of one element.

    Raises ``ValueError`` naming ``what`` unless it is finite and > 0 (values on the meta device
    are not checked)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{what}: a global scale must be a float or a one-element tensor, got {type(value).__name__}")
    t = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    if t.numel() != 1:
        raise ValueError(f"{what}: a global scale must hold one element, got shape {tuple(t.shape)}")
    t = t.reshape(1).to(torch.float32)
    if t.device.type != "meta":
        v = float(t.item())
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{what}: a global scale (encode convention 448*6/amax) must be finite and > 0, got {v}")
    return t


class NVFP4Linear(nn.Module):
    """``y = x @ W^T + b`` with W held in NVFP4 and x ``[..., K]`` quantized per call.

    ``weight``: ``[N, K]`` high precision (K a multiple of 16); ``weight_amax``: the amax whose
    global scale quantizes it (default ``max |weight|``; a shard passes its full weight's amax).
    ``bias``: ``[N]`` or None. ``input_global_scale``: a static activation scale (see the module
    docstring) or None for ``act_quantizer``'s; with one set, ``act_quantizer`` must be dynamic and
    local (it is not used)."""

    def __init__(self, weight: torch.Tensor, act_quantizer: NVFP4Quantizer, out_dtype: torch.dtype, *,
                 bias: torch.Tensor | None = None, weight_amax: torch.Tensor | None = None,
                 input_global_scale: float | torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"NVFP4Linear: weight must be 2-D, got shape {tuple(weight.shape)}")
        if out_dtype not in _OUT_DTYPES:
            raise ValueError(f"NVFP4Linear: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
        q, s, gs = quantize_weight(weight, weight_amax)
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", s)
        self.register_buffer("weight_global_scale", gs)
        self.register_buffer("bias", None)
        self.register_buffer("input_global_scale", None)
        self.act_quantizer = act_quantizer
        self.out_dtype = out_dtype
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        if bias is not None:
            self.set_bias(bias)
        if input_global_scale is not None:
            self.set_input_global_scale(input_global_scale)

    # -- state ---------------------------------------------------------------------------------

    def set_bias(self, bias: torch.Tensor) -> None:
        """Hold ``bias [out_features]`` (this layer's slice) in ``out_dtype``."""
        if tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"{type(self).__name__}: bias must have shape [{self.out_features}], "
                             f"got {tuple(bias.shape)}")
        self.bias = bias.detach().to(device=self.weight_q.device, dtype=self.out_dtype)

    def set_input_global_scale(self, value: float | torch.Tensor) -> None:
        """Quantize inputs with this static encode-convention global scale from now on (a buffer)."""
        if self.act_quantizer != NVFP4Quantizer():
            raise ValueError(f"{type(self).__name__}: a static input_global_scale replaces the activation "
                             f"quantizer, which must then be the default NVFP4Quantizer(), got {self.act_quantizer}")
        self.input_global_scale = global_scale_tensor(value, f"{type(self).__name__}.input_global_scale").to(
            self.weight_q.device)

    def load_quantized_weight(self, q: torch.Tensor, s: torch.Tensor, global_scale: torch.Tensor) -> None:
        """Replace the weight payload with ``q [N, K/2]`` uint8, ``s [N, K/16]`` e4m3 (linear) and an
        encode-convention ``global_scale``, each of this layer's local shape (e.g. read from a
        checkpoint); they move to the device of the current buffers unless those are on meta."""
        expected = {"q": (tuple(self.weight_q.shape), torch.uint8),
                    "s": (tuple(self.weight_scale.shape), torch.float8_e4m3fn)}
        for name, t in (("q", q), ("s", s)):
            shape, dtype = expected[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{type(self).__name__}.load_quantized_weight: {name} must be {dtype} {list(shape)}, "
                                 f"got {t.dtype} {list(t.shape)}")
        device = q.device if self.weight_q.device.type == "meta" else self.weight_q.device
        gs = global_scale_tensor(global_scale, f"{type(self).__name__}.weight_global_scale")
        self.weight_q, self.weight_scale, self.weight_global_scale = q.to(device), s.to(device), gs.to(device)
        if self.bias is not None:
            self.bias = self.bias.to(device)
        if self.input_global_scale is not None:
            self.input_global_scale = self.input_global_scale.to(device)

    # -- compute -------------------------------------------------------------------------------

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [T, K]`` -> ``[T, N]`` in ``out_dtype``, without the bias."""
        if self.input_global_scale is None:
            q, s, gs = self.act_quantizer.quantize(rows)
        else:
            gs = self.input_global_scale
            q, s = torch.ops.fp4fuse.scaled_fp4_quant(rows, gs)
        alpha = torch.reciprocal(gs * self.weight_global_scale)
        return torch.ops.fp4fuse.mm_fp4(q, self.weight_q, s, self.weight_scale, alpha, self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, lead = to_rows(x)
        out = self.matmul(rows)
        if self.bias is not None:
            out = out + self.bias
        return from_rows(out, lead)

    def extra_repr(self) -> str:
        act = "static input_global_scale" if self.input_global_scale is not None else self.act_quantizer
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, act={act}")

    @classmethod
    def from_linear(cls, linear: nn.Linear, act_quantizer: NVFP4Quantizer | None = None, *,
                    input_global_scale: float | torch.Tensor | None = None) -> NVFP4Linear:
        """The NVFP4 form of ``linear`` (weight quantized once, bias kept, output in its dtype)."""
        return cls(linear.weight.detach(), act_quantizer or NVFP4Quantizer(), linear.weight.dtype,
                   bias=_bias_of(linear), input_global_scale=input_global_scale)


def _bias_of(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _amax(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().abs().amax().float().reshape(1)


class ColumnParallelNVFP4Linear(NVFP4Linear):
    """Output features split across the group; ``full_weight`` is the unsharded ``[N, K]``,
    ``full_bias`` the unsharded ``[N]`` (or None). ``gather_output``: all-gather the output
    features, so every rank returns the whole ``[..., N]`` (``colwise_gather_output``), in
    ``full_weight``'s row order also with ``parts`` (gathered part by part)."""

    def __init__(self, full_weight: torch.Tensor, group: TPGroup, act_quantizer: NVFP4Quantizer,
                 out_dtype: torch.dtype = torch.bfloat16, parts: tuple[int, ...] | None = None, *,
                 full_bias: torch.Tensor | None = None,
                 input_global_scale: float | torch.Tensor | None = None, gather_output: bool = False) -> None:
        parts = parts or (full_weight.shape[0],)
        if sum(parts) != full_weight.shape[0]:
            raise ValueError(f"ColumnParallelNVFP4Linear: parts {parts} do not sum to {full_weight.shape[0]} rows")
        local = torch.cat([shard(p, 0, group, "output features") for p in full_weight.split(list(parts), 0)])
        bias = None if full_bias is None else torch.cat(
            [shard(p, 0, group, "output features") for p in full_bias.split(list(parts), 0)])
        super().__init__(local, act_quantizer, out_dtype, bias=bias, weight_amax=_amax(full_weight),
                         input_global_scale=input_global_scale)
        self.group = group
        self.local_parts = tuple(group.split(p, "output features") for p in parts)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return gather_features(out, self.group, self.local_parts) if self.gather_output else out

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: TPGroup, act_quantizer: NVFP4Quantizer | None = None, *,
                    input_global_scale: float | torch.Tensor | None = None,
                    gather_output: bool = False) -> ColumnParallelNVFP4Linear:
        """This rank's column-parallel NVFP4 slice of ``linear`` (output in its dtype)."""
        return cls(linear.weight.detach(), group, act_quantizer or NVFP4Quantizer(), linear.weight.dtype,
                   full_bias=_bias_of(linear), input_global_scale=input_global_scale, gather_output=gather_output)


class RowParallelNVFP4Linear(NVFP4Linear):
    """Input features split across the group (``K / size`` a multiple of 16, so no block straddles
    two ranks); the output is all-reduced (summed) over it, then ``full_bias`` (``[N]``, not
    sharded) added once. ``input_is_parallel=False``: the input is whole (``[..., K]`` on every
    rank) and each rank takes its features of it (``rowwise_split_input``)."""

    def __init__(self, full_weight: torch.Tensor, group: TPGroup, act_quantizer: NVFP4Quantizer,
                 out_dtype: torch.dtype = torch.bfloat16, *, full_bias: torch.Tensor | None = None,
                 input_global_scale: float | torch.Tensor | None = None, input_is_parallel: bool = True) -> None:
        local_k = group.split(full_weight.shape[1], "input features")
        if local_k % nvfp4.BLOCK_SIZE:
            raise ValueError(f"RowParallelNVFP4Linear: input features per rank = {local_k} must be a multiple of "
                             f"{nvfp4.BLOCK_SIZE} (a 16-element block may not straddle two ranks)")
        super().__init__(shard(full_weight, 1, group, "input features"), act_quantizer, out_dtype, bias=full_bias,
                         weight_amax=_amax(full_weight), input_global_scale=input_global_scale)
        self.group = group
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, lead = to_rows(x if self.input_is_parallel else local_features(x, self.group))
        return row_parallel_sum(self.matmul(rows), self.group, self.bias, lead)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: TPGroup, act_quantizer: NVFP4Quantizer | None = None, *,
                    input_global_scale: float | torch.Tensor | None = None,
                    input_is_parallel: bool = True) -> RowParallelNVFP4Linear:
        """This rank's row-parallel NVFP4 slice of ``linear`` (output in its dtype)."""
        return cls(linear.weight.detach(), group, act_quantizer or NVFP4Quantizer(), linear.weight.dtype,
                   full_bias=_bias_of(linear), input_global_scale=input_global_scale,
                   input_is_parallel=input_is_parallel)
