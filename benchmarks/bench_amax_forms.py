"""What a dynamic activation scale costs, and whether the form of its amax changes Inductor's kernels.

    PYTHONPATH=. python benchmarks/bench_amax_forms.py [--json raw.json]

An NVFP4 linear with a dynamic scale quantizes its input ``v`` with ``global_scale_from_amax(amax)``,
``amax = v.abs().amax()`` (``fp4fuse.nvfp4.quantizer.group_amax``). Inductor fuses that reduction into
the kernel producing ``v``. This script compiles (``torch.compile``, ``emulate_precision_casts``) the
three producers of a Llama layer's linear inputs followed by the amax, the global scale and
``fp4fuse::scaled_fp4_quant``:

* ``silu``: ``silu(gate) * up``, ``[T, 7168]`` (down_proj's input at TP=2);
* ``transpose``: the attention output ``[B, 16, S, 128]`` transposed to ``[T, 2048]`` (o_proj's input);
* ``norm``: an RMSNorm of ``[T, 4096]`` written as Hugging Face's ``LlamaRMSNorm`` (q/k/v's input);

each with the amax taken as ``full`` (the shipped form), ``rows`` (``amax(dim=-1)`` then ``amax()``:
the same value), ``chunks`` (maxima of 256 elements first) and, for the transpose, ``src_*`` (of the
tensor before the transpose: the same value), against ``static`` (a constant amax: what a
checkpoint's static scale costs). Every form but ``static`` must give the same bits. CUDA-graph
replays of the compiled function (bench_ops.bench_graph), microseconds; T = 16, 128 (decode steps)
and 1024 (two prefill chunks of 512). Results in benchmarks/results/.
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

import bench_ops  # benchmarks/, this script's folder
from fp4fuse.nvfp4 import format as nvfp4

TOKENS = (16, 128, 1024)

FORMS = {
    "full": lambda v: v.abs().amax(),
    "rows": lambda v: v.abs().amax(dim=-1).amax(),
    "chunks": lambda v: v.abs().reshape(-1, 256).amax(dim=-1).amax(),
    "static": lambda v: v.new_full((), 3.0),
}


def _quantized(v: torch.Tensor, amax: torch.Tensor):
    gs = nvfp4.global_scale_from_amax(amax.float().reshape(1))
    q, s = torch.ops.fp4fuse.scaled_fp4_quant(v, gs)
    return q, s.view(torch.uint8), gs


def silu_case(gate, up, form):
    v = F.silu(gate) * up
    return _quantized(v, FORMS[form](v))


def transpose_case(y, form):
    v = y.transpose(1, 2).reshape(-1, y.shape[1] * y.shape[3])
    if form.startswith("src_"):
        return _quantized(v, FORMS[form[4:]](y))
    return _quantized(v, FORMS[form](v))


def norm_case(x, weight, form):
    h = x.float()
    v = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    return _quantized(v, FORMS[form](v))


def run() -> list[dict]:
    torch._inductor.config.emulate_precision_casts = True
    dev = torch.device("cuda")
    rows = []
    for tokens in TOKENS:
        batch, seq = (tokens, 1) if tokens <= 128 else (tokens // 512, 512)
        cases = {
            "silu": (silu_case, (torch.randn(tokens, 7168, device=dev, dtype=torch.bfloat16),
                                 torch.randn(tokens, 7168, device=dev, dtype=torch.bfloat16)), ()),
            "transpose": (transpose_case, (torch.randn(batch, 16, seq, 128, device=dev, dtype=torch.bfloat16),),
                          ("src_full", "src_rows")),
            "norm": (norm_case, (torch.randn(tokens, 4096, device=dev, dtype=torch.bfloat16),
                                 torch.randn(4096, device=dev, dtype=torch.bfloat16)), ()),
        }
        for case, (fn, args, extra_forms) in cases.items():
            us, same = {}, {}
            ref = None
            for form in (*FORMS, *extra_forms):
                torch._dynamo.reset()
                compiled = torch.compile(functools.partial(fn, form=form), fullgraph=True)
                out = compiled(*args)
                if ref is None:
                    ref = out
                same[form] = all(torch.equal(a, b) for a, b in zip(out, ref))
                us[form] = bench_ops.bench_graph([functools.partial(compiled, *args)]) * 1e3
            bad = [f for f, ok in same.items() if not ok and f != "static"]
            print(f"AMAX T={tokens:<5d} {case:<9s} " + " ".join(f"{f}={t:.1f}" for f, t in us.items())
                  + (f" | DIFFERENT BITS: {bad}" if bad else ""), flush=True)
            rows.append({"tokens": tokens, "case": case, "us": us, "same_bits": same})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = bench_ops.script_args(__doc__, argv)
    if args is None:
        return 2
    bench_ops.write_raw(args.json, rows=run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
