"""Quantize and multiply on the available device; print backend, error vs reference and time.

    python -m fp4fuse.selfcheck [--m 257 --n 1000 --k 2048] [--device cuda]
"""
from __future__ import annotations

import argparse
import time

import torch

import fp4fuse  # noqa: F401  (registers the ops)
from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.ops.backend import backend_for


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=257)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
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
    out = ops.mm_fp4(qx, qw, sx, sw, alpha, torch.float32)

    rqx, rsx = nvfp4.quantize_reference(x.cpu(), gx.cpu())
    quant_equal = torch.equal(qx.cpu(), rqx) and torch.equal(sx.cpu().view(torch.uint8), rsx.view(torch.uint8))
    ref = nvfp4.mm_fp4_reference(qx.cpu(), qw.cpu(), sx.cpu(), sw.cpu(), alpha.cpu(), torch.float64)
    mm_rel = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    dense = x.float() @ w.float().t()
    quant_rel = ((out - dense).norm() / dense.norm()).item()
    t_quant = _time_ms(lambda: ops.scaled_fp4_quant(x, gx), device)
    t_mm = _time_ms(lambda: ops.mm_fp4(qx, qw, sx, sw, alpha, torch.bfloat16), device)

    print(f"fp4fuse {fp4fuse.__version__} | torch {torch.__version__} | device {device} | "
          f"backend {backend_for(x).value}")
    print(f"shape M={args.m} N={args.n} K={args.k}")
    print(f"scaled_fp4_quant bit-equal to reference: {quant_equal}   time {t_quant:.3f} ms")
    print(f"mm_fp4 rel. error vs float64 reference: {mm_rel:.2e}   time {t_mm:.3f} ms")
    print(f"NVFP4 vs dense bf16 matmul rel. error (quantization): {quant_rel:.3f}")
    ok = quant_equal and mm_rel <= 1e-5
    print("selfcheck:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
