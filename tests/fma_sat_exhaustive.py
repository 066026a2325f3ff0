"""Exhaustive CPU check of the arithmetic of ``QuantDivision.FMA_SAT`` (fp4fuse/kernels/triton/quant.py).

Not collected by pytest (minutes of CPU); run when that arithmetic changes:

    python tests/fma_sat_exhaustive.py            # every fp32 y with z = y/s in [1/16, 8), 1.25e9 cases
    python tests/fma_sat_exhaustive.py --quick    # every 64th mantissa

For each of the 8 e4m3 mantissas (s = (8 + m) / 8; the exponent only scales everything exactly),
every fp32 ``y`` with ``y / s`` in [1/16, 8), and ``r8`` = the correctly rounded ``1 / (8 s)`` and its
two neighbours (the kernel uses ``rcp.approx``, within 1 ulp), the kernel's per-element steps
evaluated with hardware semantics (single-rounding fp32 FMA, ``.sat`` clamps to [0, 1] with NaN to
0) must give ``fp4fuse.nvfp4.format.e2m1_encode(RN(y / s))``, the reference's code. The same steps with
the interpreter's fp64-emulated FMA are checked too. Exit status 1 on any mismatch.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4fuse.nvfp4.format import e2m1_encode  # noqa: E402

F32 = np.float32


def fma32(a, b, c):
    """fp32 ``RN(a * b + c)`` with one rounding: the fp64 product is exact, TwoSum recovers the fp64
    sum's error, and an fp64 sum that sits exactly on an fp32 midpoint is moved off it by that
    error (the only case where rounding the fp64 sum to fp32 differs from one rounding)."""
    a, b, c = (np.asarray(v, F32).astype(np.float64) for v in np.broadcast_arrays(a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r = s.astype(F32)
    with np.errstate(invalid="ignore"):
        other = np.nextafter(r, np.where(s > r, F32(np.inf), F32(-np.inf)).astype(F32))
        tie = (np.abs(s - r.astype(np.float64)) == np.abs(other.astype(np.float64) - s)) & (e != 0) & np.isfinite(s)
        toward = np.where(e > 0, other > r, other < r)
    return np.where(tie & toward, other, r).astype(F32)


def fma64_emulated(a, b, c):
    """The interpreter path of ``_fma``: fp64 multiply-add, then rounded to fp32."""
    a, b, c = (np.asarray(v, F32).astype(np.float64) for v in np.broadcast_arrays(a, b, c))
    return (a * b + c).astype(F32)


def sat(v):
    return np.where(v > 0, np.minimum(v, F32(1)), F32(0)).astype(F32)


def codes(y, s, r8, fma):
    """Magnitude codes of the kernel's ``_magic_codes`` (sign_blk 0)."""
    q0 = sat(y * r8)
    rho = fma(q0, F32(-8) * s, y)
    h = fma(rho, r8, q0)
    a = sat(h * F32(4))
    b = sat(fma(h, F32(4), F32(-1)))
    c = sat(fma(h, F32(4), F32(-2)))
    p = fma(a, F32(4), F32(2**23))
    p = fma(b, F32(2), p)
    p = p + c
    return p.view(np.int32).astype(np.int64) - 0x4B000000


def main() -> int:
    step = 64 if "--quick" in sys.argv else 1
    mant = np.arange(0, 1 << 23, step, dtype=np.int32)
    checked = bad = 0
    for m in range(8):
        s = F32((8 + m) / 8)
        r_rn = F32(1) / (F32(8) * s)
        for binade in range(-4, 3):
            y = np.unique(((mant | ((127 + binade) << 23)).view(F32) * s).astype(F32))
            ref = e2m1_encode(torch.from_numpy(y / s)).numpy().astype(np.int64)
            for r8 in (r_rn, np.nextafter(r_rn, F32(0)), np.nextafter(r_rn, F32(1))):
                for fma in (fma32, fma64_emulated):
                    got = codes(y, s, F32(r8), fma)
                    n = int((got != ref).sum())
                    if n:
                        i = np.nonzero(got != ref)[0][:4]
                        print(f"MISMATCH m={m} binade={binade} r8={r8!r} {fma.__name__}: y={y[i]} got={got[i]} ref={ref[i]}")
                    bad += n
                    checked += y.size
        print(f"mantissa {m}: {checked} checked, {bad} mismatches", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
