"""End to end: does a TP model run faster with fp4fuse switched on? The number fp4fuse is judged by.

    PYTHONPATH=. python benchmarks/bench_e2e.py --tp 2 [--tokens 16,128,1024] [--modes default,cudagraphs]
        [--out results.md --json raw.json]
    python benchmarks/bench_e2e.py --render raw.json --out results.md --plot results.png   # no GPU needed

The model is one nobody wrote for fp4fuse: Hugging Face transformers' ``LlamaModel`` with
Llama-3-8B-shaped decoder layers (hidden 4096, 32 heads, 8 KV heads, FFN 14336; ``--layers``,
default 4; no LM head) -- or, with ``--family qwen2``, ``Qwen2Model`` (q/k/v with biases) at the
sizes given, e.g. Qwen2-7B's ``--hidden 3584 --heads 28 --kv-heads 4 --ffn 18944``; ``--family
olmo2 | glm | phi3`` take plans that gather column-parallel outputs and split row-parallel inputs
(``colwise_gather_output`` / ``rowwise_split_input``); ``--family qwen3`` has a per-head RMSNorm on
the q and k projections (Qwen3-8B: ``--hidden 4096 --heads 32 --kv-heads 8 --ffn 12288``); ``--family
mistral`` is Llama's graph under another class; ``--family gemma2`` has sandwich norms (a
norm on each sublayer's all-reduced output, before the residual add; head_dim 256) -- with random
weights from one seed, put on ``--tp`` ranks by ``fp4fuse.tp.parallelize`` with its config's own
``base_model_tp_plan``. Variants, built on every rank from the same weights and timed in the same
process, interleaved round by round:

* ``bf16``: the TP model with bf16 linears, ``torch.compile`` (no fp4fuse pass);
* ``bf16-fp4fuse``: the same with ``FusionPass(FusionConfig(enable_async_tp=True))``: what fp4fuse does
  to a bf16 model (its all-reduces through symmetric memory; the NVFP4 rewrites find nothing), the
  baseline that isolates the weight format from the collectives;
* ``nvfp4``: NVFP4 linears (dynamic activation scales; ``--static-scales``: static ones calibrated
  once from the bf16 model, as a checkpoint's ``input_scale``), ``torch.compile`` without fp4fuse;
* ``lowered``: + ``FusionPass(FusionConfig())``: no fusion; repeated computations merged (one quantization
  of an activation several linears read), fp4fuse's op calls lowered to kernels;
* ``sp``: + sequence parallelism at every size (``min_tokens=0``);
* ``fp4fuse``: + sequence parallelism + AsyncTP, shipped defaults (what a serving engine's flag
  does: each rewrite only from its measured crossover, fp4fuse.patterns.thresholds);
* ``forced``: the same with every threshold at 0 (``min_tokens=0``, ``FP4FUSE_OVERLAP_MIN_ROWS=0``);
* ``fp4fuse-sl``: ``fp4fuse`` compiled with Inductor's ``static_launch_user_defined_triton_kernels``
  option: the kernels fp4fuse's lowering puts in the graph (user-defined Triton kernels to Inductor)
  launched by Inductor's static launcher instead of Triton's Python launcher: the default launch
  mode's host time;
* ``fp4fuse-bucketed``: ``fp4fuse`` compiled with Inductor's ``bucket_all_gathers_fx="all"``, which
  coalesces a graph's all-gathers into fewer collectives: the gathers of codes and scales that
  sequence parallelism leaves one per quantization with a static scale of its own.

A variant whose compile or first call fails is reported and dropped (the others still run).

Token counts T are shaped like serving batches: up to 256 tokens as decode steps ``[T, 1]``
(T sequences of one token), above as prefill chunks ``[T / 512, 512]``. The batch dimension is
dynamic (``torch._dynamo.mark_dynamic``), so each variant compiles once per shape family (plus once
more where a pass's size threshold splits the range); ``--static`` compiles each token count on its
own instead (what a serving engine that captures fixed batch sizes does). With a dynamic batch
fp4fuse's kernel lowering guards the row count to the range of each launch choice, so a variant
with it may compile once more per range (``fp4fuse.passes.lowering``). Every variant compiles with
``torch._inductor.config.emulate_precision_casts = True``, so that the NVFP4 variants' outputs can
be compared bit for bit (README, "Numerics"). Launch modes: ``default`` (the host launches every
kernel), ``cudagraphs`` (``options={"triton.cudagraphs": True}``: Inductor's CUDA-graph trees, whose
per-call host work -- guards, input checks -- stays in the time) and ``replay`` (the default-mode
compiled forward captured once per token count in a ``torch.cuda.CUDAGraph`` and replayed, as a
serving engine that captures its decode batch sizes runs it: the time is the device's), and, for
``bf16`` and ``nvfp4`` only, ``eager`` (no ``torch.compile``: the model as a user without it runs it,
under ``torch.no_grad()``) and ``eager-inference`` (the same under ``torch.inference_mode()``, where
the dispatcher skips the autograd layer of fp4fuse's ``custom_op`` ops). A time is the median
over rounds of the wall time of ``--iters`` back-to-back forwards on rank 0 (after a barrier and a
device sync), so it includes host overhead where the host is the bottleneck.

Results: a dated markdown table (per mode and T: ms per forward of each variant, fp4fuse / nvfp4 and
fp4fuse / bf16 speedups) with the device, torch, Triton and transformers versions, the JSON of every
measurement, and (``--render``) a PNG plot. Progress goes to stderr as it compiles and runs.

``--profile``: after the timings of each T, every variant runs ``--iters`` more forwards under
``torch.profiler`` (every rank runs them; rank 0 reports): per forward, the wall time, the summed
device-kernel time (``device busy``: kernels that overlap count twice) and the host time of the
profiled ops, and the ops with the most device and host time. Wall time well above device busy
means the host is the limit; the tables say which ops cost it.

``--cpp-wrapper``: every variant compiles with Inductor's C++ wrapper (``cpp_wrapper=True``), which
launches the graph's kernels from C++ instead of Python: the default mode's host time without CUDA
graphs.

``--skip-module-guards``: every variant compiles with ``options={"guard_filter_fn":
torch.compiler.skip_guard_on_all_nn_modules_unsafe}`` (README, "Use"): Dynamo's per-call check
leaves out the guards on module state (a weight changed after compiling does not recompile), whose
cost grows with the modules the forward reads -- 26 guards an NVFP4 linear, 13 a bf16 one. It
acts in the ``default`` and ``cudagraphs`` modes; a replayed graph runs no guards. Dynamo's cache
is per code object and matches a compiled model by its backend: without module guards, two models
of one class compiled with equal options share one entry, and the second runs the first one's
graph (README, "Use"). ``bf16`` and ``nvfp4`` are such a pair (both without a pass), so the flag
refuses them together.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any

VARIANTS = ("bf16", "bf16-fp4fuse", "nvfp4", "lowered", "sp", "fp4fuse", "forced", "fp4fuse-sl", "fp4fuse-bucketed")
DECODE_MAX_TOKENS = 256
PREFILL_SEQ = 512


@dataclasses.dataclass(frozen=True)
class BenchArgs:
    tp: int
    layers: int
    tokens: tuple[int, ...]
    modes: tuple[str, ...]
    variants: tuple[str, ...]
    iters: int
    rounds: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    partial: str | None = None
    static: bool = False
    profile: bool = False
    deterministic: bool = False
    profile_kernels: int = 0
    static_scales: bool = False
    family: str = "llama"
    cpp_wrapper: bool = False
    skip_module_guards: bool = False


#: ``--family`` -> (config class, model class) in ``transformers``.
FAMILIES = {"llama": ("LlamaConfig", "LlamaModel"), "qwen2": ("Qwen2Config", "Qwen2Model"),
            "olmo2": ("Olmo2Config", "Olmo2Model"), "glm": ("GlmConfig", "GlmModel"), "phi3": ("Phi3Config", "Phi3Model"),
            "gemma2": ("Gemma2Config", "Gemma2Model"), "qwen3": ("Qwen3Config", "Qwen3Model"),
            "mistral": ("MistralConfig", "MistralModel")}
#: config fields a family needs beyond the sizes: special token ids inside the 32000-token vocabulary
#: (their defaults point past it, and the embedding's padding row must exist)
_FAMILY_EXTRAS = {family: {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
                  for family in ("olmo2", "glm", "phi3", "gemma2")}


def log(msg: str) -> None:
    print(f"[bench_e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def batch_shape(tokens: int) -> tuple[int, int]:
    """``[batch, seq]`` of a T-token step: decode ``[T, 1]`` up to DECODE_MAX_TOKENS, else prefill chunks."""
    if tokens <= DECODE_MAX_TOKENS:
        return tokens, 1
    if tokens % PREFILL_SEQ:
        raise ValueError(f"--tokens: {tokens} > {DECODE_MAX_TOKENS} must be a multiple of {PREFILL_SEQ}")
    return tokens // PREFILL_SEQ, PREFILL_SEQ


# ----------------------------------------------------------------------------------------------
# on every rank
# ----------------------------------------------------------------------------------------------
def _build_models(args: BenchArgs, device, group) -> dict[str, Any]:
    import torch
    import transformers

    from fp4fuse.tp import WeightFormat, parallelize

    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[args.family])
    config = config_class(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=32000,
        max_position_embeddings=8192, **_FAMILY_EXTRAS.get(args.family, {}))
    models = {}
    for fmt in (WeightFormat.BF16, WeightFormat.NVFP4):
        torch.manual_seed(0)  # the same weights on every rank and for both formats
        with torch.device(device):
            model = model_class(config).to(torch.bfloat16).eval()
        scales = calibrated_scales(model) if args.static_scales and fmt is WeightFormat.NVFP4 else None
        models[fmt] = parallelize(model, group, weight_format=fmt, activation_scales=scales)
    return models


def calibrated_scales(model, batches: int = 2, seq: int = 64) -> dict[str, float]:
    """A checkpoint's static activation scales: ``448 * 6 / amax`` of each planned linear's input
    over ``batches`` random sequences (the same on every rank: a fixed seed), from the whole model
    before it is parallelized."""
    import torch

    from fp4fuse.nvfp4.format import global_scale_from_amax
    from fp4fuse.tp.plan import resolve_plan

    amax: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(_module, args):
            seen = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax[name], seen) if name in amax else seen
        return hook

    names = resolve_plan(model, model.config.base_model_tp_plan)
    hooks = [model.get_submodule(name).register_forward_pre_hook(record(name)) for name in names]
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batches, seq), generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        model(input_ids=ids.to(device))
    for hook in hooks:
        hook.remove()
    return {name: float(global_scale_from_amax(a)) for name, a in amax.items()}


def _captured(call: Any) -> tuple[Any, Any]:
    """``call`` captured in a CUDA graph after two warm-up calls on a side stream (every rank
    captures the same collectives): ``(graph, output)``, the output rewritten by each replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def unsafe_without_module_guards(args: BenchArgs) -> str | None:
    """Why ``args`` cannot skip the module guards (module docstring, ``--skip-module-guards``), or None."""
    if args.skip_module_guards and {"bf16", "nvfp4"} <= set(args.variants):
        return ("bf16 and nvfp4 compile with equal options, so without module guards the second would run "
                "the first one's graph; time them in separate processes")
    return None


#: Launch modes that run the model uncompiled, and the grad-mode context each times it under.
EAGER_MODES = ("eager", "eager-inference")
#: The variants an eager mode runs (the others are compiled passes).
EAGER_VARIANTS = ("bf16", "nvfp4")


def _grad_context(mode: str):
    """``torch.inference_mode`` for ``eager-inference``, ``torch.no_grad`` for every other mode."""
    import torch

    return torch.inference_mode if mode == "eager-inference" else torch.no_grad


def _compiled_variants(args: BenchArgs, models: dict[Any, Any], mode: str) -> dict[str, Any]:
    import torch

    import fp4fuse
    from fp4fuse.tp import WeightFormat

    if mode in EAGER_MODES:  # the models themselves, no pass
        formats = {"bf16": WeightFormat.BF16, "nvfp4": WeightFormat.NVFP4}
        return {name: (models[formats[name]], None) for name in args.variants if name in EAGER_VARIANTS}

    def compiled(model, fusion, **extra):
        # a fresh dict: torch.compile pops guard_filter_fn
        options = {"triton.cudagraphs": mode == "cudagraphs", **extra}
        if args.skip_module_guards:
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        if fusion is not None:
            options["post_grad_custom_post_pass"] = fusion
        return torch.compile(model, options=options)

    Cfg = fp4fuse.FusionConfig
    configs = {
        "nvfp4": None,
        "lowered": Cfg(),
        "sp": Cfg(enable_sequence_parallelism=True, min_tokens=0),
        "fp4fuse": Cfg(enable_async_tp=True),
        "forced": Cfg(enable_async_tp=True, min_tokens=0),
    }
    #: variants that are ``fp4fuse`` with Inductor options added to the common ones
    extra_options = {"fp4fuse-sl": {"static_launch_user_defined_triton_kernels": True},
                     "fp4fuse-bucketed": {"bucket_all_gathers_fx": "all"}}
    configs.update(dict.fromkeys(extra_options, configs["fp4fuse"]))
    out = {}
    for name in args.variants:
        if name == "bf16":
            out[name] = (compiled(models[WeightFormat.BF16], None), None)
        elif name == "bf16-fp4fuse":
            fusion = fp4fuse.FusionPass(configs["fp4fuse"])
            out[name] = (compiled(models[WeightFormat.BF16], fusion), fusion)
        else:
            fusion = None if configs[name] is None else fp4fuse.FusionPass(configs[name])
            out[name] = (compiled(models[WeightFormat.NVFP4], fusion, **extra_options.get(name, {})), fusion)
    return out


class _ForcedOverlap:
    """``FP4FUSE_OVERLAP_MIN_ROWS=0`` while the ``forced`` variant runs (set the same on every rank)."""

    def __init__(self, active: bool) -> None:
        self.active = active

    def __enter__(self) -> None:
        if self.active:
            os.environ["FP4FUSE_OVERLAP_MIN_ROWS"] = "0"

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            os.environ.pop("FP4FUSE_OVERLAP_MIN_ROWS", None)


def _time_ms(fn, iters: int) -> float:
    """Wall ms per call of ``iters`` back-to-back calls, the ranks aligned before, the device synced after."""
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


#: Ops listed per profiled variant, by device time and by host time.
PROFILE_TOP = 6


def profile_summary(prof: Any, forwards: int, wall_ms: float, kernels: int = 0) -> dict[str, Any]:
    """Per-forward milliseconds of a ``torch.profiler`` run over ``forwards`` forwards that took
    ``wall_ms`` each: ``device_busy_ms`` (summed self device time of every op: overlapping kernels
    count twice), ``host_ms`` (summed self CPU time of the profiled ops) and the ``PROFILE_TOP`` ops
    with the most of each, as ``(name, ms per forward, calls per forward)``; with ``kernels`` > 0,
    also ``kernels``: that many device kernels (memsets and copies included) with the most time,
    the same way, and ``kernel_ms`` / ``kernel_launches``: the sum of all kernels' time and count
    per forward."""
    from torch.autograd import DeviceType

    rows, device_rows = [], []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0.0)
        row = (e.key, device_us / 1e3 / forwards, e.self_cpu_time_total / 1e3 / forwards, e.count / forwards)
        rows.append(row)
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            device_rows.append(row)

    def top(col: int, source: list, limit: int) -> list[tuple[str, float, float]]:
        ranked = sorted((r for r in source if r[col] > 0), key=lambda r: -r[col])[:limit]
        return [(r[0][:80], round(r[col], 4), round(r[3], 2)) for r in ranked]

    summary = {"wall_ms": wall_ms, "device_busy_ms": sum(r[1] for r in rows), "host_ms": sum(r[2] for r in rows),
               "top_device": top(1, rows, PROFILE_TOP), "top_host": top(2, rows, PROFILE_TOP)}
    if kernels:
        summary["kernels"] = top(1, device_rows, kernels)
        summary["kernel_ms"] = sum(r[1] for r in device_rows)
        summary["kernel_launches"] = sum(r[3] for r in device_rows)
    return summary


def _profiled(fn, iters: int, kernels: int) -> dict[str, Any]:
    """``profile_summary`` of ``iters`` forwards of ``fn``, timed as ``_time_ms`` times them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_ms = _time_ms(fn, iters)
    return profile_summary(prof, iters, wall_ms, kernels)


def _drop_failed(results: dict[str, Any], variants: dict[str, Any], key: str, exc: Exception, rank: int) -> None:
    """Record ``exc`` (with the innermost frames, where the cause is) under ``key`` and drop the
    variant, so that the others still run."""
    import traceback

    frames = "".join(traceback.format_tb(exc.__traceback__)[-3:])
    log(f"rank {rank}: {key} failed: {type(exc).__name__}: {exc}\n{frames}"[-3000:])
    results["errors"][key] = f"{type(exc).__name__}: {exc}"[:2000] + f"\n{frames}"[-1500:]
    variants.pop(key.rsplit("/", 1)[-1], None)


def _rank_main(args: BenchArgs) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    # every variant compiles the same forward (one Dynamo cache per code object)
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    # Inductor rounds low-precision intermediates where eager does: otherwise where it rounds depends on
    # its fusion decisions, which fp4fuse's rewrites change, and a dynamic NVFP4 scale turns one last-bit
    # change into many flipped codes, so the variants' outputs could not be held to bitwise equality.
    torch._inductor.config.emulate_precision_casts = True
    if args.deterministic:  # no numerics-changing autotuning: a reduction's configuration no longer follows its row count
        torch._inductor.config.deterministic = True
    if args.cpp_wrapper:  # every variant's wrapper in C++ (Inductor's ``cpp_wrapper``): kernel launches without Python
        torch._inductor.config.cpp_wrapper = True
    if args.static:  # one graph per token count, every size known when fp4fuse's passes run
        torch._dynamo.config.automatic_dynamic_shapes = False
    group = dist.group.WORLD
    say = log if rank == 0 else (lambda msg: None)
    say(f"building {args.layers}-layer Llama (hidden {args.hidden}, ffn {args.ffn}) at TP={args.tp}")
    models = _build_models(args, device, group)
    results: dict[str, Any] = {"times": {}, "counts": {}, "max_rel_diff": {}, "output_sha1": {}, "errors": {},
                               "profiles": {}, "graphs": {},
                               "emulate_precision_casts": torch._inductor.config.emulate_precision_casts}
    for mode in args.modes:
        variants = _compiled_variants(args, models, mode)
        for tokens in args.tokens:
            batch, seq = batch_shape(tokens)
            ids = torch.randint(0, 32000, (batch, seq), generator=torch.Generator().manual_seed(tokens)).to(device)
            if not args.static:
                torch._dynamo.mark_dynamic(ids, 0)
            outs, calls = {}, {}
            for name, (model, fusion) in list(variants.items()):
                say(f"{mode} T={tokens}: compiling / warming up {name}")
                compiled_before = fusion.calls if fusion is not None else 0
                try:
                    with _ForcedOverlap(name == "forced"), _grad_context(mode)():
                        for _ in range(3):
                            out = model(input_ids=ids).last_hidden_state
                        if fusion is not None:  # which graph this count runs: a new one (with its own counts) or not
                            new = fusion.calls - compiled_before
                            results["graphs"][f"{mode}/{tokens}/{name}"] = {
                                "compiled": new, "counts": dict(fusion.last_match_counts) if new else None}
                        calls[name] = (lambda m=model: m(input_ids=ids).last_hidden_state)
                        if mode == "replay":
                            graph, out = _captured(calls[name])
                            calls[name] = graph.replay
                            graph.replay()
                        outs[name] = out.float().clone()
                except Exception as exc:  # noqa: BLE001 - reported; the other variants still run
                    calls.pop(name, None)
                    _drop_failed(results, variants, f"{mode}/{tokens}/{name}", exc, rank)
                    continue
            for name, out in outs.items():
                # the output's bits, to compare across runs (processes, cache states) as well
                results["output_sha1"][f"{mode}/{tokens}/{name}"] = hashlib.sha1(
                    out.cpu().numpy().tobytes()).hexdigest()[:16]
                ref = outs.get("bf16" if name.startswith("bf16") else "nvfp4")
                if ref is not None:
                    rel = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                    results["max_rel_diff"][f"{mode}/{tokens}/{name}"] = rel
                full = outs.get("bf16")
                if full is not None and not name.startswith("bf16"):
                    # the weight format's error: an NVFP4 variant against the bf16 model
                    results.setdefault("rel_to_bf16", {})[f"{mode}/{tokens}/{name}"] = (
                        (out - full).norm() / full.norm().clamp_min(1e-30)).item()
            say(f"{mode} T={tokens} output sha1: " + ", ".join(
                f"{name} {results['output_sha1'][f'{mode}/{tokens}/{name}']}" for name in outs))
            samples: dict[str, list[float]] = {name: [] for name in variants}
            say(f"{mode} T={tokens}: timing {', '.join(calls)}")
            for _ in range(args.rounds):
                for name, fn in list(calls.items()):
                    try:
                        with _ForcedOverlap(name == "forced"), _grad_context(mode)():
                            samples[name].append(_time_ms(fn, args.iters))
                    except Exception as exc:  # noqa: BLE001 - every rank runs the same graphs, so all fail alike
                        _drop_failed(results, variants, f"{mode}/{tokens}/{name}", exc, rank)
                        del calls[name], samples[name]
            for name, values in samples.items():
                results["times"][f"{mode}/{tokens}/{name}"] = statistics.median(values)
            line = ", ".join(f"{n} {statistics.median(v):.3f}" for n, v in samples.items())
            say(f"{mode} T={tokens} ms/forward: {line}")
            for name, fn in calls.items() if args.profile else ():
                with _ForcedOverlap(name == "forced"), _grad_context(mode)():
                    summary = _profiled(fn, args.iters, args.profile_kernels)
                results["profiles"][f"{mode}/{tokens}/{name}"] = summary
                say(f"{mode} T={tokens} {name} profile: wall {summary['wall_ms']:.3f} ms, device busy "
                    f"{summary['device_busy_ms']:.3f} ms, host ops {summary['host_ms']:.3f} ms per forward")
                if "kernels" in summary:
                    say(f"  kernels: {summary['kernel_ms']:.3f} ms in {summary['kernel_launches']:.1f} launches "
                        f"per forward; " + "; ".join(f"{k} {ms * 1e3:.1f} us x{n}" for k, ms, n in summary["kernels"]))
            for name, (_, fusion) in variants.items():
                if fusion is not None:
                    results["counts"][f"{mode}/{name}"] = dict(fusion.match_counts)
            if rank == 0 and args.partial:  # what a run cut short by its time limit still leaves
                with open(args.partial, "w") as f:
                    json.dump(_raw(results, args), f)
        del variants
        torch._dynamo.reset()
    return results


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def _raw(results: dict[str, Any], args: BenchArgs) -> dict[str, Any]:
    """The JSON record of a run (``--render`` draws it): results, arguments, versions, date, command."""
    return {**results, "args": dataclasses.asdict(args), "versions": _versions(),
            "date": datetime.date.today().isoformat(), "command": "python " + " ".join(sys.argv)}


def _versions() -> dict[str, str]:
    import torch
    info = {"torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = "not installed"
    info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return info


def render_markdown(raw: dict[str, Any]) -> str:
    args, times = raw["args"], raw["times"]
    lines = [
        f"# End to end, TP={args['tp']}: fp4fuse on vs off, NVFP4 vs bf16 ({raw['date']})", "",
        f"Device: {raw['versions']['device']} x{args['tp']}; torch {raw['versions']['torch']}, Triton "
        f"{raw['versions']['triton']}, transformers {raw['versions']['transformers']}. Model: HF "
        f"`{FAMILIES[args.get('family', 'llama')][1]}`, "
        f"{args['layers']} layers, hidden {args['hidden']}, {args['heads']} heads / {args['kv_heads']} KV heads, "
        f"FFN {args['ffn']}, random bf16 weights, `fp4fuse.tp.parallelize` with the config's TP plan; token "
        f"dimension {'static (one compile per count)' if args.get('static') else 'dynamic (mark_dynamic)'}; "
        f"NVFP4 activation scales {'static, calibrated once' if args.get('static_scales') else 'dynamic'}; "
        + ("Inductor `emulate_precision_casts=True`. " if raw.get("emulate_precision_casts") else "")
        + ("Inductor `cpp_wrapper=True` (every variant). " if args.get("cpp_wrapper") else "")
        + ("`guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe` (every variant). "
           if args.get("skip_module_guards") else "") +
        "Command: `" + raw["command"] + "`.", "",
        "Milliseconds per forward (median over rounds of back-to-back forwards, rank 0 wall time; "
        "variants interleaved in one process). `fp4fuse/nvfp4` is the speedup of switching fp4fuse on "
        "(shipped defaults) over the same NVFP4 model compiled without it; `fp4fuse/bf16` over the bf16 model; "
        "`fp4fuse/bf16-fp4fuse` over the bf16 model with fp4fuse on (the same collectives: the weight "
        "format alone).", "",
    ]
    variants = [v for v in VARIANTS if v in args["variants"]]
    for mode in args["modes"]:
        lines += [f"## Launch mode: {mode}", "",
                  "| tokens | " + " | ".join(variants) + " | fp4fuse/nvfp4 | fp4fuse/bf16 | fp4fuse/bf16-fp4fuse |",
                  "| --- |" + " --- |" * (len(variants) + 3)]
        for tokens in args["tokens"]:
            row = [times.get(f"{mode}/{tokens}/{v}") for v in variants]
            cells = [f"{t:.3f}" if t is not None else "-" for t in row]
            get = lambda v: times.get(f"{mode}/{tokens}/{v}")  # noqa: E731
            speed = lambda a, b: f"{get(b) / get(a):.2f}x" if get(a) and get(b) else "-"  # noqa: E731
            lines.append(f"| {tokens} | " + " | ".join(cells) + f" | {speed('fp4fuse', 'nvfp4')} | "
                         f"{speed('fp4fuse', 'bf16')} | {speed('fp4fuse', 'bf16-fp4fuse')} |")
        lines.append("")
    lines += ["## Fusions per compiled model (cumulative over its graphs)", ""]
    for key, counts in sorted(raw["counts"].items()):
        lines.append(f"- `{key}`: " + (", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"))
    graphs = raw.get("graphs", {})
    if graphs:
        lines += ["", "## The graph each token count ran (new graphs with their own counts)", ""]

        def order(key: str) -> tuple[str, int, str]:
            mode, tokens, name = key.split("/")
            return mode, int(tokens), name

        for key, graph in sorted(graphs.items(), key=lambda item: order(item[0])):
            counts = graph["counts"]
            what = ("reused an earlier graph" if not graph["compiled"] else
                    f"{graph['compiled']} new graph(s): " + (", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
                                                            or "nothing fused"))
            lines.append(f"- `{key}`: {what}")
    for key, error in sorted(raw.get("errors", {}).items()):
        lines.append(f"- failed: `{key}`: {error[:300]}")
    diffs = raw.get("max_rel_diff", {})
    if diffs:
        worst = max((v for k, v in diffs.items() if "/bf16" not in k), default=0.0)
        worst_bf16 = max((v for k, v in diffs.items() if k.endswith("/bf16-fp4fuse")), default=None)
        lines += ["", f"Largest relative difference of an NVFP4 variant's output from `nvfp4`: {worst:.2e}."]
        if worst_bf16 is not None:
            lines.append(f"Largest relative difference of `bf16-fp4fuse`'s output from `bf16`: {worst_bf16:.2e}.")
    lines += render_profiles(raw.get("profiles", {}))
    return "\n".join(lines) + "\n"


def render_profiles(profiles: dict[str, Any]) -> list[str]:
    """Markdown lines for ``--profile`` (nothing without it): one row per mode / T / variant."""
    if not profiles:
        return []
    lines = ["", "## Where the time goes (`--profile`, rank 0, ms per forward)", "",
             "| mode / tokens / variant | wall | device busy | host ops | top device ops | top host ops |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key, p in profiles.items():
        ops = lambda col: "; ".join(f"`{n}` {ms:.3f} ({calls:g}x)" for n, ms, calls in p[col][:3])  # noqa: E731
        lines.append(f"| {key} | {p['wall_ms']:.3f} | {p['device_busy_ms']:.3f} | {p['host_ms']:.3f} | "
                     f"{ops('top_device')} | {ops('top_host')} |")
    return lines


def render_plot(raw: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args, times = raw["args"], raw["times"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, baseline in zip(axes, ("nvfp4", "bf16")):
        for mode, style in zip(args["modes"], ("-o", "--s", ":^")):
            for variant in ("lowered", "sp", "fp4fuse", "forced", "fp4fuse-sl", "fp4fuse-bucketed"):
                if variant not in args["variants"]:
                    continue
                xs, ys = [], []
                for t in args["tokens"]:
                    a, b = times.get(f"{mode}/{t}/{variant}"), times.get(f"{mode}/{t}/{baseline}")
                    if a and b:
                        xs.append(t)
                        ys.append(b / a)
                ax.plot(xs, ys, style, label=f"{variant} ({mode})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per forward")
        ax.set_title(f"speedup over {baseline} (higher is better)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("speedup")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"fp4fuse end to end, TP={args['tp']}, {raw['versions']['device']}, {raw['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (one GPU per rank)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--tokens", default="16,128,1024,4096,8192,16384,32768", help="token counts, comma-separated")
    p.add_argument("--modes", default="default,cudagraphs",
                   help="launch modes: default, cudagraphs, replay, eager, eager-inference")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    p.add_argument("--iters", type=int, default=10, help="back-to-back forwards per timing sample")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median)")
    p.add_argument("--family", default="llama", choices=sorted(FAMILIES),
                   help="Hugging Face model family (qwen2: q/k/v with biases); the sizes below set its shape")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--out", help="markdown results file")
    p.add_argument("--json", help="raw results (JSON)")
    p.add_argument("--plot", help="PNG plot (with --render)")
    p.add_argument("--partial", help="rank 0 rewrites this JSON after every token count (survives a time limit)")
    p.add_argument("--render", help="render --out/--plot from a JSON written earlier; runs nothing")
    p.add_argument("--static", action="store_true", help="compile each token count separately (static sizes)")
    p.add_argument("--static-scales", action="store_true",
                   help="NVFP4 activations with static scales calibrated once (a checkpoint's input_scale) "
                        "instead of a dynamic amax per call")
    p.add_argument("--profile", action="store_true",
                   help="after each token count's timings, profile --iters forwards per variant (module doc)")
    p.add_argument("--profile-kernels", type=int, default=0, metavar="N",
                   help="with --profile, also list the N device kernels with the most time per forward")
    p.add_argument("--cpp-wrapper", action="store_true",
                   help="compile every variant with Inductor's C++ wrapper (torch._inductor.config.cpp_wrapper)")
    p.add_argument("--skip-module-guards", action="store_true",
                   help="compile every variant with guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe")
    p.add_argument("--deterministic", action="store_true",
                   help="torch._inductor.config.deterministic: Inductor keeps no numerics-changing autotuning result")
    ns = p.parse_args(argv)
    if ns.render:
        with open(ns.render) as f:
            raw = json.load(f)
        if ns.out:
            with open(ns.out, "w") as f:
                f.write(render_markdown(raw))
        if ns.plot:
            render_plot(raw, ns.plot)
        return 0
    args = BenchArgs(ns.tp, ns.layers, tuple(int(t) for t in ns.tokens.split(",")),
                     tuple(ns.modes.split(",")), tuple(ns.variants.split(",")), ns.iters, ns.rounds,
                     ns.hidden, ns.heads, ns.kv_heads, ns.ffn, ns.partial, ns.static, ns.profile, ns.deterministic,
                     ns.profile_kernels, ns.static_scales, ns.family, ns.cpp_wrapper, ns.skip_module_guards)
    reason = unsafe_without_module_guards(args)
    if reason is not None:
        p.error(f"--skip-module-guards: {reason}")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown or set(args.modes) - {"default", "cudagraphs", "replay", *EAGER_MODES}:
        p.error(f"unknown variants {sorted(unknown)} or modes {args.modes}")
    for t in args.tokens:
        batch_shape(t)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from fp4fuse.launch import run_on_ranks
    # CUDA-graph runs have hung in process-group teardown: ranks exit right after their result.
    results = run_on_ranks(_rank_main, args.tp, args, timeout=3600, backend="nccl", hard_exit=True)[0]
    raw = _raw(results, args)
    text = render_markdown(raw)
    print(text)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
