"""fp4fuse.distributed.groups: cross-rank agreement on the environment and on call signatures,
on 2 gloo ranks (one spawn runs every phase, in order)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import fp4fuse  # noqa: F401  (registers the ops)
from dist_utils import run_on_ranks
from fp4fuse.distributed import groups
from fp4fuse.distributed.symm_mem import policy
from fp4fuse.nvfp4 import format as nvfp4

ops = torch.ops.fp4fuse
N, K = 37, 208
GS = nvfp4.global_scale_from_amax(torch.tensor([10.0]))
ALPHA = 1.0 / (GS * GS)


def _operand(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ops.scaled_fp4_quant(torch.randn(rows, K, generator=g) * 3 + 0.25, GS)


def _gemm(a: torch.Tensor, s: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    return ops.fused_all_gather_fp4_matmul(a, s, b, sb, ALPHA, torch.bfloat16, dist.group.WORLD.group_name)


def _error(fn, error: type[Exception] = ValueError) -> str:
    with pytest.raises(error) as info:
        fn()
    return str(info.value)


def _agreement_phases() -> dict[str, object]:
    rank, group = dist.get_rank(), dist.group.WORLD.group_name
    report: dict[str, object] = {}
    a, s = _operand(16, 10 + rank)
    b, sb = _operand(N, 5)
    peers = [_operand(16, 10 + r) for r in range(dist.get_world_size())]
    expected = ops.mm_fp4(torch.cat([p[0] for p in peers]), b,
                          torch.cat([p[1].view(torch.uint8) for p in peers]).view(torch.float8_e4m3fn), sb, ALPHA,
                          torch.bfloat16)

    # 1. Environment, at the group's first call: every rank raises, naming each differing variable.
    os.environ[groups.ENV_CHECK] = "first" if rank == 0 else "Always"
    os.environ[policy.ENV_DISABLE] = "0"  # the same on both ranks: not reported
    if rank == 0:
        os.environ[policy.ENV_AG_SCHEDULE] = "per-shard"
    report["env"] = _error(lambda: _gemm(a, s, b, sb))
    os.environ[groups.ENV_CHECK] = "first"
    os.environ.pop(policy.ENV_AG_SCHEDULE, None)

    # 2. FIRST checks the first call of the op on the group (the failed environment call did not count) ...
    a_odd, s_odd = _operand(16 if rank == 0 else 24, 20 + rank)
    report["first"] = _error(lambda: _gemm(a_odd, s_odd, b, sb))
    # ... and no later call on any rank, whatever the local shapes: rank 1's weight grows (the
    # collectives still pair up), nobody checks, and the ranks stay in step.
    assert torch.equal(_gemm(a, s, b, sb), expected)
    b_local, sb_local = (b, sb) if rank == 0 else _operand(N + 16, 6)
    report["unchecked_shape"] = tuple(_gemm(a, s, b_local, sb_local).shape)
    assert torch.equal(_gemm(a, s, b, sb), expected)

    # 3. ALWAYS checks every call.
    os.environ[groups.ENV_CHECK] = "always"
    report["always"] = _error(lambda: _gemm(a_odd, s_odd, b, sb))
    assert torch.equal(_gemm(a, s, b, sb), expected)

    # 4. The comparison a CUDA-graph capture runs on the device; on CPU torch._assert_async raises at once.
    cpu = torch.device("cpu")
    groups.assert_same_on_device(group, 12345, cpu, "equal values never fail")
    report["device"] = _error(lambda: groups.assert_same_on_device(group, rank, cpu, "ranks differ on purpose"),
                              RuntimeError)

    # 5. Strings of different lengths per rank.
    report["strings"] = groups.gather_strings(group, ("x" * (3 * rank), f"é{rank}"), cpu)

    # 6. Out of step: rank 0 runs an all-gather of its own while rank 1 gathers strings, so rank 1's
    # lengths hold rank 0's value; rank 1 stops there with an error instead of padding to it.
    if rank == 0:
        groups.gather_values(group, (1 << 40,), cpu)
    else:
        report["out_of_step"] = _error(lambda: groups.gather_strings(group, ("abc",), cpu), RuntimeError)

    # 7. Activations of more than two dims that differ only in a later dim (the hidden size of a
    # [B, T, H] all-reduce input, a size after the fourth): a disagreement, not collectives of
    # different lengths (which read a peer's stale buffer on the symmetric-memory path).
    x = torch.zeros(2, 3, 8 if rank == 0 else 4)
    report["third_dim"] = _error(lambda: groups.check_ranks_agree("all_reduce_sum", group, 16, {"x": x}, x.dtype))
    y = torch.zeros(1, 1, 1, 1, 2, 6 if rank == 0 else 5)
    report["sixth_dim"] = _error(lambda: groups.check_ranks_agree("all_reduce_sum", group, 16, {"x": y}, y.dtype))
    same = torch.zeros(1, 1, 1, 1, 2, 6)
    groups.check_ranks_agree("all_reduce_sum", group, 16, {"x": same}, same.dtype)  # agrees: no error
    return report


def test_ranks_agree_on_environment_and_on_signatures_by_call_ordinal():
    reports = run_on_ranks(_agreement_phases, 2, timeout=120)
    env = reports[0]["env"]
    assert reports[1]["env"] == env
    assert "FP4FUSE_COLLECTIVE_CHECK (rank 0: 'first', rank 1: 'always')" in env
    assert "FP4FUSE_AG_SCHEDULE (rank 0: 'per-shard', rank 1: unset)" in env
    assert "FP4FUSE_DISABLE_OVERLAP" not in env
    for report in reports:
        assert "rank 0: a_shard[16, 104]" in report["first"] and "rank 1: a_shard[24, 104]" in report["first"]
        assert "rank 1: a_shard[24, 104]" in report["always"]
        assert "ranks differ on purpose" in report["device"]
        assert report["strings"] == [("", "é0"), ("xxx", "é1")]
    assert "rank 0 sent a length of 1099511627776 bytes" in reports[1]["out_of_step"]
    assert "collective calls are out of step" in reports[1]["out_of_step"]
    assert [r["unchecked_shape"] for r in reports] == [(32, N), (32, N + 16)]
    for report in reports:
        assert "rank 0: x[2, 3, 8] float32" in report["third_dim"] and "rank 1: x[2, 3, 4]" in report["third_dim"]
        assert "called it with different arguments" in report["sixth_dim"]


def test_call_signature_includes_the_device_of_each_argument():
    a = torch.empty(8, 104, dtype=torch.uint8)
    alpha = torch.ones(1)
    same = groups.call_signature(1, (a, alpha), torch.bfloat16)
    other = groups.call_signature(1, (a, alpha.to("meta")), torch.bfloat16)
    assert same != other
    assert groups.describe_signature(other, ("a", "alpha")).endswith(
        "alpha[1] float32 on another device than a, out_dtype=bfloat16")


def test_call_signature_covers_every_dimension():
    """Shapes that differ only after the second (or the fourth) dimension have different signatures."""
    def sig(*shape: int) -> tuple[int, ...]:
        return groups.call_signature(16, (torch.empty(shape, dtype=torch.bfloat16),), torch.bfloat16)

    assert sig(1, 8, 4096) != sig(1, 8, 2048)
    assert sig(2, 3, 4, 5, 6) != sig(2, 3, 4, 5, 7)
    assert sig(2, 3, 4, 5, 6) == sig(2, 3, 4, 5, 6)
    assert groups.describe_signature(sig(1, 8, 4096), ("x",)) == "x[1, 8, 4096] bfloat16, out_dtype=bfloat16"
    assert groups.describe_signature(sig(2, 3, 4, 5, 6), ("x",)) == "x[2, 3, 4, 5, ...] bfloat16, out_dtype=bfloat16"
