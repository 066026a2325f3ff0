"""Where the host time of a compiled forward goes in the default launch mode (no CUDA graphs), or
with ``MODE=cudagraphs`` under Inductor's CUDA-graph trees (``triton.cudagraphs``).

    PYTHONPATH=. [TP=1] [TOKENS=1024,16] [VARS=bf16,nvfp4,fp4fuse] [MODE=default] [CPPW=1] [SKIPGUARDS=1] \
        [PROF=1] [CPUOPS=28] [NK=40] python benchmarks/profile_e2e_host.py

The model and variants are ``bench_e2e.py``'s (HF ``LlamaModel``, 2 Llama-3-8B-shaped layers, dynamic
batch, dynamic activation scales; ``TP`` ranks, one GPU each). Per variant and token count, on rank 0:
``wall`` (ms per forward, median of 5 rounds of 20 back-to-back forwards, the device synced after
each round: ``bench_e2e``'s timing), ``issue`` (ms per forward to enqueue 20 forwards: the host's
share), the kernels per forward and their summed device time and the ``NK`` kernels with the most
device time (``bench_e2e``'s ``--profile-kernels`` table, over 10 forwards),
whether ``fp4fuse``'s output is bitwise ``nvfp4``'s, and with ``PROF=1`` cProfile's functions by
own and by cumulative time over 20 forwards (profiled on every rank, as the forwards hold collectives;
rank 0's printed), and with ``CPUOPS=n`` the n ops and runtime calls with the most host time of
their own (``cpu_op_table``). ``CPPW=1`` compiles every variant with Inductor's C++
wrapper (``cpp_wrapper``). ``SKIPGUARDS=1`` compiles every variant without Dynamo's module guards
(``bench_e2e.py --skip-module-guards``; refused for ``bf16`` with ``nvfp4``, as there). Wall close to
issue and above device time: the host is the limit.
"""
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e as B  # noqa: E402

TP = int(os.environ.get("TP", "1"))
TOKENS = [int(t) for t in os.environ.get("TOKENS", "1024,16").split(",")]
VARS = os.environ.get("VARS", "bf16,fp4fuse").split(",")
MODE = os.environ.get("MODE", "default")
FORWARDS = 20


def cpu_op_table(fn, forwards: int, rows: int) -> list[str]:
    """The ``rows`` ops and runtime calls with the most host time of their own over ``forwards``
    calls of ``fn`` (torch.profiler, CPU activity only), per forward: calls, own time, own time a
    call, and time including what they call. Python code inside an op counts as the op's own time,
    so a Python op's cost shows whole (cProfile spreads it over its frames and slows Python more
    than the C++ calls around it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(forwards):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
    return [f"   {e.count / forwards:6.1f}/fwd  own {e.self_cpu_time_total / forwards:8.1f} us/fwd "
            f"({e.self_cpu_time_total / max(e.count, 1):6.1f} us a call)  total {e.cpu_time_total / forwards:8.1f} us/fwd"
            f"  {e.key[:80]}" for e in events]


def report(name: str, tokens: int, fn, rank: int) -> None:
    """Time, profile and print one variant at one token count (module docstring). Wall time and
    the kernel table are ``bench_e2e``'s (``_time_ms``, ``_profiled``); the issue time is the same
    loop without the closing device sync."""
    import torch
    import torch.distributed as dist

    walls = [B._time_ms(fn, FORWARDS) for _ in range(5)]
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(FORWARDS):
        fn()
    issue = (time.perf_counter() - start) * 1e3 / FORWARDS
    torch.cuda.synchronize()
    listed = int(os.environ.get("NK", "40"))
    summary = B._profiled(fn, 10, max(listed, 1))  # kernel totals need at least one listed
    profiler = None
    if os.environ.get("PROF"):  # every rank runs the forwards: they hold collectives
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        for _ in range(FORWARDS):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
    cpu_ops = cpu_op_table(fn, 10, int(os.environ["CPUOPS"])) if os.environ.get("CPUOPS") else []
    if rank != 0:
        return
    print(f"== {name} T={tokens}: wall {sorted(walls)[2]:.3f} ms (all {[round(x, 3) for x in walls]}), "
          f"issue {issue:.3f} ms, kernels/forward {summary['kernel_launches']:.1f}, "
          f"device {summary['kernel_ms']:.3f} ms", flush=True)
    for kernel, ms, launches in summary["kernels"][:listed]:
        print(f"   {launches:5.1f} x {ms / launches * 1e3:8.1f} us  {kernel}")
    for line in cpu_ops:
        print(line)
    if profiler is not None:
        for order, n in (("tottime", 35), ("cumulative", 45)):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(n)
            print(text.getvalue()[-9000:], flush=True)


def main(args: B.BenchArgs) -> dict:
    """On every rank: build, compile and report each variant at each token count."""
    import torch
    import torch.distributed as dist
    torch._dynamo.config.cache_size_limit = 256
    torch._inductor.config.emulate_precision_casts = True
    if args.cpp_wrapper:
        torch._inductor.config.cpp_wrapper = True
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    models = B._build_models(args, device, dist.group.WORLD)
    variants = B._compiled_variants(args, models, MODE)
    outs = {}
    for tokens in TOKENS:
        b, s = B.batch_shape(tokens)
        ids = torch.randint(0, 32000, (b, s), generator=torch.Generator().manual_seed(tokens)).to(device)
        torch._dynamo.mark_dynamic(ids, 0)
        for name in VARS:
            model = variants[name][0]
            try:
                with torch.no_grad():
                    t0 = time.time()
                    for _ in range(3):
                        out = model(input_ids=ids).last_hidden_state
                    torch.cuda.synchronize()
                    if rank == 0:
                        print(f"-- {name} T={tokens} warm-up {time.time() - t0:.1f} s", flush=True)
                    outs[(name, tokens)] = out.float().clone()
                    report(name, tokens, lambda: model(input_ids=ids), rank)
            except Exception as exc:  # noqa: BLE001
                import traceback
                print(f"!! {name} T={tokens} failed: {type(exc).__name__}: {exc}"[:3000], flush=True)
                traceback.print_exc(limit=-6)
        if rank == 0 and ("nvfp4", tokens) in outs and ("fp4fuse", tokens) in outs:
            print(f"   fp4fuse == nvfp4: {torch.equal(outs[('nvfp4', tokens)], outs[('fp4fuse', tokens)])}")
    return {}


if __name__ == "__main__":
    from fp4fuse.launch import run_on_ranks
    args = B.BenchArgs(TP, 2, tuple(TOKENS), (MODE,), tuple(VARS), FORWARDS, 5, 4096, 32, 8, 14336,
                       cpp_wrapper=bool(os.environ.get("CPPW")), skip_module_guards=bool(os.environ.get("SKIPGUARDS")))
    reason = B.unsafe_without_module_guards(args)
    if reason is not None:
        sys.exit(f"SKIPGUARDS=1: {reason}")
    run_on_ranks(main, TP, args, timeout=900, backend="nccl", hard_exit=True)
