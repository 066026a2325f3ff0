"""The decode GEMM's K loop in SASS, counted: what its instructions do, per weight element (no GPU needed).

    PYTHONPATH=. python benchmarks/sass_decode_loop.py [--shapes 16x8192x8192,64x8192x8192] [--tiling]

Compiles ``fp4fuse.kernels.triton.mm_decode._mm_decode_kernel`` for sm_90 with the installed Triton
(its bundled ptxas and cuobjdump) under the shipped configuration of each ``M x N x K``
(``decode_config_for``, 132 multiprocessors), finds the K loop (the longest backward branch), and
prints its instruction count per warp and per weight element with an opcode histogram in groups:

* ``decode``: PRMT, LOP3, SHF, IMAD, IADD3, LEA, F2FP (code and scale decoding, addressing);
* ``scale``: HMUL2 (decoded codes times their block scales);
* ``mma``: HGMMA and the warpgroup fences and waits;
* ``memory``: LDGSTS, LDG, LDS, LDSM, STS and their barriers (BAR, DEPBAR, LDGDEPBAR);
* ``uniform``: the uniform datapath (U*), loop control.

``--tiling`` also answers whether a prepacked weight layout could decode with one AND per fp16x2
register: an exact fp16 operand of an e2m1 code has its magnitude in bits 9-11 and its sign in
bit 15 of each 16-bit lane, and one shift plus one AND per register needs four shifts of that
pattern to tile the 16 bit positions (a rotation of a 32-bit word moves both lanes alike); it
prints every tiling found (none). Results in benchmarks/results/.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp4fuse.kernels.triton import mm_decode

GROUPS = {"decode": ("PRMT", "LOP3", "SHF", "IMAD", "IADD3", "LEA", "F2FP", "I2F", "SEL", "ISETP"),
          "scale": ("HMUL2", "HFMA2"),
          "mma": ("HGMMA", "WARPGROUP", "WARPSYNC", "FENCE", "HMMA"),
          "memory": ("LDGSTS", "LDG", "LDS", "LDSM", "STS", "BAR", "DEPBAR", "LDGDEPBAR", "MEMBAR")}
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _compile(m: int, n: int, k: int) -> tuple[mm_decode.DecodeConfig, str]:
    """SASS of the shipped configuration's kernel for ``[m, k] x [n, k]^T`` (bf16 output, K a whole
    number of steps, split-K as planned, 16-byte aligned pointers as the launches specialize them)."""
    cfg = mm_decode.decode_config_for(mm_decode.config_rows(m), n, k, 132)
    plan = mm_decode._plan(cfg, m, n, k)
    kernel = mm_decode._mm_decode_kernel
    pointers = {"a_ptr": "*fp16" if cfg.predecode else "*u8", "as_ptr": "*fp16" if cfg.predecode else "*fp8e4nv",
                "b_ptr": "*u8", "bs_ptr": "*fp8e4nv", "alpha_ptr": "*fp32", "alpha_b_ptr": "*fp32",
                "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PARTIAL=plan.split > 1,
                      EVEN_K=plan.even_k, FAST_DECODE=True, PREDECODED=cfg.predecode,
                      A_SCALE_WORDS=cfg.scale_words and not cfg.predecode, ALPHA_FROM_SCALES=False,
                      ALPHA_DIV_RN=False)
    signature = {p.name: "constexpr" if p.is_constexpr or p.name in constexprs else pointers.get(p.name, "i32")
                 for p in kernel.params}
    aligned = [name for name in pointers] + ["N", "KB", "KG", "KBP"]
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(name),): v for name, v in constexprs.items()},
                       attrs={(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned})
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.max_registers:
        options["maxnreg"] = cfg.max_registers
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return cfg, cuobjdump(compiled.asm["cubin"], "-sass")


def cuobjdump(cubin: bytes, flag: str) -> str:
    """What the installed Triton's ``cuobjdump <flag>`` prints for ``cubin`` (``-sass``, ``-res-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(_BIN, "cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def _k_loop(sass: str) -> list[str]:
    """Opcodes of the longest loop body (a backward branch's range)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in
            (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    best: list[str] = []
    for addr, text in code:
        target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
        if target and target.group(1) and int(target.group(1), 16) < addr:
            body = [t for a, t in code if int(target.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best]


def _group(opcode: str) -> str:
    if opcode.startswith("U"):
        return "uniform"
    return next((g for g, ops in GROUPS.items() if opcode in ops), "other")


def loop_report(m: int, n: int, k: int) -> dict:
    cfg, sass = _compile(m, n, k)
    ops = _k_loop(sass)
    warps = cfg.num_warps
    per_warp_elements = cfg.block_n * cfg.block_k // warps
    by_group = collections.Counter(_group(op) for op in ops)
    return {"m": m, "n": n, "k": k, "config": cfg, "instructions": len(ops),
            "per_thread_element": len(ops) * 32 / (per_warp_elements), "groups": dict(by_group),
            "opcodes": collections.Counter(ops).most_common(12)}


def tilings() -> list[tuple[int, ...]]:
    """Shifts d (mod 16) for which four copies {9, 10, 11, 15} + d partition the 16 bits of a lane."""
    lane = (9, 10, 11, 15)
    return [ds for ds in itertools.combinations(range(16), 4)
            if sorted((b + d) % 16 for d in ds for b in lane) == list(range(16))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16x8192x8192,64x8192x8192,128x8192x8192,16x3072x4096,128x2048x4096")
    parser.add_argument("--tiling", action="store_true")
    args = parser.parse_args(argv)
    print(f"Triton {triton.__version__}, sm_90")
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        r = loop_report(m, n, k)
        c = r["config"]
        print(f"{m}x{n}x{k} [{c.block_m}x{c.block_n}x{c.block_k} s{c.split_k} w{c.num_warps}"
              f"{' p' if c.predecode else ''}]: {r['instructions']} instructions a K step and warp, "
              f"{r['per_thread_element']:.2f} per weight element and thread | "
              + " ".join(f"{g}={v}" for g, v in sorted(r["groups"].items(), key=lambda x: -x[1]))
              + " | " + " ".join(f"{op}={v}" for op, v in r["opcodes"]), flush=True)
    if args.tiling:
        print(f"tilings of a 16-bit lane by four shifts of {{9, 10, 11, 15}}: {tilings() or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
