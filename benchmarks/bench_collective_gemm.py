"""Collective NVFP4 GEMMs on W GPUs: fp4fuse's overlapped ops vs NCCL + mm_fp4, and PyTorch's bf16 ones.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=. python benchmarks/bench_collective_gemm.py --world 2 --out results.md

Spawns ``--world`` NCCL ranks (default 2). For total M in {512, 2048, 8192, 32768} x (N, K) in {(4096, 4096),
(14336, 4096), (4096, 14336)} it times, per side:

* all-gather side: NCCL all-gather of the NVFP4 payload (data + scales) alone, ``mm_fp4`` of the
  gathered ``[M, K]`` alone, both in sequence (unfused: fp4fuse's functional fallback), and
  ``fused_all_gather_fp4_matmul`` with the overlapped path forced on (threshold 0), under each
  all-gather schedule (``FP4FUSE_AG_SCHEDULE``: decode-gather, per-shard) and reported under the
  one the cost model picks (``auto``); PyTorch's bf16
  ``symm_mem.fused_all_gather_matmul`` and its unfused baseline (NCCL all-gather of bf16 + mm).
* reduce-scatter side (``a`` is ``[M, K]`` on every rank, K being the rank's K shard): ``mm_fp4``
  alone, the fp32 reduce-scatter of the partial alone (cast, NCCL, cast back, as the fallback does),
  both (unfused) and ``fused_fp4_matmul_reduce_scatter`` forced on; PyTorch's bf16
  ``symm_mem.fused_matmul_reduce_scatter`` and mm + NCCL bf16 reduce-scatter.

Timing: the calls of one shape are timed round-robin (one of each per iteration, so drift favours
none); before each call the ranks synchronize the device and meet at a barrier, then CUDA events
bracket one call; median over the iterations, then the slower rank's median. Two modes:
device-bound (the ranks aligned on the device by a tiny all-reduce, then a ~2 ms GPU sleep, so
the host has issued the call before the GPU starts it) and eager (host launch latency included).
The host issue time of each call (Python + launches, no sync) is reported too. Overlap efficiency
``(t_comm + t_mm - t_fused) / min(t_comm, t_mm)`` is shown where ``min >= 50 us``.
``--budget-s`` stops starting new shapes; the markdown is rewritten after every shape, so a run
cut short still leaves its table. ``FP4FUSE_BENCH_VERBOSE=1`` prints each call's warm-up.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import socket
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp4fuse.config import env_bool

SHAPES_NK = ((4096, 4096), (14336, 4096), (4096, 14336))
TOTAL_M = (512, 2048, 8192, 32768)
#: Extra grid points that place the overlap threshold (not part of the headline grid).
EXTRA_M = (1024, 4096, 16384)
MIN_HIDEABLE_MS = 0.05
DEVICE_BOUND = "device-bound"
EAGER = "eager"


@dataclasses.dataclass
class Row:
    """One (side, M, N, K) line of the results; times in ms (None: not measured / failed)."""
    side: str
    mode: str
    m: int
    n: int
    k: int
    comm: float | None = None
    mm: float | None = None
    unfused: float | None = None
    fused: float | None = None
    fused_by_schedule: dict[str, float | None] = dataclasses.field(default_factory=dict)
    schedule: str = ""
    host_unfused: float | None = None
    host_fused: float | None = None
    bf16_comm: float | None = None
    bf16_mm: float | None = None
    bf16_unfused: float | None = None
    bf16_fused: float | None = None
    notes: str = ""

    def speedup(self) -> float | None:
        return self.unfused / self.fused if self.unfused and self.fused else None

    def efficiency(self) -> float | None:
        if None in (self.comm, self.mm, self.fused):
            return None
        hideable = min(self.comm, self.mm)
        if hideable < MIN_HIDEABLE_MS:
            return None
        return (self.comm + self.mm - self.fused) / hideable

    def bf16_speedup(self) -> float | None:
        return self.bf16_unfused / self.bf16_fused if self.bf16_unfused and self.bf16_fused else None


#: GPU sleep (cycles, ~2 ms at 1.98 GHz) queued before the start event in device-bound timing, so
#: the host has enqueued the whole call before the GPU reaches it.
HOST_AHEAD_SLEEP_CYCLES = 4_000_000
HOST_AHEAD_MS = 2.0


def _align_devices() -> None:
    """Queue a tiny NCCL all-reduce on the current stream without waiting for it on the host: it
    ends at about the same moment on every GPU, so work queued after it starts aligned across ranks
    (no host skew between the ranks' timed regions)."""
    dist.all_reduce(torch.zeros(1, device="cuda"))


@dataclasses.dataclass
class Timing:
    """Medians over the iterations (slower rank's): GPU time of one call and host issue time, ms."""
    gpu: float
    host: float


def _time_interleaved(fns: dict[str, Callable[[], object]], host_ahead: bool, notes: list[str],
                      budget_s: float = 0.8, min_iters: int = 5, max_iters: int = 20) -> dict[str, Timing | None]:
    """Time every call in ``fns`` round-robin (one call of each per iteration, so clock or thermal
    drift cannot favour whichever is timed last). Each call: devices synchronized, ranks at a
    barrier; ``host_ahead``: ranks aligned on the device and a ~2 ms GPU sleep queued before the
    start event, so the host has issued the call before the GPU reaches it (device-bound time, as
    under CUDA graphs); otherwise the GPU idles while the host issues it (eager). A call that raises
    during warm-up is reported in ``notes`` and maps to None (the same on every rank)."""
    live: dict[str, Callable[[], object]] = {}
    approx = 0.0
    for label, fn in fns.items():
        if env_bool("FP4FUSE_BENCH_VERBOSE", False):
            print(f"[rank {dist.get_rank()}] warm-up: {label}", flush=True)
        try:
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a baseline that fails is reported, not fatal
            notes.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
            continue
        approx += time.perf_counter() - t0 + 3e-4 + (1e-3 if host_ahead else 0.0)
        live[label] = fn
    iters = max(min_iters, min(max_iters, int(budget_s / max(approx, 1e-6))))
    # Every rank must run the same number of iterations (each holds collectives): agree on the most.
    agreed = torch.tensor([iters], device="cuda")
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    iters = int(agreed.item())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu: dict[str, list[float]] = {label: [] for label in live}
    host: dict[str, list[float]] = {label: [] for label in live}
    for _ in range(iters):
        for label, fn in live.items():
            torch.cuda.synchronize()
            dist.barrier()
            if host_ahead:
                _align_devices()
                torch.cuda._sleep(HOST_AHEAD_SLEEP_CYCLES)
            start.record()
            h0 = time.perf_counter()
            fn()
            host[label].append((time.perf_counter() - h0) * 1e3)
            end.record()
            end.synchronize()
            gpu[label].append(start.elapsed_time(end))
    med = torch.tensor([[statistics.median(gpu[label]), statistics.median(host[label])] for label in live],
                       device="cuda", dtype=torch.float64).reshape(-1, 2)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    out: dict[str, Timing | None] = {label: None for label in fns}
    for i, label in enumerate(live):
        out[label] = Timing(*med[i].tolist())
    if host_ahead:
        late = [f"{label} {t.host:.2f} ms" for label, t in out.items() if t and t.host > HOST_AHEAD_MS]
        if late:
            notes.append(f"host issue longer than the {HOST_AHEAD_MS} ms GPU sleep (GPU time includes "
                         f"host latency): {', '.join(late)}")
    return out


def _gpu(t: Timing | None) -> float | None:
    return None if t is None else t.gpu


def _host(t: Timing | None) -> float | None:
    return None if t is None else t.host


def _quantized(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from fp4fuse.nvfp4 import format as nvfp4
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
    gs = nvfp4.global_scale_from_amax(torch.tensor([4.5], device="cuda"))
    q, s = torch.ops.fp4fuse.scaled_fp4_quant(x, gs)
    return q, s, gs


def _bench_shape(m_total: int, n: int, k: int, group: str, mode: str) -> list[Row]:
    from fp4fuse.distributed import groups
    from fp4fuse.ops import collective_ops as co
    from fp4fuse.distributed.symm_mem import policy
    from fp4fuse.distributed.symm_mem.policy import AllGatherSchedule
    host_ahead = mode == DEVICE_BOUND
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = torch.ops.fp4fuse
    rows_shard = m_total // world
    out_dtype = torch.bfloat16
    b, sb, gs_b = _quantized(n, k, 1)
    alpha = 1.0 / (gs_b * gs_b)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5

    def with_schedule(schedule: AllGatherSchedule, fn: Callable[[], object]) -> Callable[[], object]:
        def call():
            os.environ[policy.ENV_AG_SCHEDULE] = schedule.value
            try:
                return fn()
            finally:
                os.environ.pop(policy.ENV_AG_SCHEDULE)
        return call

    # --- all-gather side -------------------------------------------------------------------
    ag = Row("all-gather", mode, m_total, n, k)
    notes: list[str] = []
    a_shard, s_shard, _ = _quantized(rows_shard, k, 10 + rank)
    a_full = groups.all_gather_rows(a_shard, group)
    s_full = groups.all_gather_rows(s_shard, group)
    a16_shard = torch.randn(rows_shard, k, device="cuda", dtype=torch.bfloat16)
    a16_full = groups.all_gather_rows(a16_shard, group)
    fused = lambda: ops.fused_all_gather_fp4_matmul(a_shard, s_shard, b, sb, alpha, out_dtype, group)  # noqa: E731
    calls = {
        "comm": lambda: (groups.all_gather_rows(a_shard, group), groups.all_gather_rows(s_shard, group)),
        "mm": lambda: ops.mm_fp4(a_full, b, s_full, sb, alpha, out_dtype),
        "unfused": lambda: co.all_gather_fp4_matmul_fallback(a_shard, s_shard, b, sb, alpha, out_dtype, group),
        **{f"fused {sched.value}": with_schedule(sched, fused) for sched in AllGatherSchedule},
        "bf16 comm": lambda: groups.all_gather_rows(a16_shard, group),
        "bf16 mm": lambda: torch.mm(a16_full, w16.t()),
        "bf16 unfused": lambda: torch.mm(groups.all_gather_rows(a16_shard, group), w16.t()),
        "bf16 fused": lambda: torch.ops.symm_mem.fused_all_gather_matmul(a16_shard, [w16.t()], 0, group,
                                                                        return_A=True),
    }
    t = _time_interleaved(calls, host_ahead, notes)
    ag.schedule = policy.all_gather_schedule(world, rows_shard, n, k).value
    ag.fused_by_schedule = {sched.value: _gpu(t[f"fused {sched.value}"]) for sched in AllGatherSchedule}
    ag.comm, ag.mm, ag.unfused = _gpu(t["comm"]), _gpu(t["mm"]), _gpu(t["unfused"])
    ag.fused = ag.fused_by_schedule[ag.schedule]
    ag.host_unfused, ag.host_fused = _host(t["unfused"]), _host(t[f"fused {ag.schedule}"])
    ag.bf16_comm, ag.bf16_mm = _gpu(t["bf16 comm"]), _gpu(t["bf16 mm"])
    ag.bf16_unfused, ag.bf16_fused = _gpu(t["bf16 unfused"]), _gpu(t["bf16 fused"])
    ag.notes = "; ".join(notes)
    del a_full, s_full, a16_full

    # --- reduce-scatter side ----------------------------------------------------------------
    rs = Row("reduce-scatter", mode, m_total, n, k)
    notes = []
    a, s, _ = _quantized(m_total, k, 20 + rank)
    partial = ops.mm_fp4(a, b, s, sb, alpha, out_dtype)
    a16 = torch.randn(m_total, k, device="cuda", dtype=torch.bfloat16)
    p16 = torch.mm(a16, w16.t())
    funcol = torch.ops._c10d_functional
    rs_bf16 = lambda t: funcol.wait_tensor(funcol.reduce_scatter_tensor(t, "sum", world, group))  # noqa: E731
    calls = {
        "mm": lambda: ops.mm_fp4(a, b, s, sb, alpha, out_dtype),
        "comm": lambda: groups.reduce_scatter_rows_fp32(partial, group),
        "unfused": lambda: co.fp4_matmul_reduce_scatter_fallback(a, b, s, sb, alpha, out_dtype, group),
        "fused": lambda: ops.fused_fp4_matmul_reduce_scatter(a, b, s, sb, alpha, out_dtype, group),
        "bf16 mm": lambda: torch.mm(a16, w16.t()),
        "bf16 comm": lambda: rs_bf16(p16),
        "bf16 unfused": lambda: rs_bf16(torch.mm(a16, w16.t())),
        "bf16 fused": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a16, w16.t(), "sum", 0, group),
    }
    t = _time_interleaved(calls, host_ahead, notes)
    rs.mm, rs.comm, rs.unfused, rs.fused = (_gpu(t[key]) for key in ("mm", "comm", "unfused", "fused"))
    rs.host_unfused, rs.host_fused = _host(t["unfused"]), _host(t["fused"])
    rs.bf16_mm, rs.bf16_comm = _gpu(t["bf16 mm"]), _gpu(t["bf16 comm"])
    rs.bf16_unfused, rs.bf16_fused = _gpu(t["bf16 unfused"]), _gpu(t["bf16 fused"])
    rs.notes = "; ".join(notes)
    return [ag, rs]


def _profile(m_total: int, n: int, k: int, group: str) -> None:
    """Rank 0 prints the GPU timeline (per stream, µs from the call's first kernel) of one
    device-bound fused call per side (and per all-gather schedule), ranks aligned as in timing."""
    import json
    import tempfile
    from fp4fuse.distributed.symm_mem import policy
    from fp4fuse.distributed.symm_mem.policy import AllGatherSchedule
    ops = torch.ops.fp4fuse
    rank, world = dist.get_rank(), dist.get_world_size()
    b, sb, gs_b = _quantized(n, k, 1)
    alpha = 1.0 / (gs_b * gs_b)
    a_shard, s_shard, _ = _quantized(m_total // world, k, 10 + rank)
    a, s, _ = _quantized(m_total, k, 20 + rank)
    calls = {f"all-gather {sched.value}": (sched.value, lambda: ops.fused_all_gather_fp4_matmul(
        a_shard, s_shard, b, sb, alpha, torch.bfloat16, group)) for sched in AllGatherSchedule}
    calls["unfused all-gather + mm_fp4"] = ("auto", lambda: ops.mm_fp4(
        torch.cat([a_shard] * world), b, torch.cat([s_shard] * world), sb, alpha, torch.bfloat16))
    calls["reduce-scatter"] = ("auto", lambda: ops.fused_fp4_matmul_reduce_scatter(
        a, b, s, sb, alpha, torch.bfloat16, group))
    for label, (schedule, fn) in calls.items():
        os.environ[policy.ENV_AG_SCHEDULE] = schedule
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                _align_devices()
                torch.cuda._sleep(HOST_AHEAD_SLEEP_CYCLES)
                fn()
            torch.cuda.synchronize()
        os.environ.pop(policy.ENV_AG_SCHEDULE)
        if rank != 0:
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            trace = json.load(open(f.name))
        events = sorted((e for e in trace.get("traceEvents", [])
                         if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e),
                        key=lambda e: e["ts"])
        sleeps = [i for i, e in enumerate(events) if "spin_kernel" in e["name"] or "sleep" in e["name"].lower()]
        events = events[sleeps[-1] + 1:] if sleeps else events
        if not events:
            continue
        t0 = events[0]["ts"]
        print(f"--- profile {label} M={m_total} N={n} K={k} (rank 0, last of 3 aligned device-bound calls; "
              "start / duration µs, stream) ---")
        for e in events:
            stream = e.get("args", {}).get("stream", e.get("tid"))
            print(f"{e['ts'] - t0:9.1f} {e.get('dur', 0):8.1f}  s{stream:<4} {e['name'][:70]}")


def _sweep_peer_decode(rows: int, k: int, group: str) -> None:
    """Rank 0 prints the bandwidth of decoding rank 1's packed ``[rows, k]`` shard to bf16 straight
    out of rank 1's symmetric buffer (SM loads over NVLink), per ``(BLOCKS, num_warps)`` of the
    decode kernel, next to the copy engine's pull of the same bytes and the local decode."""
    import triton.testing
    from fp4fuse.kernels.triton import mm as triton_mm
    from fp4fuse.distributed.symm_mem import workspace
    from fp4fuse.distributed.symm_mem.workspace import all_gather_layout
    rank = dist.get_rank()
    ws = workspace.get_workspace(group, torch.device("cuda", torch.cuda.current_device()))
    layout = all_gather_layout(rows, k // 2, k // 16)
    ws.ensure_capacity(layout.nbytes)
    q, s, _ = _quantized(rows, k, 5 + rank)
    ws.view(rank, layout.data).copy_(q)
    ws.view(rank, layout.scales).copy_(s.view(torch.uint8))
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        pq, ps = ws.view(1, layout.data), ws.view(1, layout.scales)
        out = torch.empty((rows, k), dtype=torch.bfloat16, device="cuda")
        gb = (pq.numel() + ps.numel()) / 1e9
        local_q = torch.empty_like(pq)
        local_s = torch.empty_like(ps)
        ms = triton.testing.do_bench(lambda: (local_q.copy_(pq), local_s.copy_(ps)), warmup=5, rep=30)
        print(f"--- peer decode {rows}x{k} ({gb * 1e3:.1f} MB packed) ---", flush=True)
        print(f"copy-engine pull: {ms * 1e3:.1f} us, {gb / ms * 1e3:.0f} GB/s", flush=True)
        ms = triton.testing.do_bench(lambda: triton_mm.dequantize_fp4_triton(q, s, out=out), warmup=5, rep=30)
        print(f"local decode (default launch): {ms * 1e3:.1f} us", flush=True)
        for cfg in ((64, 4), (128, 4), (256, 4), (256, 8), (512, 8), (1024, 8), (1024, 16), (2048, 16)):
            ms = triton.testing.do_bench(
                lambda: triton_mm.dequantize_fp4_triton(pq, ps, config=cfg, out=out), warmup=5, rep=30)
            print(f"peer decode BLOCKS={cfg[0]} warps={cfg[1]}: {ms * 1e3:.1f} us, {gb / ms * 1e3:.0f} GB/s",
                  flush=True)
    dist.barrier()


def _fmt(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _table(rows: list[Row], side: str, mode: str) -> list[str]:
    comm = "AG fp4 payload" if side == "all-gather" else "RS fp32 partial"
    bcomm = "AG bf16" if side == "all-gather" else "RS bf16"
    sched = side == "all-gather"
    extra_head = " schedule (auto) | fused decode-gather ms | fused per-shard ms |" if sched else ""
    lines = [
        f"| M total | N | K | {comm} ms | mm_fp4 ms | unfused ms |{extra_head} fused ms | speedup | overlap eff. | "
        "host issue ms unfused / fused | "
        f"{bcomm} ms | bf16 mm ms | bf16 unfused ms | torch bf16 fused ms | torch speedup |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |" + (" --- | ---: | ---: |" if sched else "")
        + " ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r.side != side or r.mode != mode:
            continue
        eff = r.efficiency()
        eff_s = _fmt(eff, 2) if eff is not None else ("n/a (<50 µs)" if r.fused is not None else "—")
        extra = (f" {r.schedule} | {_fmt(r.fused_by_schedule.get('decode-gather'))} | "
                 f"{_fmt(r.fused_by_schedule.get('per-shard'))} |") if sched else ""
        lines.append(
            f"| {r.m} | {r.n} | {r.k} | {_fmt(r.comm)} | {_fmt(r.mm)} | {_fmt(r.unfused)} |{extra} {_fmt(r.fused)} | "
            f"{_fmt(r.speedup(), 2)} | {eff_s} | {_fmt(r.host_unfused, 2)} / {_fmt(r.host_fused, 2)} | "
            f"{_fmt(r.bf16_comm)} | {_fmt(r.bf16_mm)} | "
            f"{_fmt(r.bf16_unfused)} | {_fmt(r.bf16_fused)} | {_fmt(r.bf16_speedup(), 2)} |")
    return lines


def _crossover(rows: list[Row], side: str, mode: str, tolerance: float = 1.02) -> int | None:
    """Smallest grid M from which ``side``'s fused op is never more than ``tolerance`` x unfused
    (every (N, K), every larger M) in timing ``mode``; None if no such M."""
    rows = [r for r in rows if r.side == side and r.mode == mode]
    for m in sorted({r.m for r in rows}):
        ok = all(r.fused is not None and r.unfused is not None and r.fused <= tolerance * r.unfused
                 for r in rows if r.m >= m)
        if ok:
            return m
    return None


def _report(rows: list[Row], meta: dict[str, str], elapsed: float) -> str:
    from fp4fuse.distributed.symm_mem import policy
    sides = ("all-gather", "reduce-scatter")
    lines = [
        f"# Collective NVFP4 GEMMs, {meta['world']} GPUs — {meta['date']}",
        "",
        f"- Device: {meta['world']} x {meta['device']} ({meta['host']}); torch {meta['torch']}, Triton {meta['triton']}, "
        f"NCCL {meta['nccl']}; mm_fp4 backend: {meta['backend']}; fused GEMM mode: {meta['gemm_mode']}.",
        "- NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (P2P only). out_dtype bf16.",
        "- Times: median of CUDA-event timings of one call, ranks synchronized and barriered before "
        "each call, after warm-up; the slower rank's median. Two timing modes: **device-bound** "
        "(a ~2 ms GPU sleep is queued before the start event, so the host has issued the whole call "
        "before the GPU starts it: what CUDA graphs or a model whose GPU runs behind the host see) "
        "and **eager** (the GPU idles while the host issues the call: host launch latency included).",
        "- `fused` runs fp4fuse's overlapped path at every size (threshold forced to 0); the op as "
        f"shipped runs `unfused` below `{policy.ENV_MIN_ROWS}` (defaults: all-gather "
        f"{policy.DEFAULT_ALL_GATHER_MIN_ROWS} total rows, reduce-scatter "
        f"{policy.DEFAULT_REDUCE_SCATTER_MIN_ROWS_PER_RANK} rows per rank).",
        "- Overlap efficiency = (t_comm + t_mm − t_fused) / min(t_comm, t_mm), shown where "
        "min ≥ 50 µs. Reduce-scatter side: `a` is `[M, K]` per rank (K = the rank's K shard); its "
        "unfused comm is the fallback's fp32 reduce-scatter of the bf16 partial (cast, NCCL, cast).",
    ]
    for mode in sorted({r.mode for r in rows}, key=(DEVICE_BOUND, EAGER).index):
        for side, title in zip(sides, ("All-gather + GEMM", "GEMM + reduce-scatter")):
            lines += ["", f"## {title} — {mode}", "", *_table(rows, side, mode)]
        cross = {side: _crossover(rows, side, mode) for side in sides}
        lines += ["", f"Crossover, {mode} (smallest grid M from which fused ≤ 1.02 × unfused for every "
                      "(N, K) and every larger M): "
                  + ", ".join(f"{side} {m if m is not None else 'none on this grid'}" for side, m in cross.items())
                  + "."]
    lines += ["", f"Benchmark wall time {elapsed:.0f} s."]
    notes = [f"- {r.mode} {r.side} M={r.m} N={r.n} K={r.k}: {r.notes}" for r in rows if r.notes]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _meta(group: str) -> dict[str, str]:
    from fp4fuse.ops.backend import backend_for
    from fp4fuse.ops.collective_gemm import RowBlockGemm
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    b, sb, gs = _quantized(64, 64, 3)
    return {
        "date": datetime.date.today().isoformat(),
        "world": str(dist.get_world_size()),
        "device": torch.cuda.get_device_name(),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "triton": triton_version,
        "nccl": _nccl_version(),
        "backend": backend_for(b).value,
        "gemm_mode": RowBlockGemm(b, sb, gs, torch.bfloat16, 4096).mode.value,
    }


def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    import faulthandler
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)  # a hang prints every rank's stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FP4FUSE_OVERLAP_MIN_ROWS="0")
    os.environ.setdefault("FP4FUSE_SYMM_MEM_TIMEOUT_MS", "60000")  # a broken pipeline traps, never hangs
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.world, device_id=torch.device("cuda", rank))
    import fp4fuse  # noqa: F401  (registers the ops)
    group = dist.group.WORLD.group_name
    started = time.perf_counter()
    rows: list[Row] = []
    meta = _meta(group)
    nk = [tuple(v) for v in args.nk] if args.nk else list(SHAPES_NK)
    shapes = [(m, n, k) for n, k in nk for m in sorted(args.m)]
    for m, n, k in shapes:
        if time.perf_counter() - started > args.budget_s:
            if rank == 0:
                print(f"budget of {args.budget_s} s spent: skipping M={m} N={n} K={k}", flush=True)
            continue
        shape_started = time.perf_counter()
        new_rows = []
        for mode in args.modes:
            new_rows += _bench_shape(m, n, k, group, mode)
        rows += new_rows
        if rank == 0:
            for r in new_rows:
                print(f"{r.mode:>12} {r.side:>14} M={r.m:>6} N={r.n:>6} K={r.k:>6}: comm {_fmt(r.comm)} mm {_fmt(r.mm)} "
                      f"unfused {_fmt(r.unfused)} fused {_fmt(r.fused)} {r.schedule} {r.fused_by_schedule} "
                      f"eff {_fmt(r.efficiency(), 2)} | bf16 unfused {_fmt(r.bf16_unfused)} "
                      f"torch fused {_fmt(r.bf16_fused)} {r.notes}", flush=True)
            print(f"  ({time.perf_counter() - shape_started:.1f} s)", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(_report(rows, meta, time.perf_counter() - started))
        torch.cuda.empty_cache()
    for m, n, k in args.profile:
        _profile(m, n, k, group)
    for shard_rows, k in args.sweep_peer_decode:
        _sweep_peer_decode(shard_rows, k, group)
    if rank == 0:
        text = _report(rows, meta, time.perf_counter() - started)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="markdown file to write (rank 0)")
    parser.add_argument("--m", type=int, nargs="+", default=list(TOTAL_M + EXTRA_M), help="total M values")
    parser.add_argument("--profile", type=int, nargs=3, action="append", default=[], metavar=("M", "N", "K"),
                        help="print rank 0's GPU timeline of one fused call of each side at this shape")
    parser.add_argument("--sweep-peer-decode", type=int, nargs=2, action="append", default=[],
                        metavar=("ROWS", "K"), help="rank 0: decode-from-peer bandwidth per launch config")
    parser.add_argument("--nk", type=int, nargs=2, action="append", default=[], metavar=("N", "K"),
                        help="(N, K) pairs (default: the three of the grid)")
    parser.add_argument("--modes", nargs="+", default=[DEVICE_BOUND, EAGER], choices=[DEVICE_BOUND, EAGER])
    parser.add_argument("--watchdog-s", type=float, default=500.0,
                        help="dump every rank's Python stack and exit if still running after this")
    parser.add_argument("--world", type=int, default=2, help="GPUs (NCCL ranks) to spawn")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new shapes after this")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world:
        sys.exit(f"needs {args.world} GPUs, found {torch.cuda.device_count()}")
    # Never NVLink multicast (it can take a shared host down); P2P only.
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(args, port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
