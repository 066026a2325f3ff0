"""Check fp4fuse's quantize and GEMM kernels on one device: each figure beside what it should be.

    python -m fp4fuse.selfcheck [--m 257 --n 1000 --k 2048] [--device cuda]

x ``[M, K]`` and w ``[N, K]`` are N(0, 1) in bf16. Two kinds of lines:

* kernel checks (must hold on every device): ``scaled_fp4_quant`` gives the bits of the float64
  reference quantizer; ``mm_fp4`` of those codes matches a float64 GEMM of the same codes up to
  fp32 accumulation (relative error <= 1e-5). Where the ops run that reference themselves (the
  CPU, ``FP4FUSE_BACKEND=reference``) these lines are "not checked": they would compare the
  reference with itself.
* format checks (what NVFP4 itself costs, the same on every device): rounding N(0, 1) data to NVFP4
  loses about 9.5% RMS per operand (e2m1 keeps one mantissa bit; one e4m3 scale per 16 values maps
  the block's amax to 6). A GEMM of two quantized operands carries both errors; independent errors
  add in quadrature, so ``mm_fp4`` vs the dense matmul is about sqrt(ex^2 + ew^2 + ex^2 ew^2),
  about 0.134 -- expected, not a kernel error.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch

import fp4fuse  # noqa: F401  (registers the ops)
from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.ops.backend import Backend, backend_for

#: Relative RMS error of NVFP4 on N(0, 1) data (e2m1 codes, e4m3 scales per 16 values, global scale
#: from the amax): 0.0944-0.0959 over shapes 64x64 to 4096x4096 and seeds, measured with
#: fp4fuse.nvfp4.format's reference quantizer; a property of the format, not of a kernel.
GAUSSIAN_NVFP4_ERROR = 0.095
#: Tolerance of the format checks, relative to the expected value (covers sampling at small shapes).
FORMAT_TOLERANCE = 0.10
#: mm_fp4 vs a float64 GEMM of the same codes: the products are exact, fp32 accumulation is not.
MM_FP4_MAX_ERROR = 1e-5
#: Fewer elements (of an operand, or of the GEMM's output) make the format figures too noisy to check.
MIN_FORMAT_ELEMENTS = 4096


@dataclasses.dataclass(frozen=True)
class Line:
    what: str
    value: str
    expected: str
    ok: bool | None  # None: not checked

    def print(self) -> None:
        verdict = {True: "ok", False: "FAIL", None: "-"}[self.ok]
        print(f"  {self.what:46s} {self.value:>10s}   {self.expected:46s} {verdict}")


def _time_ms(fn, device: torch.device, iters: int = 10) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters * 1e3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _format_line(what: str, value: float, expected: float, how: str, elements: int) -> Line:
    if elements < MIN_FORMAT_ELEMENTS:
        return Line(what, f"{value:.4f}", f"not checked: < {MIN_FORMAT_ELEMENTS} elements", None)
    ok = abs(value / expected - 1.0) <= FORMAT_TOLERANCE
    return Line(what, f"{value:.4f}", f"{expected:.3f} +-{FORMAT_TOLERANCE:.0%} ({how})", ok)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp4fuse.selfcheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=257, help="rows of x (activations) (default: 257)")
    p.add_argument("--n", type=int, default=1000, help="rows of w (output features) (default: 1000)")
    p.add_argument("--k", type=int, default=2048, help="inner dimension, a multiple of 16 (default: 2048)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device to check (default: cuda if available, else cpu)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(args.m, args.k, generator=g).to(device, torch.bfloat16)
    w = torch.randn(args.n, args.k, generator=g).to(device, torch.bfloat16)
    gx = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    gw = nvfp4.global_scale_from_amax(w.float().abs().amax()).reshape(1)
    ops = torch.ops.fp4fuse
    qx, sx = ops.scaled_fp4_quant(x, gx)
    qw, sw = ops.scaled_fp4_quant(w, gw)
    alpha = (1.0 / (gx * gw)).reshape(1)
    out = ops.mm_fp4(qx, qw, sx, sw, alpha, torch.float32).cpu()

    rqx, rsx = nvfp4.quantize_reference(x.cpu(), gx.cpu())
    quant_equal = torch.equal(qx.cpu(), rqx) and torch.equal(sx.cpu().view(torch.uint8), rsx.view(torch.uint8))
    mm_err = _rel(out, nvfp4.mm_fp4_reference(qx.cpu(), qw.cpu(), sx.cpu(), sw.cpu(), alpha.cpu(), torch.float64))
    ex = _rel(nvfp4.dequantize_reference(qx.cpu(), sx.cpu(), gx.cpu()), x.cpu())
    ew = _rel(nvfp4.dequantize_reference(qw.cpu(), sw.cpu(), gw.cpu()), w.cpu())
    product_expected = math.sqrt(ex ** 2 + ew ** 2 + (ex * ew) ** 2)
    gemm_err = _rel(out, x.cpu().double() @ w.cpu().double().t())
    t_quant = _time_ms(lambda: ops.scaled_fp4_quant(x, gx), device)
    t_mm = _time_ms(lambda: ops.mm_fp4(qx, qw, sx, sw, alpha, torch.bfloat16), device)

    backend = backend_for(x)
    kernels = [
        Line("scaled_fp4_quant vs float64 reference", "equal" if quant_equal else "differs", "bit-equal",
             quant_equal),
        Line("mm_fp4 vs float64 GEMM of the same codes", f"{mm_err:.1e}",
             f"<= {MM_FP4_MAX_ERROR:.0e} (fp32 accumulation)", mm_err <= MM_FP4_MAX_ERROR),
    ]
    if backend is Backend.REFERENCE:  # the ops are the reference here: nothing independent to compare
        kernels = [dataclasses.replace(line, expected="not checked: the op runs the reference here", ok=None)
                   for line in kernels]
    lines = [
        *kernels,
        _format_line("NVFP4 rounding error of x (rel. RMS)", ex, GAUSSIAN_NVFP4_ERROR, "N(0, 1) data",
                     args.m * args.k),
        _format_line("NVFP4 rounding error of w (rel. RMS)", ew, GAUSSIAN_NVFP4_ERROR, "N(0, 1) data",
                     args.n * args.k),
        _format_line("mm_fp4 vs float64 matmul of x, w (rel. error)", gemm_err, product_expected,
                     "sqrt(ex^2 + ew^2 + ex^2 ew^2)", args.m * args.n),
    ]
    print(f"fp4fuse {fp4fuse.__version__} | torch {torch.__version__} | device {device} | "
          f"backend {backend.value}")
    print(f"shape M={args.m} N={args.n} K={args.k}; x, w ~ N(0, 1) in bf16")
    print(f"  {'check':46s} {'value':>10s}   {'expected':46s} result")
    for line in lines:
        line.print()
    print(f"time: scaled_fp4_quant {t_quant:.3f} ms, mm_fp4 {t_mm:.3f} ms (not checked)")
    print("The first two lines check the kernels; the last three are NVFP4's own precision, the same on every "
          "device (python -m fp4fuse.selfcheck --help says why).")
    ok = all(line.ok is not False for line in lines)
    unchecked = " (kernels not checked: the reference backend)" if backend is Backend.REFERENCE else ""
    print("selfcheck:", ("OK" + unchecked) if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
