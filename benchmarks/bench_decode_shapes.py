"""Decode GEMMs at the shapes of one TP=2 Llama-3-8B rank, single GPU, CUDA-graph replays
(``triton.testing.do_bench_cudagraph``; each replay reads the same weights, so what fits in L2 stays
there):

    PYTHONPATH=. python benchmarks/bench_decode_shapes.py shapes     # mm_fp4 vs cuBLAS bf16 per linear
    PYTHONPATH=. python benchmarks/bench_decode_shapes.py siblings   # q/k/v, gate/up: separate vs grouped
    PYTHONPATH=. python benchmarks/bench_decode_shapes.py configs    # launch configurations per linear

``shapes``: ``mm_fp4`` (bf16 out) against ``torch.mm`` in bf16 for each linear of a rank (q, k/v, o,
gate, down; also q/k/v and gate/up as one weight) at M = 16 and 128, over 4 weight copies per call,
with the NVFP4 weight's floor (codes + scales at 4.8 TB/s on H200, 3.35 on H100).

``siblings``: the GEMMs that read one activation (q/k/v: 2048 + 512 + 512 rows, gate/up: 7168 + 7168,
K = 4096) as one ``mm_fp4_triton`` launch each and as ``mm_fp4_group_triton`` (one launch where the
configurations allow, what fp4fuse's kernel lowering makes of them), checked bitwise equal, at M in
1..256. Results: benchmarks/results/2026-11-26-decode-launches-2xh200.md.

``configs``: each single linear of a rank (o, down; q/k/v and gate/up as their own weights) at M = 16
and 128 under the shipped ``decode_config_for`` -- as the op runs it (a fresh split-K workspace:
one zero fill of the counters per call) and with one workspace reused (no fill) -- and under a grid
of other tiles, split counts and stage counts (workspace reused), over 4 rotating weight copies
(``bench_ops.bench_graph``: weights cold in L2), each output checked against the shipped one.
"""
from __future__ import annotations

import functools
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

from bench_ops import bench_graph, quantize as quant  # benchmarks/, this script's folder

from fp4fuse.kernels.triton import mm as triton_mm, mm_decode

COPIES = 4


def _fp4_floor_us(n: int, k: int) -> float:
    """Microseconds to read an ``[n, k]`` NVFP4 weight (codes + scales) at 4.8 TB/s on H200, 3.35 on H100."""
    bandwidth = 4.8e12 if "H200" in torch.cuda.get_device_name() else 3.35e12
    return (n * k // 2 + n * k // 16) / bandwidth * 1e6


def shapes() -> None:
    for m in (16, 128):
        for name, n, k in (("q", 2048, 4096), ("k/v", 512, 4096), ("qkv", 3072, 4096), ("o", 4096, 2048),
                           ("gate", 7168, 4096), ("gate+up", 14336, 4096), ("down", 4096, 7168)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, sa, ga = quant(x)
            ws = [quant(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(COPIES)]
            wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
            alpha = torch.reciprocal(ga * ws[0][2])

            def fp4():
                for b, sb, _ in ws:
                    torch.ops.fp4fuse.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16)

            def bf16():
                for w in wb:
                    torch.mm(x, w.t())

            t4 = do_bench_cudagraph(fp4, rep=200) * 1e3 / COPIES
            tb = do_bench_cudagraph(bf16, rep=200) * 1e3 / COPIES
            floor = _fp4_floor_us(n, k)
            print(f"M={m:4d} {name:8s} {n:6d}x{k:5d}: fp4 {t4:6.1f} us  bf16 {tb:6.1f} us  x{tb / t4:4.2f}  "
                  f"fp4 floor {floor:5.1f} us ({floor / t4 * 100:3.0f}%)", flush=True)


def siblings() -> None:
    for m in (1, 16, 32, 64, 128, 256):
        for name, ns, k in (("q/k/v", (2048, 512, 512), 4096), ("gate/up", (7168, 7168), 4096)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, sa, ga = quant(x)
            ws = [quant(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for n in ns]
            weights = [mm_decode.DecodeWeight(b, sb, torch.reciprocal(ga * gb)) for b, sb, gb in ws]

            def separate():
                return [triton_mm.mm_fp4_triton(a, w.b, sa, w.b_scale, w.alpha, torch.bfloat16) for w in weights]

            def grouped():
                return triton_mm.mm_fp4_group_triton(a, sa, weights, torch.bfloat16)

            assert all(torch.equal(s, g) for s, g in zip(separate(), grouped()))
            ts = do_bench_cudagraph(separate, rep=200) * 1e3
            tg = do_bench_cudagraph(grouped, rep=200) * 1e3
            cfgs = mm_decode.group_configs(m, list(ns), k, mm_decode.num_sms(a.device))
            print(f"M={m:4d} {name:8s}: separate {ts:6.1f} us  grouped {tg:6.1f} us  x{ts / tg:4.2f}  "
                  f"{'one launch' if cfgs else 'configs differ'}", flush=True)


def _candidates(m: int) -> list[mm_decode.DecodeConfig]:
    """Tiles and split counts around the shipped rules (``wide_step_config``, ``narrow_step_config``,
    the pre-decoded 128-row tile)."""
    cfgs = []
    if m <= 16:
        for block_n, block_k, regs, words in ((64, 256, 128, True), (64, 128, None, False), (128, 128, 128, False),
                                               (32, 256, None, True)):
            for split in (1, 2, 4, 8, 16):
                for stages in (3, 4):
                    cfgs.append(mm_decode.DecodeConfig(16, block_n, block_k, split, 4, stages, regs, False, words))
    else:
        for block_n in (32, 64, 128):
            for split in (1, 2, 4, 8):
                for stages in (3, 4):
                    cfgs.append(mm_decode.DecodeConfig(128, block_n, 128, split, 4, stages, None, True))
    return cfgs


def configs() -> None:
    sms = mm_decode.num_sms(torch.device("cuda"))
    for m in (16, 128):
        for name, n, k in (("q", 2048, 4096), ("k/v", 512, 4096), ("o", 4096, 2048), ("gate", 7168, 4096),
                           ("down", 4096, 7168), ("8192^2", 8192, 8192)):
            a, sa, ga = quant(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            ws = [quant(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(COPIES)]
            alpha = torch.reciprocal(ga * ws[0][2])
            shipped = mm_decode.decode_config_for(m, n, k, sms)
            ref = mm_decode.mm_fp4_decode(a, ws[0][0], sa, ws[0][1], alpha, torch.bfloat16).float()
            workspace = mm_decode.empty_decode_workspace(1 << 24, 1 << 14, a.device)

            def run(cfg, reuse):
                return [functools.partial(mm_decode.mm_fp4_decode, a, b, sa, sb, alpha, torch.bfloat16, cfg,
                                          workspace if reuse else None) for b, sb, _ in ws]

            fresh = bench_graph(run(shipped, False)) * 1e3
            reused = bench_graph(run(shipped, True)) * 1e3
            results = []
            for cfg in _candidates(m):
                out = mm_decode.mm_fp4_decode(a, ws[0][0], sa, ws[0][1], alpha, torch.bfloat16, cfg, workspace)
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                results.append((bench_graph(run(cfg, True)) * 1e3, cfg, err))
            results.sort(key=lambda r: r[0])
            floor = _fp4_floor_us(n, k)
            print(f"M={m:3d} {name:7s} {n:5d}x{k:5d} floor {floor:4.1f} us | shipped {_short(shipped)}: "
                  f"{fresh:5.1f} us fresh workspace, {reused:5.1f} reused", flush=True)
            for t, cfg, err in results[:4]:
                print(f"      {t:5.1f} us  {_short(cfg)}  max rel diff {err:.1e}", flush=True)


def _short(cfg: mm_decode.DecodeConfig) -> str:
    return (f"[{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.split_k} st{cfg.num_stages}"
            f"{' r' + str(cfg.max_registers) if cfg.max_registers else ''}{' p' if cfg.predecode else ''}"
            f"{' words' if cfg.scale_words else ''}]")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for part in sys.argv[1:] or ("shapes", "siblings"):
        {"shapes": shapes, "siblings": siblings, "configs": configs}[part]()
