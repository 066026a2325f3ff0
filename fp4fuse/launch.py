"""Run a function on N freshly spawned ranks and collect what each returns (or raises).

Used by the TP=2 demo (``python -m fp4fuse.demo``) and by the tests (``tests/dist_utils.py``).

    from fp4fuse.launch import run_on_ranks

    def _check_on_rank(n):           # module level, so spawned processes can import it
        ...                          # the process group is initialized here (gloo by default)
        return torch.distributed.get_rank() * n

    assert run_on_ranks(_check_on_rank, 2, 10, timeout=60) == [0, 10]

Each call starts ``world_size`` new processes (``spawn``), so nothing leaks between calls: a
second call is a fresh process group, as after a restart. The ranks meet through a
``FileStore`` in a private temporary directory (no ports). Return values travel back through
``torch.save`` files, so tensors and any picklable object come back safely after the ranks exit.

Failures never hang the test: a rank that raises is reported as :class:`RankError` naming the
rank, the exception and its remote traceback (the original exception is the ``__cause__`` where it
pickles); once one rank has failed (recorded its error, even while its process is still exiting,
or exited without a result) the others get ``grace`` seconds to finish before they are terminated;
the whole run is bounded by ``timeout`` seconds (:class:`TimeoutError` names the ranks still
running). A terminated rank keeps what it recorded: only a rank with neither a result nor an
error is reported as terminated. A rank that saved its result and then exited on its own with a
non-zero code (a crash in process-group or CUDA teardown) is a failure, not a success.

What the ranks write to their standard error (fd 2: Python, C++ and the process group's own
messages) goes through a file per rank, relayed line by line to this process's ``sys.stderr``
while they run. A rank that dies without a result (a C++ ``std::terminate``'s SIGABRT, a SIGSEGV)
is reported with the end of that file: the C++ message, and the Python stacks of all its threads
at the fatal signal (:mod:`faulthandler`).
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import logging
import multiprocessing
import os
import pickle
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

__all__ = ["RankError", "run_on_ranks"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05


class RankError(RuntimeError):
    """One or more ranks failed. ``failures`` maps rank -> description; ``rank`` is the lowest rank
    that raised or died (ranks terminated because of it are listed in ``failures`` too)."""

    def __init__(self, rank: int, failures: dict[int, str]):
        self.rank = rank
        self.failures = dict(sorted(failures.items()))
        super().__init__("\n\n".join(f"rank {r}: {msg}" for r, msg in self.failures.items()))


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str | None = "gloo",
    grace: float = 5.0,
    env: Mapping[str, str] | None = None,
    hard_exit: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` on ranks ``0 .. world_size - 1``, each in a new process.

    ``fn`` must be importable by name (a module-level function), and its arguments and return
    value picklable. With ``backend`` (default ``"gloo"``; ``"nccl"`` also sets the CUDA device to
    the rank) the default process group is initialized before ``fn`` runs and destroyed after;
    with None, ``fn`` initializes what it needs itself. Every rank sees the environment variables
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, plus ``env``; torch's
    intra-op threads are split evenly between the ranks.

    ``timeout``: seconds for the whole run, also the process group's collective timeout.
    ``hard_exit``: each rank leaves with ``os._exit(0)`` right after saving its result, skipping
    process-group and CUDA teardown (which has hung after CUDA-graph runs with NCCL).
    Returns the per-rank return values, indexed by rank. Raises :class:`RankError` if any rank
    raised or died, :class:`TimeoutError` if the run did not finish in time.
    """
    if world_size < 1:
        raise ValueError(f"run_on_ranks: world_size must be >= 1, got {world_size}")
    ctx = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="fp4fuse_ranks_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, fn, args, backend, store_path, tmp, timeout, threads, hard_exit),
                name=f"rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        with _environ(env or {}):
            for p in procs:
                p.start()
        relay = _StderrRelay(tmp, world_size)
        try:
            unfinished = _wait(procs, tmp, timeout, grace, relay)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5.0)
                if p.is_alive():
                    p.kill()
                    p.join()
            relay.pump(final=True)
        return _collect(procs, tmp, unfinished, timeout)


def _wait(procs: list, result_dir: str, timeout: float, grace: float, relay: _StderrRelay) -> set[int]:
    """Wait for the ranks; return those still running when the deadline passed.

    A rank has failed once it recorded an error (even while it is still exiting) or exited
    without a result; the first failure starts the ``grace`` period of the others."""
    deadline = time.monotonic() + timeout
    failed_deadline: float | None = None
    while True:
        relay.pump()
        alive = {rank for rank, p in enumerate(procs) if p.is_alive()}
        if not alive:
            return set()
        now = time.monotonic()
        if failed_deadline is None and any(
            _failed(rank, p, result_dir, rank in alive) for rank, p in enumerate(procs)
        ):
            failed_deadline = now + grace
        if now >= deadline or (failed_deadline is not None and now >= failed_deadline):
            return alive
        time.sleep(_POLL_S)


def _failed(rank: int, proc, result_dir: str, alive: bool) -> bool:
    if os.path.exists(_err_path(result_dir, rank)):
        return True
    return not alive and (proc.exitcode != 0 or not os.path.exists(_ok_path(result_dir, rank)))


def _collect(procs: list, result_dir: str, unfinished: set[int], timeout: float) -> list[Any]:
    """Per-rank values; RankError if a rank raised or died, TimeoutError if some only ran late.

    What a rank recorded wins over how it was stopped: a rank that wrote its error (or its result)
    and was terminated by this process while exiting keeps that error (or result). Only a rank
    terminated with neither is reported as still running. A rank that wrote its result and then
    exited by itself with a non-zero code failed (``_failed`` already counted it so)."""
    failures: dict[int, str] = {}
    causes: dict[int, BaseException] = {}
    values: list[Any] = []
    stragglers: list[int] = []
    for rank, proc in enumerate(procs):
        ok, err = _ok_path(result_dir, rank), _err_path(result_dir, rank)
        values.append(torch.load(ok, weights_only=False) if os.path.exists(ok) else None)
        if os.path.exists(err):
            report = torch.load(err, weights_only=False)
            failures[rank] = f"raised {report['summary']}\n--- remote traceback ---\n{report['traceback']}"
            if report["exception"] is not None:
                with contextlib.suppress(Exception):
                    causes[rank] = pickle.loads(report["exception"])
        elif os.path.exists(ok):
            if rank not in unfinished and proc.exitcode != 0:
                # it exited on its own, not terminated by us: a crash or exit code after its result
                failures[rank] = (f"returned its result, then exited with code {proc.exitcode}"
                                  + _stderr_tail(result_dir, rank))
            continue
        elif rank in unfinished:
            stragglers.append(rank)
        else:
            failures[rank] = f"exited with code {proc.exitcode} without a result" + _stderr_tail(result_dir, rank)
    if failures:
        first = min(failures)
        for rank in stragglers:
            failures[rank] = "still running after another rank failed (terminated)"
        raise RankError(first, failures) from causes.get(first)
    if stragglers:
        raise TimeoutError(f"run_on_ranks: ranks {stragglers} did not finish within {timeout} s")
    return values


def _rank_main(
    rank: int, world_size: int, fn: Callable[..., Any], args: tuple, backend: str | None,
    store_path: str, result_dir: str, timeout: float, threads: int, hard_exit: bool,
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    stderr_file = os.open(_stderr_path(result_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(stderr_file, 2)  # C++ writes too; the parent relays it (_StderrRelay)
    os.close(stderr_file)
    faulthandler.enable(all_threads=True)  # to fd 2
    _import_dynamo_before_process_groups()
    try:
        if backend is not None:
            if backend == "nccl":
                torch.cuda.set_device(rank)
            dist.init_process_group(
                backend, store=dist.FileStore(store_path, world_size), rank=rank,
                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        value = fn(*args)
        torch.save(value, _ok_path(result_dir, rank) + ".tmp")
        os.replace(_ok_path(result_dir, rank) + ".tmp", _ok_path(result_dir, rank))
        if hard_exit:
            os._exit(0)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        try:
            pickled: bytes | None = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text only
            pickled = None
        torch.save({"summary": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                    "exception": pickled}, _err_path(result_dir, rank))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _import_dynamo_before_process_groups() -> None:
    """Import ``torch._dynamo`` before any process group exists.

    Imported later (the first call of any ``torch.library`` custom op imports it), it takes
    references to the default group that ``destroy_process_group`` does not drop (torch 2.13 CPU:
    10 of them). The group then outlives its destruction, and a gloo worker thread releasing a
    finished collective's tensors during interpreter shutdown needs the GIL that finalization holds:
    the process aborts ("terminate called without an active exception") after saving its result.
    Imported first, the group dies in ``destroy_process_group`` and joins its threads there."""
    import torch._dynamo  # noqa: F401


def _ok_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.result.pt")


def _err_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.error.pt")


def _stderr_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.stderr")


#: how much of a dead rank's standard error its report quotes (characters, from the end)
_STDERR_TAIL_CHARS = 6000


def _stderr_tail(result_dir: str, rank: int) -> str:
    """The end of what a rank wrote to its standard error ('' if nothing)."""
    with contextlib.suppress(OSError), open(_stderr_path(result_dir, rank), errors="replace") as f:
        text = f.read()[-_STDERR_TAIL_CHARS:].strip()
        if text:
            return f"\n--- the end of its standard error ---\n{text}"
    return ""


class _StderrRelay:
    """Copies the ranks' standard-error files to ``sys.stderr``, whole lines at a time (a rank's
    partial line waits for its end, or for the final pump)."""

    def __init__(self, result_dir: str, world_size: int) -> None:
        self._paths = [_stderr_path(result_dir, rank) for rank in range(world_size)]
        self._offsets = [0] * world_size
        self._partial = [b""] * world_size

    def pump(self, final: bool = False) -> None:
        for rank, path in enumerate(self._paths):
            with contextlib.suppress(OSError), open(path, "rb") as f:
                f.seek(self._offsets[rank])
                chunk = f.read()
                self._offsets[rank] += len(chunk)
                self._partial[rank] += chunk
            data = self._partial[rank]
            cut = len(data) if final else data.rfind(b"\n") + 1
            if cut:
                text = data[:cut].decode(errors="replace")
                sys.stderr.write(text if text.endswith("\n") else text + "\n")
                sys.stderr.flush()
            self._partial[rank] = data[cut:]


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in this process while the ranks start (spawned children copy the environment)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
