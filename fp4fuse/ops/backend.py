"""Which kernel family serves an op on a device.

REFERENCE is the pure-torch code in fp4fuse.nvfp4 (format.py, norms.py) (CPU, and any device as
a fallback). TRITON is fp4fuse's own Triton code (SM80/SM90 and later). FLASHINFER is flashinfer's
FP4 path, SM100+ only; it was written to flashinfer 0.7.2's documented API and has never been run
(no Blackwell GPU was available to the authors). ``FP4FUSE_BACKEND=reference|triton|flashinfer``
forces a choice on CUDA (it must be the same on every rank).

A CUDA device below SM80, or without Triton installed, falls back to REFERENCE: correct, but the
GEMM runs as a float64 matmul of dequantized operands, orders of magnitude slower than a kernel.
That fallback is logged once per device at WARNING (a forced ``reference`` is not).
"""
from __future__ import annotations

import enum
import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from fp4fuse.config import env_choice

__all__ = [
    "ENV_BACKEND", "Backend", "backend_for", "call_on_device", "cuda_backend", "device_backend", "forced_backend",
]

logger = logging.getLogger(__name__)

ENV_BACKEND = "FP4FUSE_BACKEND"
#: Compute capability (major) from which fp4fuse's Triton kernels run; SM100+ prefers flashinfer.
TRITON_MIN_MAJOR = 8
FLASHINFER_MIN_MAJOR = 10


class Backend(enum.Enum):
    REFERENCE = "reference"
    TRITON = "triton"
    FLASHINFER = "flashinfer"


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a broken JIT environment
        logger.debug("flashinfer not usable: %s", exc)
        return False
    return True


def forced_backend() -> Backend | None:
    """``FP4FUSE_BACKEND`` as a :class:`Backend`, or None when unset or empty (choose by device)."""
    return env_choice(ENV_BACKEND, Backend, None)


def cuda_backend(device_index: int) -> Backend:
    """Backend for CUDA device ``device_index``: ``FP4FUSE_BACKEND`` where set (read on every call,
    as ``FusionPass.uuid`` reads it: a compile after the variable changed must use the new value its
    cache key names), else the device's (:func:`device_backend`, cached)."""
    forced = forced_backend()
    return forced if forced is not None else device_backend(device_index)


@functools.cache
def device_backend(device_index: int) -> Backend:
    """The backend CUDA device ``device_index`` supports best (cached per device: the device and the
    installed packages are read once; a fallback to REFERENCE is logged at WARNING, once per device)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if major >= FLASHINFER_MIN_MAJOR and _flashinfer_available():
        return Backend.FLASHINFER
    triton_ok = _triton_available()
    if major >= TRITON_MIN_MAJOR and triton_ok:
        return Backend.TRITON
    why = (f"compute capability {major}.{minor} is below {TRITON_MIN_MAJOR}.0" if major < TRITON_MIN_MAJOR
           else "Triton is not installed")
    logger.warning(
        "fp4fuse: CUDA device %d runs the pure-torch reference ops (float64 GEMM of dequantized operands, "
        "orders of magnitude slower than a kernel): %s. fp4fuse's Triton kernels need SM%d0+ and Triton. "
        "(Logged once per device; %s=reference silences this.)",
        device_index, why, TRITON_MIN_MAJOR, ENV_BACKEND)
    return Backend.REFERENCE


def backend_for(t: torch.Tensor) -> Backend:
    if t.device.type != "cuda":
        return Backend.REFERENCE
    return cuda_backend(t.device.index if t.device.index is not None else torch.cuda.current_device())


def call_on_device(device: torch.device, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with CUDA ``device`` current while it runs (a no-op switch where it already is).

    The ops' CUDA kernels are plain dispatcher kernels, which get no device guard, and Triton
    launches on the *current* device and stream, not on the tensors' device. Inputs on another
    GPU of the process (a model spread over GPUs in one process, e.g. Hugging Face
    ``device_map="auto"``) would otherwise run on the wrong GPU: an error without peer access,
    and with it a launch on the current device's stream that the consumers on the tensors' own
    stream do not wait for (they read the outputs before they are written)."""
    index = device.index
    if index is None or index == torch._C._cuda_getDevice():
        return fn(*args)
    with torch.cuda.device(index):
        return fn(*args)
