"""Exhaustive CPU check of ``_div6_rn`` (fp4fuse/kernels/triton/quant.py): the block amax divided by 6
with one Markstein correction must equal IEEE fp32 ``a / 6`` wherever the kernel uses it.

Not collected by pytest (about five minutes of CPU); run when that arithmetic changes:

    python tests/div6_exhaustive.py

For every fp32 bit pattern ``a`` in ``[0, inf)`` (2**31 - 2**23 values): ``q0 = RN(a * y)`` with
``y = RN(1/6)``, ``r = RN(fma(q0, -6, a))``, ``q = RN(fma(r, y, q0))`` (single-rounding fp32 FMA,
``fma_sat_exhaustive.fma32``) against numpy's IEEE fp32 division. The kernel takes ``div.rn`` for
``0 < a < 2**-125`` (bit patterns 1 .. 0xFFFFFF), where the quotient is deep in the subnormal range;
the script reports the mismatches it finds there and fails on any outside. Exit status 1 on failure.
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fma_sat_exhaustive import fma32  # noqa: E402

F32 = np.float32
Y = F32(1.0) / F32(6.0)
#: bit patterns the kernel sends to ``div.rn`` (0 < a < 2**-125)
SLOW_MAX_BITS = 0xFFFFFF
STEP = 1 << 24


def mismatches(bits: np.ndarray) -> np.ndarray:
    a = bits.view(F32)
    with np.errstate(all="ignore"):
        ref = a / F32(6.0)
        q0 = (a.astype(np.float64) * np.float64(Y)).astype(F32)  # exact product, one rounding
        r = fma32(q0, F32(-6.0), a)
        q = fma32(r, Y, q0)
    return bits[ref.view(np.uint32) != q.view(np.uint32)]


def main() -> int:
    inside = outside = 0
    for start in range(0, 0x7F800000, STEP):
        bad = mismatches(np.arange(start, min(start + STEP, 0x7F800000), dtype=np.uint32))
        slow = (bad >= 1) & (bad <= SLOW_MAX_BITS)
        inside += int(slow.sum())
        outside += int((~slow).sum())
        if (~slow).any():
            print(f"mismatch outside the div.rn range: {bad[~slow][:8].view(F32)}", flush=True)
    print(f"mismatches taken by div.rn (a < 2**-125): {inside}; elsewhere: {outside}")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
