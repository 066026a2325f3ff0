"""Programmatic dependent launch (PDL) in front of the decode GEMM: a producer kernel then the GEMM, per pair.

    PYTHONPATH=. python benchmarks/bench_pdl.py [--json raw.json]

In a decode step each NVFP4 GEMM follows the kernel that wrote its activation (fp4fuse's
quantization). With PDL (``launch_pdl=True``; the producer calls ``gdc_launch_dependents`` first
thing, the GEMM calls ``gdc_wait`` before it reads anything) the GEMM's programs are launched while
the producer runs and start the moment it is done, instead of after the launch gap. This script
builds a copy of ``fp4fuse.kernels.triton.mm_decode`` whose ``_mm_decode_kernel`` can wait that way
and, optionally, first prefetch the first ``PREFETCH_STEPS`` K steps of its weight rows into L2
(``prefetch.global.L2``, before the wait: the weight does not depend on the producer), and times
CUDA-graph replays of ``producer -> GEMM`` pairs over rotating weight copies, per pair:

* ``plain``: both launched as fp4fuse launches them;
* ``pdl``: the producer triggers, the GEMM waits;
* ``pdl+prefetch2`` / ``pdl+prefetch4``: and prefetches 2 / 4 steps first;
* ``prefetch2 (no pdl)``: the prefetch alone;

and the producer and the GEMM alone. The producer is a copy kernel standing in for the quantization
(about the same time at decode sizes). Every variant's output is checked bitwise against the plain
GEMM. Shipped configuration (``decode_config_for``); pre-decoded configurations (two launches) are
skipped. Results in benchmarks/results/.
"""
from __future__ import annotations

import sys
import tempfile

import torch
import triton
import triton.language as tl

import bench_ops  # benchmarks/, this script's folder
from fp4fuse.kernels.triton import mm_decode
from fp4fuse.kernels.triton.decode import num_sms

SHAPES = ((8192, 8192), (4096, 2048), (3072, 4096), (14336, 4096), (4096, 7168))
MS = (16, 64)
#: name -> (producer triggers its dependents, GEMM launched with PDL and waits, weight steps prefetched)
MODES = {"plain": (False, False, 0), "pdl": (True, True, 0), "pdl+prefetch2": (True, True, 2),
         "pdl+prefetch4": (True, True, 4), "prefetch2 (no pdl)": (False, False, 2)}

#: The copy's changes to mm_decode's source (each found verbatim).
_PATCHES = {
    '''    ALPHA_FROM_SCALES: tl.constexpr = False, ALPHA_DIV_RN: tl.constexpr = False,
):
    """Program ``(tile, split)`` of one product: ``_decode_program``."""
''': '''    ALPHA_FROM_SCALES: tl.constexpr = False, ALPHA_DIV_RN: tl.constexpr = False,
    PDL: tl.constexpr = False, PREFETCH_STEPS: tl.constexpr = 0,
):
    """Program ``(tile, split)`` of one product: ``_decode_program``."""
    if PREFETCH_STEPS > 0:
        pid_n = tl.program_id(0) // tl.cdiv(M, BLOCK_M)
        rows = readable_rows(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N).to(tl.int64)
        kb0 = tl.program_id(1) * iters_per_split * (BLOCK_K // 2)
        steps = kb0 + tl.arange(0, PREFETCH_STEPS)[None, :] * (BLOCK_K // 2)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [b_ptr + rows[:, None] * KB + tl.minimum(steps, KB - 1)], dtype=tl.int32,
                                  is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
''',
    '''    workspace: DecodeWorkspace | None = None,
) -> torch.Tensor:
    """``alpha * (q_a * s_a) @ (q_b * s_b)^T`` as ``[M, N]`` ``out_dtype`` in one launch (module''': '''    workspace: DecodeWorkspace | None = None, pdl: bool = False, prefetch_steps: int = 0,
) -> torch.Tensor:
    """``alpha * (q_a * s_a) @ (q_b * s_b)^T`` as ``[M, N]`` ``out_dtype`` in one launch (module''',
    '''        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_register_cap(cfg, a.device),
    )
    return out
''': '''        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_register_cap(cfg, a.device),
        PDL=pdl, PREFETCH_STEPS=prefetch_steps, **({"launch_pdl": True} if pdl else {}),
    )
    return out
''',
}


@triton.jit
def _producer(src, dst, n, TRIGGER: tl.constexpr, BLOCK: tl.constexpr):
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def _produce(src: torch.Tensor, dst: torch.Tensor, trigger: bool) -> None:
    _producer[(triton.cdiv(src.numel(), 4096),)](src, dst, src.numel(), TRIGGER=trigger, BLOCK=4096, num_warps=4)


def run(md) -> list[dict]:
    rows = []
    for m, n, k, x, a, sa, alpha, weights, w_t in bench_ops._rotating_points(SHAPES, MS):
        alpha = alpha.float().reshape(1)
        cfg = md.decode_config_for(md.config_rows(m), n, k, num_sms(a.device))
        if cfg.predecode:
            print(f"{m}x{n}x{k}: pre-decoded configuration (two launches), skipped", flush=True)
            continue
        ws = md.empty_decode_workspace(*md.decode_workspace_numel(m, n, k, cfg), a.device)
        src = a.clone()
        wq0, wsq0, _ = weights[0]
        ref = md.mm_fp4_decode(a, wq0, sa, wsq0, alpha, torch.bfloat16, cfg, ws)
        us, bitwise = {}, {}
        for name, (trigger, pdl, steps) in MODES.items():
            def pair(wq, wsq, trigger=trigger, pdl=pdl, steps=steps):
                _produce(src, a, trigger)
                md.mm_fp4_decode(a, wq, sa, wsq, alpha, torch.bfloat16, cfg, ws, pdl=pdl, prefetch_steps=steps)
            us[name] = bench_ops.bench_graph([lambda wq=wq, wsq=wsq: pair(wq, wsq) for wq, wsq, _ in weights]) * 1e3
            out = md.mm_fp4_decode(a, wq0, sa, wsq0, alpha, torch.bfloat16, cfg, ws, pdl=pdl, prefetch_steps=steps)
            bitwise[name] = torch.equal(out, ref)
        us["producer alone"] = bench_ops.bench_graph([lambda: _produce(src, a, False)]) * 1e3
        us["GEMM alone"] = bench_ops.bench_graph([lambda wq=wq, wsq=wsq: md.mm_fp4_decode(
            a, wq, sa, wsq, alpha, torch.bfloat16, cfg, ws) for wq, wsq, _ in weights]) * 1e3
        rows.append(dict(m=m, n=n, k=k, split=cfg.split_k, us=us, bitwise=bitwise))
        print(f"{m}x{n}x{k} split {cfg.split_k}: " + ", ".join(f"{key} {t:.2f}" for key, t in us.items())
              + f" | bitwise {all(bitwise.values())}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = bench_ops.script_args(__doc__, argv)
    if args is None:
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(bench_ops.patched_module(mm_decode, "mm_decode_pdl", _PATCHES, tmp))
    bench_ops.write_raw(args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
