"""Randomized differential check of the fusion passes at TP=2 on gloo (CPU): run by hand, not
collected by pytest (a case compiles two graphs, 20-60 s of two CPU cores).

    PYTHONPATH=.:tests python tests/fuzz_fusion.py --cases 12 --seed 0
    PYTHONPATH=.:tests python tests/fuzz_fusion.py --cases 12 --seed 0 --device cuda   # 2 GPUs, NCCL

Each case draws a model and a configuration:

* fp4fuse's TP Llama (``fp4fuse.tp.TPLlamaModel``) with random sizes (no power of two required:
  hidden a multiple of 32, heads that split over 2 ranks), random norm form, static or dynamic
  activation scale, bf16 or fp32; or a tiny Hugging Face model (tests/hf_tiny.py: Llama, Qwen2,
  Qwen3, Granite, Starcoder2, OLMo 2, GLM, Phi-3, Gemma 3), fp32 or bf16, static or dynamic
  scales, vocabulary-parallel or replicated embedding, ``[batch, seq]`` token ids; from seed 7
  also unquantized (``WeightFormat.BF16``) linears and two layers;
* the passes: sequence parallelism, AsyncTP, norm + quant fusion each on or off, ``min_tokens``,
  ``rank_check``; from seed 7 AsyncTP's plain-GEMM variant (``enable_bf16_async_tp``; CUDA only,
  skipped with its reason elsewhere);
* the shapes: two to three calls with random token counts (odd ones, counts below and above
  ``min_tokens``), static shapes or the token / batch dimension marked dynamic at the first call;
  on CUDA, CUDA graphs or not (each shape then called three times: warm-up, capture, replay).

The reference is the same model compiled with ``FusionPass()`` (fp4fuse's defaults: no sequence
parallelism or AsyncTP; the symmetric-memory all-reduce, CSE, norm + quant fusion and kernel
lowering on) under the same dynamic setting, called with the same inputs; bf16
models compile with ``emulate_precision_casts`` (README "Numerics": the rewrites' bitwise promise
for low-precision torch-form norms holds under it). Every call's
output must equal it bit for bit (fp4fuse's claim at TP=2: fused graphs are bit-equal to unfused
ones) and be finite where the reference is; the reference, called twice, must repeat its own
bits (``"reference_repeats": false`` otherwise: something ran nondeterministically). A case that
raises is reported with its traceback. A differing call names how many elements differ and in
which rows and columns, and compares the two models' compiled code: the same sources or not, and
the Triton kernels of both that kept different configurations.

Prints one JSON line per case (``"ok"``, ``"differs"`` or ``"raised"``, the case, what fused) and
exits 1 if any case did not pass. ``--case N`` reruns case N of ``--seed`` alone; ``--set
FIELD=JSON`` (repeatable) overrides a field of every drawn case, to narrow a difference down, e.g.
``--case 1 --set async_tp=false --set 'shapes=[[4, 2]]'``. ``--control same`` compiles the
tested model as the reference (a difference then is not the rewrites' under test), ``--control
bare`` both without fp4fuse's pass (a difference then is torch's); on CUDA a differing case is
rerun as both controls and its line says how they came out.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import pathlib
import random
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch._inductor.codecache import PyCodeCache

import hf_tiny
from dist_utils import COMPILE_THREADS, run_on_ranks

WORLD = 2
HF_KINDS = ("llama", "qwen2", "qwen3", "granite", "starcoder2", "olmo2", "glm", "phi3", "gemma3")
#: From this seed on, HF models are drawn in bf16 too and Gemma 3 among them; earlier seeds draw as
#: when they ran (fp32, the first eight families), so their recorded cases still reproduce.
FIRST_HF_BF16_SEED = 4
#: From this seed on, HF models are also drawn with unquantized weights (``WeightFormat.BF16``: the
#: rewrites on plain GEMMs) and with two layers, and AsyncTP cases with its plain-GEMM variant.
FIRST_WEIGHT_FORMAT_SEED = 7
NORMS = ("fp4fuse", "torch_functional", "torch_manual")
CONTROLS = ("same", "bare")
#: the one line of an Inductor output module that differs between two compiles of one graph
_COMPILE_ID_COMMENT = "# AOT ID:"
#: no NVLink multicast; the collective GEMMs overlap at every size (the shipped thresholds would
#: leave these token counts to the functional path); Inductor keeps no benchmarked configuration
#: (on CUDA it times a reduction's candidate configurations, which change its numerics; seed 0's
#: case 3, HF Qwen2, differed from its reference by 2.8e-8 without this and matched with it)
CUDA_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "FP4FUSE_OVERLAP_MIN_ROWS": "0",
            "TORCHINDUCTOR_DETERMINISTIC": "1"}


@dataclasses.dataclass(frozen=True)
class Case:
    index: int
    model: str                      # "tp_llama" or an hf_tiny kind
    sizes: tuple[int, ...]          # tp_llama: hidden, intermediate, heads, kv_heads, layers, vocab; hf: (layers,) or ()
    dtype: str
    norm: str                       # tp_llama's norm form
    static_scale: bool
    vocab_parallel: bool            # hf: parallelize(embedding=...)
    sp: bool
    async_tp: bool
    norm_quant: bool
    min_tokens: int | None          # None: the shipped thresholds (every size on CPU)
    rank_check: str
    dynamic: bool
    device: str
    cudagraphs: bool                # CUDA only: triton.cudagraphs, each shape called 3 times
    shapes: tuple[tuple[int, ...], ...]  # tp_llama: (tokens,); hf: (batch, seq)
    weight_format: str = "nvfp4"    # hf: parallelize(weight_format=...)
    bf16_async_tp: bool = False     # AsyncTP on plain GEMMs too (CUDA only; skipped with a reason elsewhere)


def draw(index: int, seed: int, device: str = "cpu") -> Case:
    """Case ``index`` of ``seed``: the same case for the same pair, whatever else is drawn."""
    rng = random.Random(seed * 1_000_003 + index)
    extended = seed >= FIRST_HF_BF16_SEED
    model = rng.choice(("tp_llama", "tp_llama") + (HF_KINDS if extended else HF_KINDS[:-1]))
    dynamic = rng.random() < 0.4
    if model == "tp_llama":
        heads = rng.choice((2, 4, 6))
        kv_heads = rng.choice([k for k in (2, heads) if heads % k == 0])
        head_dim = rng.choice((16, 32, 48))
        hidden = heads * head_dim
        if hidden % 32:  # the row-parallel o shard's K (hidden / 2) must be 16-aligned
            hidden, heads = 2 * hidden, 2 * heads
        sizes = (hidden, 32 * rng.randint(2, 9), heads, kv_heads, rng.choice((1, 2)), 2 * rng.randint(40, 90))
        counts = [rng.choice((rng.randint(1, 17), rng.randint(18, 160))) for _ in range(rng.randint(2, 3))]
        shapes = tuple((t,) for t in counts)
        dtype = rng.choice(("bfloat16", "float32"))
    else:
        sizes = ()
        if dynamic:  # decode steps: the batch is dynamic, seq 1
            shapes = tuple((rng.randint(1, 9), 1) for _ in range(rng.randint(2, 3)))
        else:
            shapes = tuple((rng.randint(1, 4), rng.randint(1, 9)) for _ in range(rng.randint(1, 2)))
        dtype = rng.choice(("float32", "float32", "bfloat16")) if extended else "float32"
    async_tp = rng.random() < 0.6
    case = Case(index=index, model=model, sizes=sizes, dtype=dtype, norm=rng.choice(NORMS),
                static_scale=rng.random() < 0.5, vocab_parallel=rng.random() < 0.7,
                sp=async_tp or rng.random() < 0.7, async_tp=async_tp, norm_quant=rng.random() < 0.8,
                min_tokens=rng.choice((None, 0, 0, 4, 32)), rank_check=rng.choice(("first", "first", "always")),
                dynamic=dynamic, shapes=shapes, device=device, cudagraphs=device == "cuda" and rng.random() < 0.5)
    if seed < FIRST_WEIGHT_FORMAT_SEED:
        return case
    # drawn after everything above, so that the fields above follow the same draws as before
    bf16_async_tp = async_tp and rng.random() < 0.5
    if model == "tp_llama":
        return dataclasses.replace(case, bf16_async_tp=bf16_async_tp)
    weight_format = rng.choice(("nvfp4", "nvfp4", "bf16"))
    return dataclasses.replace(case, sizes=(rng.choice((1, 2)),), weight_format=weight_format,
                               static_scale=case.static_scale and weight_format == "nvfp4",
                               bf16_async_tp=bf16_async_tp)


def _build(case: Case):
    """The model on this rank and a function from a shape to its inputs."""
    device = torch.device("cuda", torch.cuda.current_device()) if case.device == "cuda" else torch.device("cpu")
    if case.model == "tp_llama":
        from fp4fuse.tp import LlamaConfig, NormImpl, TPGroup, TPLlamaModel
        hidden, inter, heads, kv_heads, layers, vocab = case.sizes
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                          num_heads=heads, num_kv_heads=kv_heads, norm_impl=NormImpl(case.norm),
                          act_global_scale=6.0 if case.static_scale else None, dtype=getattr(torch, case.dtype),
                          seed=case.index)
        model = TPLlamaModel(cfg, TPGroup.from_process_group(), device)

        def inputs(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(sum(shape))).to(device)
        return model, inputs, lambda out: out

    from fp4fuse.tp import WeightFormat, parallelize
    hf = hf_tiny.build(case.model, dtype=getattr(torch, case.dtype), seed=case.index,
                       layers=case.sizes[0] if case.sizes else 1)
    scales = hf_tiny.calibrate(hf, hf_tiny.token_ids(3, seq=4), kind=case.model) if case.static_scale else None
    model = parallelize(hf.to(device), weight_format=WeightFormat(case.weight_format), activation_scales=scales,
                        embedding=case.vocab_parallel)

    def hf_inputs(shape: tuple[int, ...]) -> torch.Tensor:
        return hf_tiny.token_ids(shape[0], seq=shape[1], seed=sum(shape)).to(device)
    return model, hf_inputs, lambda out: out.logits


def _run_case(case: Case, control: str | None = None, reference_first: bool = False) -> dict:
    """Compile and compare ``case`` (module docstring). ``control``: ``"same"`` compiles the tested
    model with the reference's ``FusionPass()`` too, ``"bare"`` compiles both without fp4fuse's pass
    (nothing of fp4fuse's rewrites, the always-on ones included)."""
    from fp4fuse.config import FusionConfig
    from fp4fuse.passes.manager import FusionPass

    torch._dynamo.reset()
    model, inputs, output = _build(case)
    fusion = FusionPass() if control else FusionPass(FusionConfig(
        enable_sequence_parallelism=case.sp, enable_async_tp=case.async_tp, enable_bf16_async_tp=case.bf16_async_tp,
        enable_norm_quant_fusion=case.norm_quant, min_tokens=case.min_tokens, rank_check=case.rank_check))

    def options(post_grad_pass: FusionPass) -> dict:
        return {} if control == "bare" else {"post_grad_custom_post_pass": post_grad_pass}
    shapes = None if case.dynamic else False
    fused = torch.compile(model, dynamic=shapes, options={**options(fusion), "triton.cudagraphs": case.cudagraphs})
    plain = torch.compile(model, dynamic=shapes, options=options(FusionPass()))
    kwargs = {} if case.model == "tp_llama" else {"use_cache": False}
    calls, fused_keys = [], collections.Counter()
    for i, shape in enumerate(case.shapes):
        ids = inputs(shape)
        if case.dynamic and i == 0:
            torch._dynamo.mark_dynamic(ids, 0)
        before, served_before = fusion.calls, fusion.cached_match_counts.copy()
        # bf16: Inductor rounds low-precision intermediates as eager does, the setting under which the
        # rewrites promise bitwise outputs (README "Numerics"; by default a torch-form norm after a
        # residual add may differ in last bits, which a dynamic NVFP4 scale amplifies)
        with torch.no_grad(), torch._inductor.config.patch(emulate_precision_casts=case.dtype != "float32"):
            # under CUDA graphs: warm-up, capture, replay; otherwise a first call and a second, every
            # output kept (a replay overwrites it); the modules Inductor loads during each model's
            # calls are its compiled code
            runs = [("tested", fused, 3 if case.cudagraphs else 2), ("reference", plain, 2)]
            results, modules = {}, {}
            for name, compiled, times in (runs[::-1] if reference_first else runs):
                results[name], modules[name] = _calls_and_loaded_modules(
                    lambda: output(compiled(ids, **kwargs)).clone(), times)
        outs, (ref, ref_again) = results["tested"], results["reference"]
        differing = [j for j, o in enumerate(outs) if not _same_values(o, ref)]
        out = outs[differing[0] if differing else -1]
        # what the passes rewrote in a graph compiled now, or recorded for one the FX graph cache served
        found = (fusion.last_match_counts if fusion.calls > before else {}), fusion.cached_match_counts - served_before
        for counts in found:
            fused_keys.update(counts)
        calls.append({"shape": shape, "equal": not differing,
                      "finite": bool(out.isfinite().all()) or not bool(ref.isfinite().all()),
                      "rel": hf_tiny.rel_error(out, ref), **_where_they_differ(out, ref),
                      **({"differing_calls": differing,
                          "code": _compiled_code_comparison(modules["tested"], modules["reference"])}
                         if differing else {}),
                      **({} if _same_values(ref, ref_again) else {"reference_repeats": False})})
    passed = all(c["equal"] and c["finite"] and "reference_repeats" not in c for c in calls)
    return {"status": "ok" if passed else "differs", "calls": calls,
            "fused": {k: v for k, v in fused_keys.items() if not k.startswith(("cleanup", "lowering"))}}


def _calls_and_loaded_modules(call: Callable[[], Any], times: int) -> tuple[list[Any], list[ModuleType]]:
    """``call()`` ``times`` times: the results, and the Python modules Inductor loaded meanwhile (the
    compiled code of what the calls compiled, or loaded again from its caches)."""
    loaded = len(PyCodeCache.modules)
    results = [call() for _ in range(times)]
    return results, PyCodeCache.modules[loaded:]


def _same_values(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Bit for bit the same values (a NaN where the other has a NaN counts as the same)."""
    return out.shape == ref.shape and out.dtype == ref.dtype and not _where_they_differ(out, ref)


def _where_they_differ(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """How many elements differ, and in which rows (token positions, leading dimensions flattened;
    the first 16) and last-dimension columns (the first 16)."""
    differ = (out != ref) & ~(out.isnan() & ref.isnan())
    if not differ.any():
        return {}
    flat = differ.reshape(-1, differ.shape[-1])
    return {"elements": int(differ.sum()), "rows": flat.any(1).nonzero().flatten()[:16].tolist(),
            "columns": flat.any(0).nonzero().flatten()[:16].tolist()}


def _compiled_code_comparison(tested: list[ModuleType], reference: list[ModuleType]) -> dict:
    """The two models' compiled code (the Python modules Inductor loaded while each ran): how
    many modules each loaded (none: served from the modules already loaded), whether their sources
    are the same (up to the compile id Inductor writes into each), and the Triton kernels (by
    name, the first 16) that are in both but run with another configuration
    (``CachingAutotuner.launchers`` after the calls: the configurations kept, after any
    benchmarking)."""
    def sources_and_configs(mods: list[ModuleType]) -> tuple[list[str], dict[str, list[str]]]:
        sources = sorted(hashlib.sha1("\n".join(
            line for line in pathlib.Path(m.__file__).read_text().splitlines()
            if not line.startswith(_COMPILE_ID_COMMENT)).encode()).hexdigest()
            for m in mods if getattr(m, "__file__", None))
        configs = {name: [str(getattr(launcher, "config", launcher)) for launcher in obj.launchers]
                   for m in mods for name, obj in vars(m).items()
                   if isinstance(getattr(obj, "launchers", None), list) and obj.launchers}
        return sources, configs
    tested_sources, tested_configs = sources_and_configs(tested)
    reference_sources, reference_configs = sources_and_configs(reference)
    return {"tested_modules": len(tested), "reference_modules": len(reference),
            "same_source": tested_sources == reference_sources,
            "configs_differ": sorted(k for k in tested_configs.keys() & reference_configs.keys()
                                     if tested_configs[k] != reference_configs[k])[:16]}


def _override(case: Case, assignments: list[str]) -> Case:
    """``case`` with each ``FIELD=JSON`` of ``assignments`` set (lists become tuples)."""
    def frozen(value):
        return tuple(frozen(v) for v in value) if isinstance(value, list) else value
    fields = {f.name for f in dataclasses.fields(Case)}
    changes = {}
    for assignment in assignments:
        name, _, value = assignment.partition("=")
        if name not in fields:
            raise SystemExit(f"--set {assignment}: no field {name!r}; fields: {sorted(fields)}")
        changes[name] = frozen(json.loads(value))
    return dataclasses.replace(case, **changes)


def _rank_main(cases: tuple[Case, ...], control: str | None, reference_first: bool) -> list[dict]:
    results = []
    for case in cases:
        try:
            results.append(_run_case(case, control, reference_first))
        except Exception as exc:  # noqa: BLE001 - every case is reported, the next one runs
            results.append({"status": "raised", "error": f"{type(exc).__name__}: {exc}"[:2000],
                            "traceback": traceback.format_exc()[-4000:]})
    return results


def _spawn(cases: tuple[Case, ...], args: argparse.Namespace, cache_dir: str | None, control: str | None
           ) -> list[tuple]:
    """Run ``cases`` on two ranks: per case, ``(status, [rank results])`` (status: the first rank's
    that is not ``"ok"``)."""
    per_rank = run_on_ranks(_rank_main, WORLD, cases, control, args.reference_first, timeout=args.timeout,
                            backend="nccl" if args.device == "cuda" else "gloo", hard_exit=args.device == "cuda",
                            env={"TORCHINDUCTOR_COMPILE_THREADS": COMPILE_THREADS,
                                 **({"TORCHINDUCTOR_CACHE_DIR": cache_dir} if cache_dir else {}),
                                 **(CUDA_ENV if args.device == "cuda" else {})})
    results = []
    for ranks in zip(*per_rank):
        status = next((r["status"] for r in ranks if r["status"] != "ok"), "ok")
        results.append((status, list(ranks)))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", type=int, default=None, help="run this case of --seed alone")
    parser.add_argument("--per-spawn", type=int, default=4, help="cases run in one spawn of the ranks")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--fresh-cache", action="store_true", help="compile into an empty Inductor cache")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: two GPUs, NCCL (the symmetric-memory paths at every size)")
    parser.add_argument("--control", choices=CONTROLS, default=None,
                        help="same: compile the tested model with the reference's FusionPass() too (a difference "
                             "then comes from compiling or running, not from the rewrites under test); bare: "
                             "compile both without fp4fuse's pass (a difference is torch's)")
    parser.add_argument("--no-auto-control", action="store_true",
                        help="on CUDA, do not rerun a differing case as both controls")
    parser.add_argument("--reference-first", action="store_true",
                        help="compile and call the reference before the tested model (default: after)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="override a field of every drawn case (repeatable)")
    args = parser.parse_args(argv)
    indices = [args.case] if args.case is not None else list(range(args.cases))
    # on CUDA two compiles of one graph in one process have differed with no rewrite enabled
    # (benchmarks/results/2026-11-28-gpu-test-runs.md): a differing case is rerun as both controls there
    auto_control = args.device == "cuda" and not args.control and not args.no_auto_control
    failed, control_differs = 0, collections.Counter()
    # --fresh-cache: one Inductor cache for the run, empty at its start (cold compiles: slower); a
    # graph drawn twice is served from it. Otherwise torch's default cache directory.
    cache_dir = tempfile.mkdtemp(prefix="fp4fuse_fuzz_inductor_") if args.fresh_cache else None
    for start in range(0, len(indices), args.per_spawn):
        cases = tuple(_override(draw(i, args.seed, args.device), args.set)
                      for i in indices[start:start + args.per_spawn])
        for case, (status, ranks) in zip(cases, _spawn(cases, args, cache_dir, args.control)):
            failed += status != "ok"
            line = {"case": case.index, "seed": args.seed, "status": status, **dataclasses.asdict(case)}
            line["ranks"] = ranks if status != "ok" else [{"fused": ranks[0]["fused"]}]
            if auto_control and status == "differs":
                # compiled as the reference is, or both without fp4fuse: do those differ too?
                line["control"] = {}
                for kind in CONTROLS:
                    control, control_ranks = _spawn((case,), args, cache_dir, control=kind)[0]
                    line["control"][kind] = {"status": control, "calls": [r.get("calls") for r in control_ranks]}
                control_differs.update(kind for kind in CONTROLS if line["control"][kind]["status"] == "differs")
            print(json.dumps(line), flush=True)
    summary = {"cases": len(indices), "failed": failed}
    if auto_control:
        summary.update({f"failed_and_{kind}_control_differs": control_differs[kind] for kind in CONTROLS})
    print(json.dumps(summary), flush=True)
    if cache_dir:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
