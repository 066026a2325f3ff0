"""Host cost of one eager call of fp4fuse's ops, layer by layer, against ``torch.mm`` in the same process.

    PYTHONPATH=. python benchmarks/bench_host.py [--m 16 --n 8192 --k 8192] [--json raw.json]

An eager op call is host-bound when its host path takes longer than its kernels (an eager decode
step at M=16). For each layer of the call path, from the public op down to
a bare Triton launch (Triton's own dispatch, and fp4fuse's ``FastKernel``), this prints two figures
in microseconds per call:

* ``host``: the time to enqueue ``CALLS`` calls back to back while the GPU is held busy by a
  ``torch.cuda._sleep`` queued first (so no call waits on the device), divided by ``CALLS``;
* ``wall``: ``CALLS`` calls back to back, the device synced before and after, divided by ``CALLS``:
  what a user of the op sees, ``max(host, device)`` in the steady state;

and ``host`` again under ``torch.inference_mode()``, where the dispatcher skips the autograd key
(and with it ``torch.library.custom_op``'s autograd layer) that ``torch.no_grad()`` still runs.

Layers (M x N x K of ``--m/--n/--k``, bf16 output): ``torch.ops.fp4fuse.mm_fp4`` (the custom op:
dispatch, validation, backend lookup, launcher), ``mm_fp4_triton`` (the launcher: configuration,
output and split-K workspace allocations, launch), then for the decode GEMM's sizes
``mm_fp4_decode`` with a caller's workspace (no allocation but the output) and the
``_mm_decode_kernel`` launch alone, or for the Hopper Gluon GEMM's (``mm.hopper_gemm``)
``mm_fp4_hopper``, its activation decode, the call a compiled graph makes (the internal op
``fp4fuse::_mm_fp4_hopper`` down to its prepared launch, ``launch.Relaunch``) against the same launch
on a caller's output (not prepared), its three TMA descriptors and the ``_mm_hopper_kernel``
launch alone (descriptors built per launch); ``--cprofile N`` adds cProfile's N functions with the
most own time over the op's calls; the same for
``scaled_fp4_quant`` on ``[M, K]`` bf16; ``torch.mm`` bf16 and an empty ``torch.library.custom_op``
(dispatch cost of a Python custom op) as baselines.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
import triton

import fp4fuse  # noqa: F401  (registers torch.ops.fp4fuse)
from fp4fuse.kernels.triton import mm as triton_mm, mm_decode, quant as triton_quant
from fp4fuse.kernels.triton.alpha import alpha_meta, alpha_operands
from fp4fuse.kernels.triton.decode import num_sms
from fp4fuse.kernels.triton.launch import FastKernel
from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.ops import validation

CALLS = 200
ROUNDS = 5


@torch.library.custom_op("fp4fuse_bench::empty_like", mutates_args=())
def _empty_custom_op(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def host_round_us(fn) -> float:
    """Host time per call of CALLS enqueued calls, the device held busy."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time: the calls below never wait on it
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    elapsed = (time.perf_counter() - start) * 1e6 / CALLS
    torch.cuda.synchronize()
    return elapsed


def host_us(fn) -> float:
    """Median over ROUNDS of the host time per call of CALLS enqueued calls (device held busy)."""
    return sorted(host_round_us(fn) for _ in range(ROUNDS))[ROUNDS // 2]


def wall_us(fn) -> float:
    """Median over ROUNDS of the wall time per call of CALLS back-to-back calls, synced around."""
    times = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / CALLS)
    return sorted(times)[ROUNDS // 2]


def layers(m: int, n: int, k: int) -> dict[str, callable]:
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    gs_x = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    gs_w = nvfp4.global_scale_from_amax(w.float().abs().amax()).reshape(1)
    a, sa = torch.ops.fp4fuse.scaled_fp4_quant(x, gs_x)
    b, sb = torch.ops.fp4fuse.scaled_fp4_quant(w, gs_w)
    alpha = torch.reciprocal(gs_x * gs_w)
    w16 = w.t().contiguous().t()
    calls = {
        "torch.mm bf16 (baseline)": lambda: torch.mm(x, w16.t()),
        "empty custom_op (dispatch only)": lambda: torch.ops.fp4fuse_bench.empty_like(x),
        "torch.empty [M, N]": lambda: torch.empty(m, n, device=dev, dtype=torch.bfloat16),
        "check_mm_inputs": lambda: validation.check_mm_inputs(a, b, sa, sb, alpha, torch.bfloat16),
        "torch.ops.fp4fuse.mm_fp4": lambda: torch.ops.fp4fuse.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16),
        "mm_fp4_triton (launcher)": lambda: triton_mm.mm_fp4_triton(a, b, sa, sb, alpha, torch.bfloat16),
    }
    if triton_mm.hopper_gemm(m, b, sb, torch.bfloat16) is not None:
        calls.update(_hopper_layers(a, b, sa, sb, alpha))
    elif m <= mm_decode.DECODE_MAX_M:
        calls.update(_decode_layers(a, b, sa, sb, alpha))
    calls.update({
        "torch.ops.fp4fuse.scaled_fp4_quant": lambda: torch.ops.fp4fuse.scaled_fp4_quant(x, gs_x),
        "scaled_fp4_quant_triton (launcher)": lambda: triton_quant.scaled_fp4_quant_triton(x, gs_x),
    })
    return calls


def _decode_layers(a, b, sa, sb, alpha) -> dict[str, callable]:
    """The decode GEMM's layers: launcher with a caller's workspace, bare launch both ways."""
    m, n, k, dev = a.shape[0], b.shape[0], a.shape[1] * 2, a.device
    cfg = mm_decode.decode_config_for(m, n, k, num_sms(dev))
    parts, counters = mm_decode.decode_workspace_numel(m, n, k, cfg)
    ws = mm_decode.empty_decode_workspace(parts, counters, dev)
    plan = mm_decode._plan(cfg, m, n, k)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    partials, counts = (ws.partials, ws.counters) if plan.split > 1 else (out, out)
    kernel = mm_decode._mm_decode_kernel
    fast = FastKernel(kernel)

    def raw_launch(launcher):
        launcher[(plan.tiles, plan.split)](
            a, sa, b, sb, *alpha_operands(alpha), out, partials, counts, m, n, k // 2, k // 16, 0,
            plan.iters_per_split, plan.split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            PARTIAL=plan.split > 1, EVEN_K=plan.even_k, FAST_DECODE=True, PREDECODED=False, **alpha_meta(alpha),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **mm_decode._register_cap(cfg, dev))

    return {
        "mm_fp4_decode, caller's workspace": lambda: mm_decode.mm_fp4_decode(
            a, b, sa, sb, alpha, torch.bfloat16, workspace=ws),
        "_mm_decode_kernel launch, Triton's dispatch": lambda: raw_launch(kernel),
        "_mm_decode_kernel launch, FastKernel": lambda: raw_launch(fast),
    }


def _hopper_layers(a, b, sa, sb, alpha) -> dict[str, callable]:
    """The Hopper Gluon GEMM's layers: the launcher, the activation decode, the call a lowered graph
    makes (the op ``fp4fuse::_mm_fp4_hopper`` and below it, repeated on the same buffers: a prepared
    launch) and the same launch on a caller's output (nothing prepared), the TMA descriptors and
    the bare launch both ways (no split-K)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fp4fuse.kernels.triton import mm_hopper

    m, n, k, dev = a.shape[0], b.shape[0], a.shape[1] * 2, a.device
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    xlo, xhi = mm_hopper.decode_activation(a, sa)
    block_m, step = mm_hopper.BLOCK_M, mm_hopper.STEP_BYTES
    x_layout, w_layout = mm_hopper._smem_layouts(block_m)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, mm_hopper.BLOCK_N)
    kernel = mm_hopper._mm_hopper_kernel
    fast = FastKernel(kernel)

    def descriptors():
        return (TensorDescriptor.from_tensor(xlo, [block_m, step], x_layout),
                TensorDescriptor.from_tensor(xhi, [block_m, step], x_layout),
                TensorDescriptor.from_tensor(b, [mm_hopper.BLOCK_N, step], w_layout))

    def raw_launch(launcher):
        launcher[(tiles, 1)](
            *descriptors(), sb.view(torch.int32), alpha, alpha, out, out, out, m, n, k // 64, k // 64, k // 64,
            ALPHA_FROM_SCALES=False, ALPHA_DIV_RN=False, PARTIAL=False, STAGES=mm_hopper.STAGES,
            GROUP_M=mm_hopper.GROUP_M, SCALE_AHEAD=mm_hopper.SCALE_AHEAD,
            FRAGMENT_ORDER=mm_hopper.FRAGMENT_ORDER, CODES_LAYOUT=mm_hopper.codes_layout(),
            num_warps=mm_hopper.NUM_WARPS, maxnreg=mm_hopper.MAX_REGISTERS)

    lowered = (a, sa, xlo, xhi, b, sb, alpha, alpha, False, False, torch.bfloat16)  # alpha as itself (not folded)
    split = mm_hopper.split_for(m, n, k, num_sms(dev))
    return {
        "mm_fp4_hopper": lambda: mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, split_k=split),
        "decode_activation (activation)": lambda: mm_hopper.decode_activation(a, sa),
        "lowered call: op fp4fuse::_mm_fp4_hopper": lambda: torch.ops.fp4fuse._mm_fp4_hopper(*lowered),
        "lowered call: mm.mm_fp4_hopper_decoded": lambda: triton_mm.mm_fp4_hopper_decoded(*lowered),
        "lowered call: mm_fp4_hopper_halves (prepared launch)": lambda: mm_hopper.mm_fp4_hopper_halves(
            xlo, xhi, b, sb, alpha, torch.bfloat16, None, mm_hopper.HopperLaunch(block_m=block_m)),
        "mm_fp4_hopper_halves, caller's output (not prepared)": lambda: mm_hopper.mm_fp4_hopper_halves(
            xlo, xhi, b, sb, alpha, torch.bfloat16, out, mm_hopper.HopperLaunch(block_m=block_m, split_k=split)),
        "3 TMA descriptors": descriptors,
        "_mm_hopper_kernel launch, Triton's dispatch": lambda: raw_launch(kernel),
        "_mm_hopper_kernel launch, FastKernel": lambda: raw_launch(fast),
    }


def _print_profile(fn, top: int) -> None:
    """cProfile of CALLS calls of ``fn`` (device held busy): the ``top`` functions by own time."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--json", help="raw results as JSON")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also print the N functions with the most own time over CALLS op calls of mm_fp4")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_host.py needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    head = (f"{datetime.date.today()} {torch.cuda.get_device_name()} torch {torch.__version__} "
            f"triton {triton.__version__}, M={args.m} N={args.n} K={args.k}, us per call")
    print(head, flush=True)
    print("| call | host us | wall us | host us, inference_mode |\n| --- | --- | --- | --- |", flush=True)
    calls = layers(args.m, args.n, args.k)
    for name, fn in calls.items():
        for _ in range(3):
            fn()  # compile / warm caches
        row = {"call": name, "host_us": host_us(fn), "wall_us": wall_us(fn)}
        with torch.inference_mode():  # no autograd key: custom_op's autograd layer is skipped
            fn()
            row["host_us_inference_mode"] = host_us(fn)
        rows.append(row)
        print(f"| {name} | {row['host_us']:.1f} | {row['wall_us']:.1f} | {row['host_us_inference_mode']:.1f} |",
              flush=True)
    if args.cprofile:
        _print_profile(calls["torch.ops.fp4fuse.mm_fp4"], args.cprofile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
