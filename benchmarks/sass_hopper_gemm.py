"""The Hopper Gluon GEMM compiled for sm_90 without a GPU: registers, spills and shared memory per launch form.

    PYTHONPATH=. python benchmarks/sass_hopper_gemm.py [--block-ms 64,128,256] [--sass-dir DIR]

Compiles ``fp4fuse.kernels.triton.mm_hopper._mm_hopper_kernel`` with the installed Triton (its
bundled ptxas and cuobjdump) for each token tile, with and without split-K (``PARTIAL``), at the
shipped launch otherwise (``STAGES``, ``SCALE_AHEAD``, ``MAX_REGISTERS``), and prints what
``cuobjdump -res-usage`` reports and the SASS's local-memory stores and loads (spills). The module is
written to Triton 3.6's Gluon API; later releases renamed a call it makes (``tma.async_load``),
so the source compiled here is the module's own with that name replaced (the script stops if it
does not find it). The GPU machines run Triton 3.6, whose register allocation
may differ: these counts say what the kernel asks of a compiler, not what ships. Results in
benchmarks/results/.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget

from sass_decode_loop import cuobjdump  # benchmarks/, this script's folder

#: Gluon calls the module makes that were renamed after Triton 3.6: (3.6 name, later name).
RENAMES = (("tma.async_copy_global_to_shared(", "tma.async_load("),)
_SOURCE = pathlib.Path(__file__).resolve().parents[1] / "fp4fuse" / "kernels" / "triton" / "mm_hopper.py"


def _module(directory: str):
    """``mm_hopper`` as the installed Triton's Gluon names it (``RENAMES`` applied where needed)."""
    source = _SOURCE.read_text()
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) > (3, 6):
        for old, new in RENAMES:
            if old not in source:
                raise SystemExit(f"{_SOURCE}: {old!r} not found; update RENAMES")
            source = source.replace(old, new)
    path = pathlib.Path(directory) / "mm_hopper_offline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("mm_hopper_offline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compile_report(hopper, block_m: int, partial: bool, fragment_order: bool = True) -> tuple[str, str]:
    """``(cuobjdump -res-usage line, SASS)`` of one launch form (``fragment_order``: the kernel's
    FRAGMENT_ORDER)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    x_layout, w_layout = hopper._smem_layouts(block_m)
    x_desc = TensorDescriptor.from_tensor(torch.empty(512, 2048, dtype=torch.float16), [block_m, hopper.STEP_BYTES],
                                          x_layout)
    w_desc = TensorDescriptor.from_tensor(torch.empty(512, 2048, dtype=torch.uint8), [hopper.BLOCK_N, hopper.STEP_BYTES],
                                          w_layout)
    kernel = hopper._mm_hopper_kernel
    types = {"xlo_desc": x_desc.__mangle__(), "xhi_desc": x_desc.__mangle__(), "w_desc": w_desc.__mangle__(),
             "ws_ptr": "*i32", "alpha_ptr": "*fp32", "alpha_b_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32"}
    constexprs = dict(ALPHA_FROM_SCALES=False, ALPHA_DIV_RN=False, PARTIAL=partial, STAGES=hopper.STAGES,
                      GROUP_M=hopper.GROUP_M, SCALE_AHEAD=hopper.SCALE_AHEAD,
                      FRAGMENT_ORDER=fragment_order,
                      CODES_LAYOUT=hopper.codes_layout() if fragment_order else None, num_warps=hopper.NUM_WARPS)
    signature = {p.name: "constexpr" if p.name in constexprs else types.get(p.name, "i32") for p in kernel.params}
    source = GluonASTSource(fn=kernel, signature=signature,
                            constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=hopper.NUM_WARPS, maxnreg=hopper.MAX_REGISTERS))
    usage = cuobjdump(compiled.asm["cubin"], "-res-usage")
    sass = cuobjdump(compiled.asm["cubin"], "-sass")
    line = next((ln.strip() for ln in usage.splitlines() if "REG:" in ln), usage.strip())
    return line, sass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-ms", default="64,128,256")
    parser.add_argument("--sass-dir", help="also write each form's SASS here")
    args = parser.parse_args(argv)
    print(f"Triton {triton.__version__}, sm_90")
    with tempfile.TemporaryDirectory() as directory:
        hopper = _module(directory)
        for block_m in (int(v) for v in args.block_ms.split(",")):
            for partial in (False, True):
                usage, sass = compile_report(hopper, block_m, partial)
                spills = len(re.findall(r"\bSTL\b", sass)), len(re.findall(r"\bLDL\b", sass))
                print(f"block_m={block_m} split-K={partial}: {usage} | STL {spills[0]} LDL {spills[1]}", flush=True)
                if args.sass_dir:
                    pathlib.Path(args.sass_dir, f"hopper_t{block_m}_{'split' if partial else 'one'}.sass").write_text(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
