"""All-reduce of a TP row-parallel output: NCCL vs symmetric-memory one-shot / two-shot, on W GPUs.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        PYTHONPATH=. python benchmarks/bench_all_reduce.py [--world 2] [--hidden 4096] [--json raw.json]

Spawns ``--world`` NCCL ranks. For token counts T in ``--tokens`` it all-reduces (sum) a
``[T, hidden]`` bf16 tensor three ways:

* ``nccl``: ``_c10d_functional.all_reduce_`` + ``wait_tensor`` (what Inductor's generated code calls
  for a functional all-reduce);
* ``one-shot``: ``torch.ops.symm_mem.one_shot_all_reduce_copy_out`` through fp4fuse's symmetric
  workspace (the kernel copies the input into this rank's buffer, barriers, and every rank sums all
  ranks' buffers in rank order);
* ``two-shot``: the input copied into the buffer, then ``symm_mem.two_shot_all_reduce_out``
  (reduce-scatter + all-gather through the buffers);
* ``op``: ``torch.ops.fp4fuse.all_reduce_sum``, the op a compiled graph calls (its rank agreement,
  path choice, side stream and output allocation included);
* ``custom_op``: the same CUDA kernel behind a ``torch.library.custom_op`` (how fp4fuse registered
  the op before 2026-11-27): its dispatch layers are the difference to ``op``.

and checks each result bitwise against NCCL's. Timed three ways, median of 5 rounds on rank 0:
``graph``: 20 calls captured in one CUDA graph and replayed (device time per call: what a serving
engine's captured decode step pays); ``eager``: 200 calls back to back, the device synced after
(host launch path included; the slower of host and device); ``host``: the time to enqueue 200
calls while the device is held busy (``bench_host.host_round_us``, median of 15 rounds, the
methods interleaved round by round so that host drift hits them alike: the host path alone, what
a compiled graph without CUDA graphs pays per call when its host is the limit).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_e2e import _time_ms  # benchmarks/, this script's folder: ranks aligned, device synced around
from bench_host import host_round_us

GRAPH_CALLS = 20
EAGER_CALLS = 200
HOST_ROUNDS = 15
ROUNDS = 5


def _graph_ms(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / GRAPH_CALLS)
    return statistics.median(times)


def _eager_ms(fn) -> float:
    return statistics.median(_time_ms(fn, EAGER_CALLS) for _ in range(ROUNDS))


def _interleaved_host_us(fns: dict) -> dict[str, float]:
    """Median host time per call of each of ``fns`` over HOST_ROUNDS rounds, one round of each in
    turn (every rank runs the same sequence: the collectives pair up)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(HOST_ROUNDS):
        for name, fn in fns.items():
            times[name].append(host_round_us(fn))
    return {name: statistics.median(t) for name, t in times.items()}


@torch.library.custom_op("fp4fuse_bench::all_reduce_sum", mutates_args=())
def _custom_op_all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    raise NotImplementedError("CUDA only: its kernel is fp4fuse::all_reduce_sum's (registered in _worker)")


_BENCH_CUDA = torch.library.Library("fp4fuse_bench", "IMPL", "CUDA")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    import fp4fuse  # noqa: F401  (registers torch.ops.fp4fuse)
    from fp4fuse.distributed.symm_mem.workspace import get_workspace
    from fp4fuse.ops import all_reduce_ops

    _BENCH_CUDA.impl("all_reduce_sum", all_reduce_ops._all_reduce_sum_cuda)

    group_name = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    symm = torch.ops.symm_mem
    fp4fuse_ops = torch.ops.fp4fuse
    tokens = [int(t) for t in args.tokens.split(",")]
    ws = get_workspace(group_name, device)
    ws.ensure_capacity(max(tokens) * args.hidden * 2)
    results = []
    for t in tokens:
        gen = torch.Generator(device=device).manual_seed(1000 * t + rank)
        x = torch.randn((t, args.hidden), device=device, dtype=torch.bfloat16, generator=gen)
        buf = ws.local_tensor(x.shape, x.dtype)
        out = torch.empty_like(x)

        def nccl():
            y = c10d.all_reduce_(x.clone(), "sum", group_name)
            return c10d.wait_tensor(y)

        def one_shot():
            return symm.one_shot_all_reduce_copy_out(buf, x, "sum", group_name, out)

        def two_shot():
            buf.copy_(x)
            return symm.two_shot_all_reduce_out(buf, "sum", group_name, out)

        def op():
            return fp4fuse_ops.all_reduce_sum(x, group_name)

        def custom_op():
            return torch.ops.fp4fuse_bench.all_reduce_sum(x, group_name)

        ref = nccl().clone()
        row = {"tokens": t, "bytes": x.numel() * 2}
        methods = {"nccl": nccl, "one-shot": one_shot, "two-shot": two_shot, "op": op, "custom_op": custom_op}
        for name, fn in methods.items():
            try:
                same = torch.equal(fn().clone(), ref)
                row[name] = {"same_bits_as_nccl": same, "graph_us": _graph_ms(fn) * 1e3,
                             "eager_us": _eager_ms(fn) * 1e3}
            except Exception as exc:  # noqa: BLE001  (a method that cannot run is reported, not fatal)
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        runnable = {name: fn for name, fn in methods.items() if "error" not in row[name]}
        for name, us in _interleaved_host_us(runnable).items():
            row[name]["host_us"] = us
        results.append(row)
        if rank == 0:
            cells = []
            for name in methods:
                r = row[name]
                cells.append(f"{name} " + (f"graph {r['graph_us']:6.1f} eager {r['eager_us']:6.1f} "
                                           f"host {r['host_us']:6.1f} us"
                                           f"{'' if r['same_bits_as_nccl'] else ' BITS DIFFER'}"
                                           if "error" not in r else r["error"]))
            print(f"T={t:5d} ({row['bytes'] / 1024:7.0f} KiB): " + " | ".join(cells), flush=True)
    if rank == 0 and args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": world,
                "hidden": args.hidden}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    dist.barrier()
    torch.cuda.synchronize()
    dist.destroy_process_group()
    os._exit(0)  # CUDA-graph runs have hung at teardown


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", default="1,16,32,64,128,256,512,1024,2048,4096")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < args.world:
        sys.exit(f"bench_all_reduce: needs {args.world} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(torch.cuda.get_device_name(), torch.__version__, f"world={args.world}", flush=True)
    mp.spawn(_worker, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
