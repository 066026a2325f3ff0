"""tests/dist_utils.run_on_ranks: values come back per rank, failures and hangs are reported."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import RankError, run_on_ranks


def _all_reduce_rank(scale: int) -> tuple[int, torch.Tensor]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank() * scale, t


def _raise_and_exit_slowly() -> None:
    """Rank 0 raises, but a non-daemon thread keeps its process from exiting (as a slow
    ``destroy_process_group`` or a stuck worker thread would); rank 1 never finishes."""
    if int(os.environ["RANK"]) == 0:
        threading.Thread(target=time.sleep, args=(600,), daemon=False).start()
        raise ValueError("bad input on rank 0")
    time.sleep(600)


def _die_without_result() -> None:
    if int(os.environ["RANK"]) == 0:
        os._exit(3)
    time.sleep(600)


def _abort_like_a_cpp_terminate() -> None:
    if int(os.environ["RANK"]) == 0:
        os.write(2, b"rank 0 about to abort\n")
        os.abort()  # SIGABRT, as std::terminate raises it in a C++ worker thread
    time.sleep(600)


def _sleep_forever() -> None:
    time.sleep(600)


def test_returns_values_in_rank_order():
    results = run_on_ranks(_all_reduce_rank, 2, 10, timeout=60)
    assert [r[0] for r in results] == [0, 10]
    assert all(torch.equal(r[1], torch.tensor([3.0])) for r in results)


def test_error_of_a_slowly_exiting_rank_is_kept():
    """A rank that recorded its error and is still exiting when the run ends keeps its error (it
    was reported as "still running (terminated)"), and its error starts the others' grace period
    (the run used to wait for the whole timeout)."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_raise_and_exit_slowly, 2, backend=None, timeout=120, grace=1.0)
    assert time.monotonic() - start < 100  # spawning is slow on a loaded machine; the timeout is 120
    err = info.value
    assert err.rank == 0 and isinstance(err.__cause__, ValueError)
    assert err.failures[0].startswith("raised ValueError: bad input on rank 0")
    assert "_raise_and_exit_slowly" in err.failures[0]
    assert err.failures[1] == "still running after another rank failed (terminated)"


def test_rank_dying_without_result_is_named_and_stragglers_are_stopped():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_die_without_result, 2, backend=None, timeout=120, grace=1.0)
    assert time.monotonic() - start < 100
    assert info.value.rank == 0
    assert info.value.failures == {0: "exited with code 3 without a result",
                                   1: "still running after another rank failed (terminated)"}


def test_rank_killed_by_a_signal_reports_the_end_of_its_stderr():
    with pytest.raises(RankError) as info:
        run_on_ranks(_abort_like_a_cpp_terminate, 2, backend=None, timeout=120, grace=1.0)
    report = info.value.failures[0]
    assert report.startswith("exited with code -6 without a result"), report
    # the message written just before the abort, then faulthandler's stacks of the dying rank
    tail = report.split("--- the end of its standard error ---", 1)[1]
    assert "rank 0 about to abort" in tail and "Fatal Python error: Aborted" in tail, report
    assert "_abort_like_a_cpp_terminate" in tail, report
    assert info.value.failures[1] == "still running after another rank failed (terminated)"


def _write_to_stderr() -> int:
    rank = int(os.environ["RANK"])
    os.write(2, f"rank {rank} wrote this to fd 2\n".encode())  # as C++ code writes
    print(f"rank {rank} printed this to sys.stderr", file=sys.stderr, flush=True)
    return rank


def test_ranks_stderr_reaches_this_process(capsys):
    assert run_on_ranks(_write_to_stderr, 2, backend=None, timeout=120) == [0, 1]
    err = capsys.readouterr().err
    for rank in (0, 1):
        assert f"rank {rank} wrote this to fd 2\n" in err and f"rank {rank} printed this to sys.stderr\n" in err, err


def test_timeout_raises_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish within 3"):
        run_on_ranks(_sleep_forever, 1, backend=None, timeout=3)
    assert time.monotonic() - start < 20


def _pid_and_rank() -> tuple[int, int]:
    return os.getpid(), dist.get_rank()


def test_hard_exit_returns_every_rank_value():
    """With hard_exit the ranks leave through os._exit right after saving their results (no
    teardown), and the values still come back, one per rank, from distinct processes."""
    results = run_on_ranks(_pid_and_rank, 2, timeout=60, hard_exit=True)
    assert [rank for _, rank in results] == [0, 1]
    assert len({pid for pid, _ in results}) == 2 and os.getpid() not in {pid for pid, _ in results}


def _crash_after_result() -> int:
    """Rank 0 saves its result, then its process exits with code 7 by itself (as a crash in
    process-group or CUDA teardown would): a non-daemon thread outlives ``fn`` and calls _exit."""
    rank = int(os.environ["RANK"])
    if rank == 0:
        threading.Thread(target=lambda: (time.sleep(0.3), os._exit(7)), daemon=False).start()
    return rank


def test_rank_exiting_non_zero_after_its_result_is_a_failure():
    """Used to come back as success ([0, 1]) although rank 0 exited with code 7."""
    with pytest.raises(RankError) as info:
        run_on_ranks(_crash_after_result, 2, backend=None, timeout=120, grace=1.0)
    assert info.value.rank == 0
    assert info.value.failures[0].startswith("returned its result, then exited with code 7"), info.value.failures
    assert 1 not in info.value.failures


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _group_threads_after_destroy() -> tuple[int, int, int]:
    """Native threads before init, with a gloo group, and after ``destroy_process_group``, when the
    first custom-op call (which imports ``torch._dynamo``) comes after the group's creation."""
    torch.randn(512, 512) @ torch.randn(512, 512)  # intra-op threads (where a rank has several) start first
    before = _native_threads()
    dist.init_process_group("gloo", store=dist.FileStore(os.environ["RANKS_TEST_STORE"], 2),
                            rank=int(os.environ["RANK"]), world_size=2)
    with_group = _native_threads()
    torch.ops.fp4fuse.scaled_fp4_quant(torch.randn(4, 32), torch.tensor([1.0]))
    dist.destroy_process_group()
    return before, with_group, _native_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")
def test_destroy_process_group_stops_the_gloo_threads(tmp_path):
    """With torch._dynamo first imported after init_process_group, the group outlived
    destroy_process_group: its gloo threads kept running into interpreter shutdown, where a
    finished collective's release aborted the rank ('terminate called without an active
    exception') about one run in eight of tests/test_groups.py."""
    results = run_on_ranks(_group_threads_after_destroy, 2, backend=None, timeout=120,
                           env={"RANKS_TEST_STORE": str(tmp_path / "store")})
    for before, with_group, after in results:
        assert with_group > before, "a gloo group runs threads of its own"
        assert after == before, (before, with_group, after)
