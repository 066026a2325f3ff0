"""tests/dist_utils.run_on_ranks: values come back per rank, failures and hangs are reported."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import RankError, run_on_ranks


def _all_reduce_rank(scale: int) -> tuple[int, torch.Tensor]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank() * scale, t


def _misbehave() -> None:
    rank = int(os.environ["RANK"])
    marker = os.environ["MISBEHAVE_MARKER"]
    if rank == 0:
        open(marker, "w").close()
        raise ValueError("bad input on rank 0")
    if rank == 1:
        # Exit only once rank 0 is about to raise: spawning can take seconds on a loaded machine,
        # longer than the grace period that starts at the first failure.
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(3)
    time.sleep(600)


def _sleep_forever() -> None:
    time.sleep(600)


def test_returns_values_in_rank_order():
    results = run_on_ranks(_all_reduce_rank, 2, 10, timeout=60)
    assert [r[0] for r in results] == [0, 10]
    assert all(torch.equal(r[1], torch.tensor([3.0])) for r in results)


def test_failures_name_the_rank_and_stragglers_are_stopped(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_misbehave, 3, backend=None, timeout=60, grace=1.0,
                     env={"MISBEHAVE_MARKER": str(tmp_path / "rank0_raising")})
    assert time.monotonic() - start < 45
    err = info.value
    assert err.rank == 0 and isinstance(err.__cause__, ValueError)
    assert "rank 0: raised ValueError: bad input on rank 0" in str(err) and "_misbehave" in str(err)
    assert "exited with code 3" in err.failures[1]
    assert "terminated" in err.failures[2]


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
