"""Host time of torch.compile's guards per call, bf16 against NVFP4 TP linears, by model depth (CPU).

    PYTHONPATH=. python benchmarks/bench_guards.py [--layers 8,32] [--filter | --filter-tensors]

Before every call of a compiled model Dynamo checks the guards of its cache entry: the type,
attributes, hooks and tensors of every module the forward reads. An NVFP4 linear
(``fp4fuse.tp.parallelize``) carries 26 where a bf16 linear carries 13 (three tensors -- codes,
block scales, global scale -- its quantizer and its output dtype), and every guard is paid on every
call, with CUDA graphs (Inductor's trees) or without.

This script builds HF ``LlamaModel`` (tiny widths: guard time does not depend on them) at each depth
in bf16 and NVFP4, at TP=2 on two gloo ranks, compiles each with the eager backend (guards only
depend on the traced frame), and reports on rank 0 torch.profiler's ``TorchDynamo Cache Lookup``
self time per call over 20 calls, and the number of guards kept (a counting ``guard_filter_fn``
wraps the chosen one; without a filter it keeps every guard). ``--filter`` compiles with
``guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe``: no guards on module state,
as a server whose weights never change can afford (a changed weight is then not noticed), and unsafe
for two models of one class compiled with equal options (README, "Use"). ``--filter-tensors`` drops
only the tensor guards (``TENSOR_MATCH``) of module parameters and buffers, keeping every guard on
module structure and attributes: it tells whether those tensor checks are what the NVFP4 model's
extra guard time is made of.
Results in benchmarks/results/.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from fp4fuse.launch import run_on_ranks

CALLS = 20


def _skip_module_tensor_guards(entries) -> list[bool]:
    """guard_filter_fn: keep every guard but the tensor checks of module parameters and buffers."""
    return [not (e.guard_type == "TENSOR_MATCH" and e.orig_guard.source.is_unspecialized_nn_module()) for e in entries]


FILTERS = {"default": None, "filter": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
           "filter-tensors": _skip_module_tensor_guards}


def _rank_main(layers_list: tuple[int, ...], filter_name: str) -> list[str]:
    """On every rank (the TP linears hold collectives): the report lines, one per depth and format."""
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from fp4fuse.tp import WeightFormat, parallelize

    lines = []
    for layers in layers_list:
        config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                          max_position_embeddings=64)
        for fmt in (WeightFormat.BF16, WeightFormat.NVFP4):
            torch.manual_seed(0)
            model = parallelize(transformers.LlamaModel(config).to(torch.bfloat16).eval(), dist.group.WORLD,
                                weight_format=fmt)
            torch._dynamo.reset()
            kept: dict[str, int] = {}

            def counted(entries, chosen=FILTERS[filter_name]):
                keep = [True] * len(entries) if chosen is None else chosen(entries)
                kept["all"] = sum(keep)
                kept["tensor"] = sum(k for e, k in zip(entries, keep) if e.guard_type == "TENSOR_MATCH")
                return keep

            # a fresh dict each time: torch.compile takes guard_filter_fn out of the options it is given
            options = {"guard_filter_fn": counted}
            compiled = torch.compile(model, backend="eager", options=options)
            ids = torch.randint(0, config.vocab_size, (4, 1))
            with torch.no_grad():
                for _ in range(3):
                    compiled(input_ids=ids)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(CALLS):
                        compiled(input_ids=ids)
            lookup = next(e for e in prof.key_averages() if e.key == "TorchDynamo Cache Lookup")
            lines.append(f"layers {layers:3d} {fmt.name:5s} {filter_name}: "
                         f"cache lookup {lookup.self_cpu_time_total / CALLS:8.1f} us a call, "
                         f"{kept['all']} guards ({kept['tensor']} tensor guards)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="8,32", help="comma-separated depths")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--filter", action="store_true", help="skip the guards on module state")
    which.add_argument("--filter-tensors", action="store_true",
                       help="skip only the tensor guards of module parameters and buffers")
    args = parser.parse_args(argv)
    layers_list = tuple(int(v) for v in args.layers.split(","))
    filter_name = "filter" if args.filter else "filter-tensors" if args.filter_tensors else "default"
    print("\n".join(run_on_ranks(_rank_main, 2, layers_list, filter_name, timeout=3600.0)[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
