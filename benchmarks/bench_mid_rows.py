"""The decode GEMM at 65-256 activation rows on small weights: its tiles against the pre-decoded one.

    PYTHONPATH=. python benchmarks/bench_mid_rows.py [--groups] [--json raw.json]

Above 64 rows the decode GEMM (``fp4fuse.kernels.triton.mm_decode``) pre-decodes the activation once
into fp16 planes and runs 128 activation rows x 64 weight rows a program; on weights of up to
``MID_INKERNEL_MAX_WEIGHT`` elements it decodes the activation in the kernel at 65-128 rows instead,
in 32-row tiles (``wide_step_config``). This script times, at 96, 128 and 256 rows on Llama-3-8B's
TP=2 shards (q, k/v, the fused q/k/v, o, gate/up, down) and 8192^2, in one process:

* ``shipped``: ``decode_config_for``;
* ``pre-decoded``: the 128 x 64 pre-decoded tile with split-K filling 1, 2 (the rule before, and
  above 128 rows) and 3 programs per multiprocessor, and the 128 x 128 one (8 warps); the 128 x 64
  tile with shallower rings (2 stages of 128-element steps, 3-4 of 64), where three programs fit a
  multiprocessor's shared memory;
* the in-kernel decode at 32 x 64 and 64 x 64 (256-element steps), 64 x 128 and 32 x 128 (128);
* cuBLAS bf16 on the same shape.

``--groups`` times grouped launches instead (``mm_fp4_decode_products``, one activation): Llama-3-8B's
TP=2 q/k/v (2048 + 512 + 512 rows) and gate/up (7168 + 7168) at 40, 64, 96 and 128 rows, every
product under one tile (split-K filling the GPU for that product alone, as ``decode_config_for``
computes it), against cuBLAS bf16's GEMMs one after another.

CUDA-graph replays over rotating weight copies (``bench_ops._rotating_points``,
``bench_ops.decode_graph_ms``), microseconds. Each candidate's output is checked against the
first's (a different split sums K in another order: relative error, not bits). The first
configuration timed at a point ran up to 15% slow at two of the 21 points of an H100 run (the same
configuration timed next did not), so each point times the shipped one once untimed first. Results in benchmarks/results/.
"""
from __future__ import annotations

import dataclasses
import functools
import sys

import torch
import triton

import bench_ops  # benchmarks/, this script's folder
from fp4fuse.kernels.triton import mm_decode

SHAPES = ((2048, 4096), (512, 4096), (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168), (8192, 8192))
MS = (96, 128, 256)
#: Relative error (max |out - ref| / max |ref|) between two correct bf16 outputs of other split orders.
MAX_REL_DIFF = 1e-2


def _splitter(m: int, n: int, k: int, sms: int):
    """``split(block_m, block_n, per_sm, block_k=128)``: the split-K count filling ``per_sm`` programs per
    multiprocessor with ``[block_m, block_n]`` tiles of an ``[m, k] x [n, k]^T`` product."""
    def split(block_m: int, block_n: int, per_sm: int, block_k: int = 128) -> int:
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        return mm_decode.filling_split(tiles, k, sms, per_sm, block_k=block_k)
    return split


def _candidates(m: int, n: int, k: int, sms: int) -> dict[str, mm_decode.DecodeConfig]:
    """Name -> configuration: the shipped one first."""
    config = mm_decode.DecodeConfig
    split = _splitter(m, n, k, sms)

    out = {"shipped": mm_decode.decode_config_for(mm_decode.config_rows(m), n, k, sms)}
    for per_sm in (1, 2, 3):
        out[f"128x64 pre-decoded /{per_sm}"] = config(128, 64, 128, split(128, 64, per_sm), 4, 3, predecode=True)
    for per_sm in (1, 2):
        out[f"128x128 pre-decoded /{per_sm}"] = config(128, 128, 128, split(128, 128, per_sm), 8, 3, predecode=True)
    # shallower rings: three programs a multiprocessor fit its shared memory (a 3-deep ring of
    # 128-element steps holds two)
    out["128x64 pre-decoded 2 stages /3"] = config(128, 64, 128, split(128, 64, 3), 4, 2, predecode=True)
    for stages, per_sm in ((3, 3), (4, 3), (3, 4)):
        out[f"128x64x64 pre-decoded {stages} stages /{per_sm}"] = config(128, 64, 64, split(128, 64, per_sm, 64), 4,
                                                                       stages, predecode=True)
    out["32x64x256 /4"] = config(32, 64, 256, split(32, 64, 4, 256), 4, 3, max_registers=128)
    for per_sm in (2, 4):
        out[f"64x64x256 /{per_sm}"] = config(64, 64, 256, split(64, 64, per_sm, 256), 4, 3)
    out["64x128x128 /3"] = config(64, 128, 128, split(64, 128, 3), 4, 3)
    out["32x128x128 /3"] = config(32, 128, 128, split(32, 128, 3), 4, 3, max_registers=128)
    return out


def _same_as_first(out: torch.Tensor, ref: torch.Tensor | None, where: str) -> torch.Tensor:
    """``out`` (float64) checked against ``ref``, the first candidate's output (``out`` itself when
    None); returns the reference for the next candidate."""
    if ref is None:
        return out
    diff = ((out - ref).abs().max() / ref.abs().max()).item()
    if diff > MAX_REL_DIFF:
        raise AssertionError(f"{where}: relative difference {diff:.2e} from the shipped output")
    return ref


def _describe(cfg: mm_decode.DecodeConfig) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.split_k} w{cfg.num_warps}"
            + (" p" if cfg.predecode else ""))


def sweep(sms: int) -> list[dict]:
    rows = []
    for m, n, k, x, a, sa, alpha, weights, w_t in bench_ops._rotating_points(SHAPES, MS):
        alpha = alpha.reshape(1)
        b, sb = weights[0][0], weights[0][1]
        us = {"bf16": bench_ops.bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t]) * 1e3}
        configs, ref = {}, None
        candidates = _candidates(m, n, k, sms)
        bench_ops.decode_graph_ms(a, sa, alpha, weights, candidates["shipped"])  # warm-up: the first timing ran high
        for name, cfg in candidates.items():
            out = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.bfloat16, cfg).double()
            ref = _same_as_first(out, ref, f"m={m} n={n} k={k} {name}")
            us[name] = bench_ops.decode_graph_ms(a, sa, alpha, weights, cfg) * 1e3
            configs[name] = dataclasses.asdict(cfg)
        best = min((name for name in us if name != "bf16"), key=us.get)
        shipped = mm_decode.DecodeConfig(**configs["shipped"])
        print(f"M={m:<3d} {n:>5d}x{k:<5d} bf16 {us['bf16']:5.1f} | shipped {us['shipped']:5.1f} [{_describe(shipped)}] | "
              f"best {best} {us[best]:5.1f} | " + " ".join(f"{name}={v:.1f}" for name, v in us.items()
                                                           if name not in ("bf16", "shipped")), flush=True)
        rows.append({"m": m, "n": n, "k": k, "us": us, "configs": configs})
    return rows


GROUPS = {"q/k/v": ((2048, 512, 512), 4096), "gate/up": ((7168, 7168), 4096)}
GROUP_MS = (40, 64, 96, 128)


def _group_tiles(m: int, n: int, k: int, sms: int) -> dict[str, mm_decode.DecodeConfig]:
    """Name -> one product's configuration under each tile a group's products may share."""
    config = mm_decode.DecodeConfig
    split = _splitter(m, n, k, sms)

    return {"32x64x256": config(32, 64, 256, split(32, 64, 4, 256), 4, 3, max_registers=128),
            "64x64x256": config(64, 64, 256, split(64, 64, 2, 256), 4, 3),
            "64x128x128": config(64, 128, 128, split(64, 128, 3), 4, 3),
            "128x64 pre-decoded": config(128, 64, 128, split(128, 64, 2), 4, 3, predecode=True)}


def group_sweep(sms: int) -> list[dict]:
    rows = []
    for name, (ns, k) in GROUPS.items():
        weights = [[bench_ops.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for n in ns]
                   for _ in range(bench_ops.ROTATIONS)]
        w_t = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() for n in ns]
               for _ in range(bench_ops.ROTATIONS)]
        for m in GROUP_MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, sa, ga = bench_ops.quantize(x)

            def products(ws):
                return [mm_decode.DecodeProduct(a, sa, b, sb, (1.0 / (ga * gb)).reshape(1)) for b, sb, gb in ws]

            def bf16(wts):
                for wt in wts:
                    torch.mm(x, wt)

            us = {"bf16": bench_ops.bench_graph([functools.partial(bf16, wts) for wts in w_t]) * 1e3}
            # the shipped launch (no configs: mm_fp4_decode_products' own choice) runs each product's own
            # configuration; recorded below
            shipped = [mm_decode.decode_config_for(mm_decode.config_rows(m), n, k, sms) for n in ns]
            tiles = [_group_tiles(m, n, k, sms) for n in ns]
            candidates = {"shipped": None, **{tile: [t[tile] for t in tiles] for tile in tiles[0]}}
            ref = None
            bench_ops.bench_graph([functools.partial(mm_decode.mm_fp4_decode_products, products(ws), torch.bfloat16)
                                   for ws in weights])  # warm-up: the first timing ran high
            for label, cfgs in candidates.items():
                outs = mm_decode.mm_fp4_decode_products(products(weights[0]), torch.bfloat16, cfgs)
                ref = _same_as_first(torch.cat([o.double() for o in outs], dim=1), ref, f"{name} m={m} {label}")
                us[label] = bench_ops.bench_graph(
                    [functools.partial(mm_decode.mm_fp4_decode_products, products(ws), torch.bfloat16, cfgs)
                     for ws in weights]) * 1e3
            print(f"GROUP {name:8s} M={m:<3d} bf16 x{len(ns)} {us['bf16']:5.1f} | "
                  + " ".join(f"{label}={v:.1f}" for label, v in us.items() if label != "bf16"), flush=True)
            rows.append({"group": name, "m": m, "ns": ns, "k": k, "us": us,
                         "shipped": [dataclasses.asdict(c) for c in shipped]})
        weights = w_t = None
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = bench_ops.script_args(__doc__, argv, ("--groups",))
    if args is None:
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.groups:
        bench_ops.write_raw(args.json, groups=group_sweep(sms))
    else:
        bench_ops.write_raw(args.json, mid_rows=sweep(sms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
