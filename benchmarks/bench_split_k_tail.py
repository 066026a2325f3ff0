"""How much of the decode GEMM's time is its split-K tail (the last program's reduction of the partials).

    PYTHONPATH=. python benchmarks/bench_split_k_tail.py [--json raw.json]

The decode GEMM (``fp4fuse.kernels.triton.mm_decode``) with more than one K split ends each tile in
``finish_tile``: every program stores its fp32 partial tile and takes an arrival, and the last to
arrive reads all the partials in split order and writes the output. This script builds copies of
the module that differ only in that reduction, from the module's own source (the reduction's lines
must be found verbatim, or the script stops):

* ``notail``: the last program writes its own partial as the output (wrong values; the timing
  without the reads);
* ``unroll2`` / ``unroll4``: the same sums in the same order, bitwise, with the loads of 2 or 4
  partials issued before their adds (a masked load of a missing partial reads ``-0.0``, the exact
  identity of fp32 addition);

and times each against the shipped module, at the shipped configuration (``decode_config_for``),
plus the shipped tile without split-K, the pre-decode launch alone where the configuration has one,
and cuBLAS bf16. CUDA-graph replays over rotating weight copies (``bench_ops._rotating_points``,
``bench_ops.decode_graph_ms``), median of 3 interleaved rounds, one process. Results in
benchmarks/results/.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import tempfile
from pathlib import Path

import torch
import triton

import bench_ops  # benchmarks/, this script's folder
from fp4fuse.kernels.triton import decode, mm_decode

SHAPES = ((3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168), (8192, 8192))
MS = (16, 64, 128)
ROUNDS = 3

#: The reduction of the shipped ``finish_tile``, verbatim: what each entry of VARIANTS replaces.
_SHIPPED = '''            total = tl.load(tile_base + in_tile, cache_modifier=".cg")
            for sp in range(1, n_split):
                total += tl.load(tile_base + sp * TILE + in_tile, cache_modifier=".cg")
'''


def _unrolled(width: int) -> str:
    """The shipped sums, ``width`` partials' loads issued before their adds."""
    lines = ['            total = tl.load(tile_base + in_tile, cache_modifier=".cg")\n',
             f"            for sp in range(1, n_split, {width}):\n",
             '                p1 = tl.load(tile_base + sp * TILE + in_tile, cache_modifier=".cg")\n']
    for j in range(2, width + 1):
        lines.append(f"                p{j} = tl.load(tile_base + (sp + {j - 1}) * TILE + in_tile, "
                     f"mask=in_tile < (n_split - sp - {j - 1}) * TILE, other=-0.0, cache_modifier=\".cg\")\n")
    total = "total"
    for j in range(1, width + 1):
        total = f"({total} + p{j})"
    lines.append(f"                total = {total}\n")
    return "".join(lines)


#: Name -> the lines that replace _SHIPPED in that copy of the module.
VARIANTS = {"unroll2": _unrolled(2), "unroll4": _unrolled(4), "notail": "            total = acc\n"}


def variant_modules(directory: Path) -> dict[str, object]:
    """The shipped module and one copy per entry of VARIANTS, imported from ``directory``."""
    modules: dict[str, object] = {"shipped": mm_decode}
    for name, body in VARIANTS.items():
        modules[name] = bench_ops.patched_module(mm_decode, f"mm_decode_{name}", {_SHIPPED: body}, str(directory))
    return modules


def run(modules: dict[str, object]) -> list[dict]:
    sms = decode.num_sms(torch.device("cuda"))
    rows = []
    for m, n, k, x, a, sa, alpha, weights, w_t in bench_ops._rotating_points(SHAPES, MS):
        cfg = mm_decode.decode_config_for(m, n, k, sms)
        first = {name: mod.mm_fp4_decode(a, weights[0][0], sa, weights[0][1], alpha, torch.bfloat16,
                                         mod.DecodeConfig(**dataclasses.asdict(cfg))) for name, mod in modules.items()}
        times: dict[str, list[float]] = {name: [] for name in modules}
        for _ in range(ROUNDS):
            for name, mod in modules.items():
                times[name].append(1e3 * bench_ops.decode_graph_ms(a, sa, alpha, weights, cfg, mod))
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        split, _ = decode.split_ranges(triton.cdiv(k // 2, cfg.block_k // 2), cfg.split_k)
        row = {"m": m, "n": n, "k": k, "cfg": bench_ops._cfg_str(cfg), "tiles": tiles, "split": split,
               "us": {name: sorted(t)[ROUNDS // 2] for name, t in times.items()},
               "bitwise": {name: torch.equal(out, first["shipped"]) for name, out in first.items()},
               "split1_us": 1e3 * bench_ops.decode_graph_ms(a, sa, alpha, weights, dataclasses.replace(cfg, split_k=1)),
               "predecode_us": 1e3 * bench_ops.bench_graph(
                   [functools.partial(mm_decode.predecode_activation, a, sa, cfg.block_k)]) if cfg.predecode else None,
               "bf16_us": 1e3 * bench_ops.bench_graph([functools.partial(torch.mm, x, wt) for wt in w_t])}
        if not all(row["bitwise"][name] for name in ("unroll2", "unroll4")):
            raise RuntimeError(f"bench_split_k_tail: an unrolled reduction changed the bits: {row}")
        rows.append(row)
        us = row["us"]
        print(f"m={m} {n}x{k} {row['cfg']} {tiles} tiles x {split} | "
              + " ".join(f"{name} {t:.1f}" for name, t in us.items())
              + f" | tail {us['shipped'] - us['notail']:.1f} us | split1 {row['split1_us']:.1f} | bf16 {row['bf16_us']:.1f}",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = bench_ops.script_args(__doc__, argv)
    if args is None:
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(variant_modules(Path(tmp)))
    bench_ops.write_raw(args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
