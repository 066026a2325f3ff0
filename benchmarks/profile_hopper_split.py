"""Where the Hopper Gluon GEMM's small split-K launches spend their time: per-kernel GPU durations.

    PYTHONPATH=.:benchmarks python benchmarks/profile_hopper_split.py [--points 128:3072x4096,...] [--json raw.json]
    PYTHONPATH=.:benchmarks python benchmarks/profile_hopper_split.py --ncu-target 128:3072x4096 [--split 5]

At each ``M:NxK`` point, kernel durations from CUPTI (``torch.profiler``), microseconds a call,
averaged over ``CALLS`` calls that rotate over ``bench_ops.ROTATIONS`` weight copies:

- ``decode``: the activation's decode into fp16 halves (``mm_hopper.decode_activation``);
- ``split s``: the Gluon kernel alone on those halves at the smallest token tile holding M and
  ``s`` K ranges a tile, with the other kernels its call launches beside it (since the
  twenty-eighth session the split sum, ``reduce.sum_split_partials``; before, the zeroing of the
  in-kernel reduction's counters);
- ``same grid, no reduction``: the kernel on an ``[s * N, K_s]`` weight with one split, ``K_s`` the
  K elements of one of the ``s`` ranges: the same programs, each with the same K steps, and no
  partial sums to store or combine. Its difference from ``split s`` is what the reduction costs;
- ``steps j``: the same control with ``j`` K steps a program, fitted as ``fixed + j * per_step``;
- cuBLAS bf16 and the shipped dispatch (``mm_fp4_triton``), each kernel by name.

``--ncu-target`` only launches the default split ``CALLS`` times at one point, for ncu to attach
to::

    ncu -k regex:_mm_hopper_kernel -s 4 -c 1 --section SpeedOfLight --section WarpStateStats \\
        --section SourceCounters -o split python benchmarks/profile_hopper_split.py --ncu-target 128:3072x4096
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys

import torch
import triton

from bench_ops import ROTATIONS, quantize, write_raw
from fp4fuse.kernels.triton import decode as triton_decode, mm as triton_mm

POINTS = ((128, 3072, 4096), (128, 4096, 2048), (256, 3072, 4096), (128, 8192, 8192), (128, 28672, 8192))
CALLS = 24
STEP_SERIES = (2, 4, 8, 16, 32)


def kernel_us(fns: list) -> dict[str, float]:
    """Microseconds a call of each CUDA kernel the calls of ``fns`` (in rotation, ``CALLS`` in all)
    launch, by kernel name, from a profiler trace (after one untraced round)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(CALLS):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.time_range.elapsed_us()
    return {name: total / CALLS for name, total in totals.items()}


def short(name: str) -> str:
    """A kernel name short enough for a table."""
    return name if len(name) <= 48 else name[:45] + "..."


def parse_points(text: str) -> tuple[tuple[int, int, int], ...]:
    """``"M:NxK,..."`` -> ``((M, N, K), ...)``."""
    points = []
    for item in text.split(","):
        m, shape = item.split(":")
        n, k = shape.split("x")
        points.append((int(m), int(n), int(k)))
    return tuple(points)


def hopper_launch(hopper, m: int, split: int | None):
    """The launch ``bench_ops`` sweeps use at M rows: the smallest token tile that holds M, ``split``
    K ranges (None: ``hopper_split``'s)."""
    block_m = next(b for b in hopper.BLOCK_M_CHOICES if b >= m) if m <= max(hopper.BLOCK_M_CHOICES) else hopper.BLOCK_M
    return hopper.HopperLaunch(block_m=block_m, split_k=split)


def gemm_us(hopper, xlo, xhi, weights, alpha, launch) -> dict[str, float]:
    """``kernel_us`` of ``mm_fp4_hopper_halves`` under ``launch`` on the decoded activation, over the
    rotating ``weights`` (``bench_ops.quantize`` triples)."""
    return kernel_us([functools.partial(hopper.mm_fp4_hopper_halves, xlo, xhi, wq, wsq, alpha, torch.bfloat16,
                                        None, launch) for wq, wsq, _ in weights])


def control_us(hopper, m: int, n: int, steps: int, programs_per_tile: int, launch, alpha) -> float:
    """The Gluon kernel's duration with one split on an ``[programs_per_tile * n, steps * STEP_K]``
    weight: ``programs_per_tile`` times the tiles of ``n``, each program ``steps`` K steps."""
    k = steps * hopper.STEP_K
    weights = [quantize(torch.randn(programs_per_tile * n, k, device="cuda", dtype=torch.bfloat16))
               for _ in range(ROTATIONS)]
    a, sa, _ = quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    xlo, xhi = hopper.decode_activation(a, sa, launch)
    us = gemm_us(hopper, xlo, xhi, weights, alpha, launch)
    return sum(v for name, v in us.items() if "_mm_hopper_kernel" in name)


def profile_point(hopper, m: int, n: int, k: int, sms: int) -> dict:
    """One ``M:NxK`` point (module docstring): printed as it comes, returned as a raw row."""
    weights = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(ROTATIONS)]
    w_t = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() for _ in range(ROTATIONS)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a, sa, ga = quantize(x)
    alpha = 1.0 / (ga * weights[0][2])
    xlo, xhi = hopper.decode_activation(a, sa)
    row: dict = {"m": m, "n": n, "k": k}
    row["decode"] = kernel_us([functools.partial(hopper.decode_activation, a, sa)])
    row["bf16"] = kernel_us([functools.partial(torch.mm, x, wt) for wt in w_t])
    row["shipped"] = kernel_us([functools.partial(triton_mm.mm_fp4_triton, a, wq, sa, wsq, alpha, torch.bfloat16)
                                for wq, wsq, _ in weights])
    launch = hopper_launch(hopper, m, None)
    steps = k // hopper.STEP_K
    tiles = triton.cdiv(m, launch.block_m) * triton.cdiv(n, hopper.BLOCK_N)
    default_split = hopper.hopper_split(m, n, k, sms, launch.block_m)
    row["block_m"], row["tiles"], row["default_split"] = launch.block_m, tiles, default_split
    row["splits"] = {}
    for split in sorted({1, 2, default_split, 2 * default_split}):
        if steps // split < 2:
            continue
        splits, iters = triton_decode.split_ranges(steps, split)
        us = gemm_us(hopper, xlo, xhi, weights, alpha, hopper.HopperLaunch(block_m=launch.block_m, split_k=split))
        gemm = sum(v for name, v in us.items() if "_mm_hopper_kernel" in name)
        others = {short(name): v for name, v in us.items() if "_mm_hopper_kernel" not in name}
        control = control_us(hopper, m, n, iters, splits, hopper.HopperLaunch(block_m=launch.block_m, split_k=1),
                             alpha) if splits > 1 else gemm
        row["splits"][split] = {"splits": splits, "iters": iters, "gemm_us": gemm, "others_us": others,
                                "no_reduction_us": control}
        print(f"  m={m} {n}x{k} tile {launch.block_m}: split {splits} ({iters} steps) gemm {gemm:6.1f} us, same grid "
              f"without the reduction {control:6.1f} us; beside it {others}", flush=True)
    series = {j: control_us(hopper, m, n, j, default_split, hopper.HopperLaunch(block_m=launch.block_m, split_k=1),
                            alpha) for j in STEP_SERIES}
    slope = statistics.linear_regression(list(series), list(series.values()))
    row["steps_series_us"] = series
    row["fixed_us"], row["per_step_us"] = slope.intercept, slope.slope
    print(f"  m={m} {n}x{k}: {tiles * default_split} programs of j steps: "
          + " ".join(f"j={j}:{v:.1f}" for j, v in series.items())
          + f" -> fixed {slope.intercept:.1f} us + {slope.slope:.2f} us a step", flush=True)
    for key in ("decode", "bf16", "shipped"):
        print(f"  m={m} {n}x{k} {key}: " + ", ".join(f"{short(nm)} {v:.1f}" for nm, v in row[key].items()), flush=True)
    return row


def ncu_target(hopper, m: int, n: int, k: int, split: int | None) -> None:
    """``CALLS`` launches of ``hopper_launch``'s launch at one point, nothing timed (``--ncu-target``)."""
    b, sb, gb = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    a, sa, ga = quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    xlo, xhi = hopper.decode_activation(a, sa)
    for _ in range(CALLS):
        hopper.mm_fp4_hopper_halves(xlo, xhi, b, sb, 1.0 / (ga * gb), torch.bfloat16, None,
                                    hopper_launch(hopper, m, split))
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", help="comma-separated M:NxK (default: %s)"
                        % ",".join(f"{m}:{n}x{k}" for m, n, k in POINTS))
    parser.add_argument("--ncu-target", help="one M:NxK point: only launch it, for ncu")
    parser.add_argument("--split", type=int, help="--ncu-target's split count (default: hopper_split's)")
    parser.add_argument("--json", help="raw results as JSON")
    args = parser.parse_args(argv)
    hopper = triton_mm.hopper_kernels()
    if not torch.cuda.is_available() or hopper is None or not hopper.hopper_device(0):
        print("this profile needs an sm_90 GPU and Triton 3.6 (the Gluon GEMM)", file=sys.stderr)
        return 2
    if args.ncu_target:
        ncu_target(hopper, *parse_points(args.ncu_target)[0], args.split)
        return 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}", flush=True)
    rows = [profile_point(hopper, m, n, k, sms) for m, n, k in (parse_points(args.points) if args.points else POINTS)]
    write_raw(args.json, profile_hopper_split=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
