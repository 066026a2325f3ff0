"""Which kernel family serves an op on a device.

REFERENCE is the pure-torch code in fp4fuse.nvfp4 (format.py, norms.py) (CPU, and any device as
a fallback). TRITON is fp4fuse's own Triton code (SM80/SM90 and later). FLASHINFER is flashinfer's
FP4 path, SM100+ only; it was written to flashinfer 0.7.2's documented API and has never been run
(no Blackwell GPU was available to the authors). ``FP4FUSE_BACKEND=reference|triton|flashinfer``
forces a choice on CUDA.
"""
from __future__ import annotations

import enum
import functools
import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)


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


@functools.cache
def cuda_backend(device_index: int) -> Backend:
    """Backend for CUDA device ``device_index`` (cached; env override read once)."""
    forced = os.environ.get("FP4FUSE_BACKEND")
    if forced:
        try:
            return Backend(forced.lower())
        except ValueError:
            raise ValueError(
                f"FP4FUSE_BACKEND={forced!r}: must be one of {[b.value for b in Backend]}") from None
    major, _ = torch.cuda.get_device_capability(device_index)
    if major >= 10 and _flashinfer_available():
        return Backend.FLASHINFER
    if major >= 8 and _triton_available():
        return Backend.TRITON
    return Backend.REFERENCE


def backend_for(t: torch.Tensor) -> Backend:
    if t.device.type != "cuda":
        return Backend.REFERENCE
    return cuda_backend(t.device.index if t.device.index is not None else torch.cuda.current_device())
