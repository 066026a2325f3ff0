"""Argument checks shared by every fp4fuse op: each error names the argument and the rule."""
from __future__ import annotations

import math

import torch

from fp4fuse.nvfp4.format import BLOCK_SIZE

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"fp4fuse.{op}: {msg}")


def check_2d(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        _fail(op, f"{name} must be 2-D, got shape {tuple(t.shape)}")


def check_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous (row-major), got strides {t.stride()}")


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        _fail(op, f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")


def check_same_device(op: str, named: dict[str, torch.Tensor]) -> None:
    devices = {name: t.device for name, t in named.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            _fail(op, f"{name} is on {dev} but {first_name} is on {first}; all inputs must share a device")


def check_scalar_fp32(op: str, name: str, t: torch.Tensor) -> None:
    if t.numel() != 1:
        _fail(op, f"{name} must hold exactly one element, got shape {tuple(t.shape)}")
    if t.dtype != torch.float32:
        _fail(op, f"{name} must be float32, got {str(t.dtype).replace('torch.', '')}")


def check_k_multiple(op: str, name: str, k: int) -> None:
    if k % BLOCK_SIZE != 0:
        _fail(op, f"{name}: K = {k} must be a multiple of {BLOCK_SIZE} (one e4m3 scale per {BLOCK_SIZE} elements)")


def check_global_scale(op: str, x: torch.Tensor, global_scale: torch.Tensor) -> None:
    """The NVFP4 global scale of quantizing ``x [M, K]``: one fp32 element on x's device, K a
    multiple of 16. Its value is not read (a host sync; a bad value poisons the result instead)."""
    check_k_multiple(op, "x", x.shape[1])
    check_scalar_fp32(op, "global_scale", global_scale)
    check_same_device(op, {"x": x, "global_scale": global_scale})


def check_quant_inputs(x: torch.Tensor, global_scale: torch.Tensor) -> None:
    op = "scaled_fp4_quant"
    check_2d(op, "x", x)
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_contiguous(op, "x", x)
    check_global_scale(op, x, global_scale)


def check_fp4_operand(op: str, data_name: str, data: torch.Tensor, scale_name: str, scale: torch.Tensor) -> None:
    """One packed NVFP4 operand: uint8 ``[R, K/2]`` data, e4m3 ``[R, K/16]`` linear scales."""
    check_2d(op, data_name, data)
    check_2d(op, scale_name, scale)
    check_dtype(op, data_name, data, (torch.uint8,))
    check_dtype(op, scale_name, scale, (torch.float8_e4m3fn,))
    check_contiguous(op, data_name, data)
    check_contiguous(op, scale_name, scale)
    k = data.shape[1] * 2
    check_k_multiple(op, data_name, k)
    expected = (data.shape[0], k // BLOCK_SIZE)
    if tuple(scale.shape) != expected:
        _fail(op, f"{scale_name} must have shape [rows, K/16] = {list(expected)} for {data_name} of shape "
                  f"{list(data.shape)} (linear, unswizzled scales), got {list(scale.shape)}")


def _mm_inputs_ok(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                  alpha: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Every rule of ``check_mm_inputs`` at once, without building messages: an eager decode step
    is host-bound, and this is its common case. False sends the caller to the checks that name
    the broken rule."""
    fp8 = torch.float8_e4m3fn
    kb = a.shape[1] if a.dim() == 2 else -1
    device = a.device
    return (a.dim() == 2 and b.dim() == 2 and a.dtype == torch.uint8 and b.dtype == torch.uint8
            and a_scale.dtype == fp8 and b_scale.dtype == fp8
            and b.shape[1] == kb and (2 * kb) % BLOCK_SIZE == 0
            and a_scale.shape == (a.shape[0], 2 * kb // BLOCK_SIZE)
            and b_scale.shape == (b.shape[0], 2 * kb // BLOCK_SIZE)
            and a.is_contiguous() and b.is_contiguous() and a_scale.is_contiguous() and b_scale.is_contiguous()
            and alpha.numel() == 1 and alpha.dtype == torch.float32 and out_dtype in OUT_DTYPES
            and b.device == device and a_scale.device == device and b_scale.device == device
            and alpha.device == device)


def check_mm_inputs(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype, op: str = "mm_fp4", a_names: tuple[str, str] = ("a", "a_scale"),
) -> None:
    """``mm_fp4``'s operand rules; ``a_names``: what the calling op calls the activation and its
    scales (errors name them)."""
    if _mm_inputs_ok(a, b, a_scale, b_scale, alpha, out_dtype):
        return
    a_name, a_scale_name = a_names
    check_fp4_operand(op, a_name, a, a_scale_name, a_scale)
    check_fp4_operand(op, "b", b, "b_scale", b_scale)
    if a.shape[1] != b.shape[1]:
        _fail(op, f"{a_name} [M, K/2] = {list(a.shape)} and b [N, K/2] = {list(b.shape)} must share K/2")
    check_scalar_fp32(op, "alpha", alpha)
    if out_dtype not in OUT_DTYPES:
        _fail(op, f"out_dtype must be one of bfloat16, float16, float32, got {out_dtype}")
    check_same_device(op, {a_name: a, "b": b, a_scale_name: a_scale, "b_scale": b_scale, "alpha": alpha})


def check_eps(op: str, eps: float) -> None:
    """``eps`` of a norm: a finite number >= 0 (NaN or a negative value would make rsqrt NaN)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        _fail(op, f"eps must be a finite float >= 0, got {eps!r}")


def check_norm_inputs(
    op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> None:
    """x ``[T, H]`` and weight ``[H]`` bf16/fp16/fp32 (weight in any of them, independently of x),
    contiguous, one device; ``eps`` finite >= 0; residual (fused add) exactly like x."""
    check_2d(op, "x", x)
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_contiguous(op, "x", x)
    if weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        _fail(op, f"weight must be 1-D of length hidden = {x.shape[1]}, got shape {tuple(weight.shape)}")
    check_dtype(op, "weight", weight, FLOAT_DTYPES)
    check_contiguous(op, "weight", weight)
    check_eps(op, eps)
    named = {"x": x, "weight": weight}
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            _fail(op, f"residual must match x in shape and dtype ({tuple(x.shape)}, {x.dtype}), got "
                      f"({tuple(residual.shape)}, {residual.dtype})")
        check_contiguous(op, "residual", residual)
        named["residual"] = residual
    check_same_device(op, named)


def check_norm_quant_inputs(
    op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, global_scale: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> None:
    """A fused norm + NVFP4 quantization: the norm's rules (:func:`check_norm_inputs`) and the
    quantization's rules for its output (:func:`check_global_scale`)."""
    check_norm_inputs(op, x, weight, eps, residual)
    check_global_scale(op, x, global_scale)
