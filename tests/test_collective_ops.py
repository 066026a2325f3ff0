"""fp4fuse's collective NVFP4 GEMMs: fused == unfused, agreement errors, workspace sizing.

CPU tests run on gloo ranks (world sizes 2 and 3): the ops take the functional-collective path
there and must equal the unfused graph bit for bit. ``multigpu`` tests spawn 2 NCCL ranks and force
the symmetric-memory pipelines (threshold 0).
"""
from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist

import fp4fuse  # noqa: F401  (registers the ops)
from dist_utils import run_on_ranks
from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.distributed import groups
from fp4fuse.distributed.symm_mem import policy
from fp4fuse.distributed.symm_mem import workspace
from fp4fuse.distributed.symm_mem.workspace import all_gather_layout, reduce_scatter_layout

ops = torch.ops.fp4fuse
_funcol = torch.ops._c10d_functional
# torch's schema check compares inputs with allclose, which has no float8 kernel on CPU.
FP8_SAFE_OPCHECKS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
SHARD_ROWS = (1, 40, 64, 130)
N, K = 101, 208  # odd N; K a multiple of 16 with an odd number of scale blocks
GS = nvfp4.global_scale_from_amax(torch.tensor([10.0]))


# ----------------------------------------------------------------------------------------------
# Helpers shared by the rank functions (module level: spawned ranks import them)
# ----------------------------------------------------------------------------------------------
def _quantized(rows: int, k: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random NVFP4 operand (never zeros): uint8 [rows, k/2], e4m3 [rows, k/16]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 3 + 0.25
    q, s = ops.scaled_fp4_quant(x.to(device), GS.to(device))
    return q, s


def _group_name() -> str:
    return dist.group.WORLD.group_name


def _gather_ref(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """Unfused all-gather (functional collective), float8 as uint8."""
    world = dist.get_world_size()
    is_fp8 = t.dtype == torch.float8_e4m3fn
    raw = t.view(torch.uint8) if is_fp8 else t
    out = _funcol.wait_tensor(_funcol.all_gather_into_tensor(raw, world, group_name))
    return out.view(torch.float8_e4m3fn) if is_fp8 else out


def _reduce_scatter_ref(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    """Unfused reduce-scatter: fp32 sum of the out_dtype partials, rounded once."""
    world = dist.get_world_size()
    summed = _funcol.wait_tensor(_funcol.reduce_scatter_tensor(partial.float(), "sum", world, group_name))
    return summed.to(partial.dtype)


def _rank_order_sum_ref(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    """This rank's rows of the fp32 sum of every rank's ``partial`` in rank order, rounded once:
    what the overlapped reduce-scatter computes (for two ranks also what NCCL computes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = partial.shape[0] // world
    partials = _gather_ref(partial.float().contiguous(), group_name).view(world, world * m, -1)
    total = partials[0].clone()
    for r in range(1, world):
        total += partials[r]
    return total[rank * m:(rank + 1) * m].to(partial.dtype)


def _case_inputs(m: int, case: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One case's inputs on this rank: its activation shard, its RS operand, the weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a_shard, s_shard = _quantized(m, K, 1000 * case + rank, device)
    a_rs, s_rs = _quantized(world * m, K, 2000 * case + rank, device)
    b, sb = _quantized(N, K, 3000 * case, device)                  # column-parallel weight: same everywhere
    b_rs, sb_rs = _quantized(N, K, 4000 * case + rank, device)     # row-parallel weight: a K-shard per rank
    alpha = (1.0 / (GS * GS)).to(device)
    return dict(a_shard=a_shard, s_shard=s_shard, a_rs=a_rs, s_rs=s_rs, b=b, sb=sb, b_rs=b_rs, sb_rs=sb_rs,
                alpha=alpha)


def _check_cases(out_dtypes: tuple[torch.dtype, ...]) -> int:
    """Every shard size x out dtype: fused ops equal the unfused graph bit for bit. Returns #cases."""
    rank, world, group = dist.get_rank(), dist.get_world_size(), _group_name()
    device = torch.device("cpu")
    count = 0
    for case, m in enumerate(SHARD_ROWS):
        for out_dtype in out_dtypes:
            t = _case_inputs(m, case, device)
            a = _gather_ref(t["a_shard"], group)
            sa = _gather_ref(t["s_shard"], group)
            ref = ops.mm_fp4(a, t["b"], sa, t["sb"], t["alpha"], out_dtype)
            out = ops.fused_all_gather_fp4_matmul(t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"],
                                                  out_dtype, group)
            assert out.dtype == out_dtype and out.shape == (world * m, N)
            assert torch.equal(out, ref), f"all-gather GEMM differs: m={m} {out_dtype}"
            out2, a2, sa2 = ops.fused_all_gather_fp4_matmul_gathered(
                t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"], out_dtype, group)
            assert torch.equal(out2, ref) and torch.equal(a2, a)
            assert torch.equal(sa2.view(torch.uint8), sa.view(torch.uint8))
            # Rank order, independently of the collective: shard r is rank r's own random shard.
            for r in range(world):
                qr, sr = _quantized(m, K, 1000 * case + r, device)
                assert torch.equal(a2[r * m:(r + 1) * m], qr)
                assert torch.equal(sa2[r * m:(r + 1) * m].view(torch.uint8), sr.view(torch.uint8))

            partial = ops.mm_fp4(t["a_rs"], t["b_rs"], t["s_rs"], t["sb_rs"], t["alpha"], out_dtype)
            ref_rs = _reduce_scatter_ref(partial, group)
            out_rs = ops.fused_fp4_matmul_reduce_scatter(t["a_rs"], t["b_rs"], t["s_rs"], t["sb_rs"], t["alpha"],
                                                         out_dtype, group)
            assert out_rs.dtype == out_dtype and out_rs.shape == (m, N)
            assert torch.equal(out_rs, ref_rs), f"GEMM + reduce-scatter differs: m={m} {out_dtype}"
            # Independent of the collective: the fp32 sum of every rank's partial, rank order.
            partials = _gather_ref(partial.float().contiguous(), group).view(world, world * m, N)
            total = partials[0].clone()
            for r in range(1, world):
                total += partials[r]
            mine = total[rank * m:(rank + 1) * m].to(out_dtype)
            if world == 2:
                assert torch.equal(out_rs, mine)
            else:  # gloo may sum three partials in another order: fp32 reassociation + one final rounding
                magnitude = partials.abs().sum(0)[rank * m:(rank + 1) * m]
                ulp = torch.finfo(out_dtype).eps
                bound = 4 * torch.finfo(torch.float32).eps * magnitude + ulp * mine.float().abs()
                assert bool(((out_rs.float() - mine.float()).abs() <= bound).all()), f"RS m={m} {out_dtype}"
            count += 1
    return count


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _check_logs_once() -> int:
    """The no-overlap reason is logged at INFO once per group (and reason)."""
    handler = _ListHandler()
    log = logging.getLogger(policy.__name__)
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        t = _case_inputs(8, 77, torch.device("cpu"))
        for _ in range(3):
            ops.fused_all_gather_fp4_matmul(t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"],
                                            torch.bfloat16, _group_name())
    finally:
        log.removeHandler(handler)
    infos = [r for r in handler.records if r.levelno == logging.INFO and "fused_all_gather_fp4_matmul" in r.getMessage()]
    assert len(infos) == 1, [r.getMessage() for r in handler.records]
    assert "not on a CUDA device" in infos[0].getMessage()
    return len(infos)


def _expect_value_error(fn, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        fn()
    return str(info.value)


def _check_errors() -> list[str]:
    """Argument errors: the same clear ValueError on every rank, and the group stays usable."""
    rank, world, group = dist.get_rank(), dist.get_world_size(), _group_name()
    cpu = torch.device("cpu")
    messages = []
    # Reduce-scatter rows not divisible by the group size (the same on every rank).
    a, s = _quantized(world * 5 + 1, K, 11, cpu)
    b, sb = _quantized(N, K, 12, cpu)
    alpha = 1.0 / (GS * GS)
    messages.append(_expect_value_error(
        lambda: ops.fused_fp4_matmul_reduce_scatter(a, b, s, sb, alpha, torch.bfloat16, group),
        "must be divisible by the group size"))
    # Shard rows differ across ranks: an agreement error naming every rank, not a hang.
    rows = 40 if rank == 0 else 64
    a_shard, s_shard = _quantized(rows, K, 13 + rank, cpu)
    messages.append(_expect_value_error(
        lambda: ops.fused_all_gather_fp4_matmul(a_shard, s_shard, b, sb, alpha, torch.bfloat16, group),
        r"called it with different arguments \(rank 0: a_shard\[40, 104\]"))
    messages.append(_expect_value_error(
        lambda: ops.fused_all_gather_fp4_matmul_gathered(a_shard, s_shard, b, sb, alpha, torch.float32, group),
        "different arguments"))
    # out_dtype differs across ranks.
    a_ok, s_ok = _quantized(16, K, 14 + rank, cpu)
    dtype = torch.bfloat16 if rank == 0 else torch.float32
    messages.append(_expect_value_error(
        lambda: ops.fused_all_gather_fp4_matmul(a_ok, s_ok, b, sb, alpha, dtype, group),
        "out_dtype=bfloat16"))
    # Reduce-scatter M differs across ranks (only rank 0's is divisible): agreement comes first.
    a_rs, s_rs = _quantized(world * 4 + rank, K, 15, cpu)
    messages.append(_expect_value_error(
        lambda: ops.fused_fp4_matmul_reduce_scatter(a_rs, b, s_rs, sb, alpha, torch.bfloat16, group),
        "different arguments"))
    # Local validation errors after agreement are identical on every rank.
    messages.append(_expect_value_error(
        lambda: ops.fused_all_gather_fp4_matmul(a_ok, s_ok[:, :-1].contiguous(), b, sb, alpha, torch.bfloat16,
                                                group),
        "a_scale"))
    # The group is still in step: a correct call works afterwards.
    out = ops.fused_all_gather_fp4_matmul(a_ok, s_ok, b, sb, alpha, torch.bfloat16, group)
    assert out.shape == (world * 16, N)
    return messages


def _check_opcheck() -> int:
    group = _group_name()
    t = _case_inputs(40, 5, torch.device("cpu"))
    args_ag = (t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"], torch.bfloat16, group)
    torch.library.opcheck(ops.fused_all_gather_fp4_matmul, args_ag, test_utils=FP8_SAFE_OPCHECKS)
    torch.library.opcheck(ops.fused_all_gather_fp4_matmul_gathered, args_ag, test_utils=FP8_SAFE_OPCHECKS)
    args_rs = (t["a_rs"], t["b_rs"], t["s_rs"], t["sb_rs"], t["alpha"], torch.float32, group)
    torch.library.opcheck(ops.fused_fp4_matmul_reduce_scatter, args_rs, test_utils=FP8_SAFE_OPCHECKS)
    return 3


def _gloo_suite(run_opcheck: bool) -> dict[str, object]:
    result: dict[str, object] = {"logged": _check_logs_once()}  # first: the reason is logged once per process
    result["cases"] = _check_cases((torch.bfloat16, torch.float32))
    result["errors"] = _check_errors()
    if run_opcheck:
        result["opcheck"] = _check_opcheck()
    return result


# ----------------------------------------------------------------------------------------------
# CPU / gloo
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
def test_collective_gemms_on_gloo(world_size):
    results = run_on_ranks(_gloo_suite, world_size, world_size == 2, timeout=150)
    for r in results:
        assert r["cases"] == 2 * len(SHARD_ROWS)
        assert len(r["errors"]) == 6
        if world_size == 2:
            assert r["opcheck"] == 3
    assert "rank 1: a_shard[64, 104]" in results[0]["errors"][1]


def _mismatch_after_agreement() -> str:
    """Off CUDA every call is checked: a mismatch is caught even after both signatures were agreed."""
    rank, group = dist.get_rank(), _group_name()
    cpu = torch.device("cpu")
    b, sb = _quantized(N, K, 12, cpu)
    alpha = 1.0 / (GS * GS)
    for rows in (32, 48):
        a, s = _quantized(rows, K, 20 + rank, cpu)
        ops.fused_all_gather_fp4_matmul(a, s, b, sb, alpha, torch.bfloat16, group)
    a2, s2 = _quantized(32 if rank == 0 else 48, K, 30, cpu)
    return _expect_value_error(
        lambda: ops.fused_all_gather_fp4_matmul(a2, s2, b, sb, alpha, torch.bfloat16, group), "different arguments")


def test_mismatch_is_caught_after_agreement_off_cuda():
    results = run_on_ranks(_mismatch_after_agreement, 2, timeout=60)
    assert all("rank 1: a_shard[48, 104]" in m for m in results)


def test_check_mode_defaults(monkeypatch):
    monkeypatch.delenv(groups.ENV_CHECK, raising=False)
    assert groups.signature_check_mode("cuda") is groups.SignatureCheck.FIRST
    assert groups.signature_check_mode("cpu") is groups.SignatureCheck.ALWAYS
    monkeypatch.setenv(groups.ENV_CHECK, "off")
    assert groups.signature_check_mode("cpu") is groups.SignatureCheck.OFF


# ----------------------------------------------------------------------------------------------
# Pure functions: layouts, growth, threshold, signatures, the symmetric-memory API we build on
# ----------------------------------------------------------------------------------------------
def test_all_gather_layout_is_aligned_and_disjoint():
    layout = all_gather_layout(130, 104, 13)
    assert layout.data.offset == 0 and layout.data.nbytes == 130 * 104
    assert layout.scales.offset % workspace.ALIGN_BYTES == 0 and layout.scales.offset >= layout.data.end
    assert layout.nbytes % workspace.ALIGN_BYTES == 0 and layout.nbytes >= layout.scales.end


def test_reduce_scatter_layout_has_one_slot_per_peer():
    layout = reduce_scatter_layout(3, 40, 101, torch.bfloat16)
    assert len(layout.slots) == 2
    assert all(s.shape == (40, 101) and s.dtype == torch.bfloat16 for s in layout.slots)
    assert layout.slots[1].offset >= layout.slots[0].end and layout.slots[1].offset % workspace.ALIGN_BYTES == 0
    assert reduce_scatter_layout(1, 40, 101, torch.float32).nbytes == 0


def test_grown_capacity_is_deterministic_and_amortized():
    assert workspace.grown_capacity(0, 10) == workspace.MIN_CAPACITY_BYTES
    big = workspace.grown_capacity(0, 100 << 20)
    assert big >= 100 << 20 and big % (2 << 20) == 0
    assert workspace.grown_capacity(big, big + 1) >= int(big * 1.5)


def test_overlap_threshold_env(monkeypatch):
    ag, rs = policy.CollectiveGemmKind.ALL_GATHER_MATMUL, policy.CollectiveGemmKind.MATMUL_REDUCE_SCATTER
    monkeypatch.delenv(policy.ENV_MIN_ROWS, raising=False)
    assert policy.overlap_min_rows(ag, 2) == policy.overlap_min_rows(ag, 4) == policy.DEFAULT_ALL_GATHER_MIN_ROWS
    assert policy.overlap_min_rows(rs, 2) == 2 * policy.DEFAULT_REDUCE_SCATTER_MIN_ROWS_PER_RANK
    assert policy.overlap_min_rows(rs, 4) == 4 * policy.DEFAULT_REDUCE_SCATTER_MIN_ROWS_PER_RANK
    monkeypatch.setenv(policy.ENV_MIN_ROWS, "0")
    assert policy.overlap_min_rows(ag, 2) == policy.overlap_min_rows(rs, 4) == 0
    monkeypatch.setenv(policy.ENV_MIN_ROWS, "-3")
    with pytest.raises(ValueError, match="FP4FUSE_OVERLAP_MIN_ROWS.*integer >= 0"):
        policy.overlap_min_rows(ag, 2)
    monkeypatch.setenv(groups.ENV_CHECK, "sometimes")
    with pytest.raises(ValueError, match="FP4FUSE_COLLECTIVE_CHECK"):
        groups.signature_check_mode()


def test_all_gather_schedule_env_and_model(monkeypatch):
    from fp4fuse.distributed.symm_mem.policy import AllGatherSchedule
    monkeypatch.delenv(policy.ENV_AG_SCHEDULE, raising=False)
    limit = policy.DECODE_GATHER_MAX_PEER_ELEMENTS
    assert policy.all_gather_schedule(2, limit // 4096, 14336, 4096) is AllGatherSchedule.DECODE_GATHER
    assert policy.all_gather_schedule(2, limit // 4096 + 1, 14336, 4096) is AllGatherSchedule.PER_SHARD
    assert policy.all_gather_schedule(4, limit // 4096, 14336, 4096) is AllGatherSchedule.PER_SHARD
    for value in AllGatherSchedule:
        monkeypatch.setenv(policy.ENV_AG_SCHEDULE, value.value)
        assert policy.all_gather_schedule(2, 1024, 14336, 4096) is value
    monkeypatch.setenv(policy.ENV_AG_SCHEDULE, "sideways")
    with pytest.raises(ValueError, match="FP4FUSE_AG_SCHEDULE"):
        policy.all_gather_schedule(2, 1024, 14336, 4096)


def test_signature_describes_every_argument():
    a = torch.empty(40, 104, dtype=torch.uint8)
    s = torch.empty(40, 13, dtype=torch.float8_e4m3fn)
    alpha = torch.ones(1)
    sig = groups.call_signature(policy.CollectiveGemmKind.ALL_GATHER_MATMUL, (a, s, alpha), torch.bfloat16)
    text = groups.describe_signature(sig, ("a_shard", "a_scale_shard", "alpha"))
    assert text == "a_shard[40, 104] uint8, a_scale_shard[40, 13] float8_e4m3fn, alpha[1] float32, out_dtype=bfloat16"
    other = groups.call_signature(policy.CollectiveGemmKind.ALL_GATHER_MATMUL, (a.t(), s, alpha), torch.bfloat16)
    assert other != sig and "non-contiguous" in groups.describe_signature(other, ("a_shard", "s", "alpha"))


def test_cpu_inputs_cannot_use_symmetric_memory():
    assert "needs CUDA" in workspace.local_unavailability(torch.device("cpu"))


def test_symmetric_memory_api_surface():
    """Pins the (private) torch API the CUDA pipelines are built on, on this torch version."""
    from torch._C._distributed_c10d import _SymmetricMemory
    for name in ("empty_strided_p2p", "rendezvous", "get_buffer", "barrier", "put_signal", "wait_signal",
                 "get_backend", "rank", "world_size"):
        assert hasattr(_SymmetricMemory, name), name
    import inspect

    from torch.distributed import _symmetric_memory as symm_mem
    assert list(inspect.signature(symm_mem.rendezvous).parameters)[:2] == ["tensor", "group"]


# ----------------------------------------------------------------------------------------------
# 2 GPUs, NCCL, symmetric memory forced on (threshold 0)
# ----------------------------------------------------------------------------------------------
_GPU_ENV = {policy.ENV_MIN_ROWS: "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0",
            "NVSHMEM_DISABLE_NVLS": "1", workspace.ENV_TIMEOUT_MS: "60000"}


def _per_shard_mm(a: torch.Tensor, b, sa: torch.Tensor, sb, alpha, out_dtype, rows: int) -> torch.Tensor:
    """The fused ops' GEMMs, block by block: each ``rows``-row block through the kernel path and
    configuration that ``mm_fp4`` picks for the whole ``a`` (``RowBlockGemm``'s rule)."""
    from fp4fuse.kernels.triton import mm as triton_mm
    total, n, k = a.shape[0], b.shape[0], b.shape[1] * 2
    if out_dtype == torch.bfloat16 and total >= triton_mm.DEQUANT_MIN_M:
        def gemm(x, sx):
            return triton_mm.mm_fp4_dequant_mm(x, b, sx, sb, alpha)
    else:
        config = triton_mm.mm_config_for(total, n, k, a.device)

        def gemm(x, sx):
            return triton_mm.mm_fp4_tiled(x, b, sx, sb, alpha, out_dtype, config)
    return torch.cat([gemm(a[i:i + rows], sa[i:i + rows]) for i in range(0, total, rows)])


def _dequant_min_m() -> int:
    from fp4fuse.kernels.triton import mm as triton_mm
    return triton_mm.DEQUANT_MIN_M


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _all_gather_reference(a: torch.Tensor, sa: torch.Tensor, t: dict[str, torch.Tensor], out_dtype: torch.dtype,
                          shard_rows: int) -> torch.Tensor:
    """What ``fused_all_gather_fp4_matmul`` must equal bit for bit under the schedule it picks:
    one full ``mm_fp4`` for DECODE_GATHER (and on the tiled path, where every block runs the whole
    GEMM's configuration), the per-block GEMMs for PER_SHARD on the cuBLAS path."""
    from fp4fuse.distributed.symm_mem.policy import AllGatherSchedule
    world = dist.get_world_size()
    decoded = out_dtype == torch.bfloat16 and world * shard_rows >= _dequant_min_m()
    schedule = policy.all_gather_schedule(world, shard_rows, t["b"].shape[0], t["b"].shape[1] * 2)
    if not decoded or schedule is AllGatherSchedule.DECODE_GATHER:
        return ops.mm_fp4(a, t["b"], sa, t["sb"], t["alpha"], out_dtype)
    return _per_shard_mm(a, t["b"], sa, t["sb"], t["alpha"], out_dtype, shard_rows)


def _gpu_suite() -> dict[str, object]:
    rank, world, group = dist.get_rank(), dist.get_world_size(), _group_name()
    device = torch.device("cuda", rank)
    report: dict[str, object] = {"full_gemm_mismatches": []}
    for case, m in enumerate(SHARD_ROWS + (384, 1040)):
        for out_dtype in (torch.bfloat16, torch.float32):
            t = _case_inputs(m, case, device)
            a = _gather_ref(t["a_shard"], group)
            sa = _gather_ref(t["s_shard"], group)
            full = ops.mm_fp4(a, t["b"], sa, t["sb"], t["alpha"], out_dtype)
            for schedule in ("decode-gather", "per-shard"):
                os.environ[policy.ENV_AG_SCHEDULE] = schedule
                expected = _all_gather_reference(a, sa, t, out_dtype, m)
                out = ops.fused_all_gather_fp4_matmul(t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"],
                                                      out_dtype, group)
                out2, a2, sa2 = ops.fused_all_gather_fp4_matmul_gathered(
                    t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"], out_dtype, group)
                assert torch.equal(out, expected), f"AG {schedule} m={m} {out_dtype}"
                assert torch.equal(out2, expected) and torch.equal(a2, a), f"AG gathered {schedule} m={m}"
                assert torch.equal(sa2.view(torch.uint8), sa.view(torch.uint8))
                if not torch.equal(out, full):  # per-shard cuBLAS GEMMs: kernels picked by shape
                    report["full_gemm_mismatches"].append(("ag", schedule, m, str(out_dtype), int((out != full).sum())))
                    assert _rel_err(out, full) < 1e-2
            os.environ.pop(policy.ENV_AG_SCHEDULE)

            partial_same = _per_shard_mm(t["a_rs"], t["b_rs"], t["s_rs"], t["sb_rs"], t["alpha"], out_dtype, m)
            out_rs = ops.fused_fp4_matmul_reduce_scatter(t["a_rs"], t["b_rs"], t["s_rs"], t["sb_rs"], t["alpha"],
                                                         out_dtype, group)
            assert torch.equal(out_rs, _rank_order_sum_ref(partial_same, group)), f"RS m={m} {out_dtype}"
            if world > 2:  # NCCL sums in ring order: the fallback may differ in the last bit
                tol = 1e-5 if out_dtype == torch.float32 else 1e-2
                assert _rel_err(out_rs, _reduce_scatter_ref(partial_same, group)) < tol
            full_rs = _rank_order_sum_ref(
                ops.mm_fp4(t["a_rs"], t["b_rs"], t["s_rs"], t["sb_rs"], t["alpha"], out_dtype), group)
            if out_dtype != torch.bfloat16 or world * m < _dequant_min_m():
                assert torch.equal(out_rs, full_rs), f"RS m={m} {out_dtype}: differs from the unfused GEMM"
            elif not torch.equal(out_rs, full_rs):
                report["full_gemm_mismatches"].append(("rs", m, str(out_dtype), int((out_rs != full_rs).sum())))
                # a sum of two partials cancels: compare norm-wise, not element by element
                assert _rel_err(out_rs, full_rs) < 1e-2
    ws = workspace._REGISTRY[(group, rank)]
    assert isinstance(ws, workspace.SymmWorkspace) and ws.capacity > 0, ws
    report["capacity"] = ws.capacity
    t = _case_inputs(8, 99, device)
    from fp4fuse.ops.collective_gemm import RowBlockGemm
    report["modes"] = {rows: RowBlockGemm(t["b"], t["sb"], t["alpha"], torch.bfloat16, rows // 2, rows).mode.name
                       for rows in (80, 2080)}
    report["graph"] = _gpu_graph_capture(device, group)
    return report


def _gpu_graph_capture(device: torch.device, group: str) -> bool:
    """Reserve, capture both fused ops in one CUDA graph, replay on new inputs."""
    m, out_dtype = 136, torch.bfloat16
    world = dist.get_world_size()
    workspace.reserve_workspace(group, max_rows=world * m, k=K, n=N, out_dtype=out_dtype)
    static = _case_inputs(m, 50, device)
    def step():
        ag = ops.fused_all_gather_fp4_matmul(static["a_shard"], static["s_shard"], static["b"], static["sb"],
                                             static["alpha"], out_dtype, group)
        rs = ops.fused_fp4_matmul_reduce_scatter(static["a_rs"], static["b_rs"], static["s_rs"], static["sb_rs"],
                                                 static["alpha"], out_dtype, group)
        return ag, rs
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: agreement checks, kernel compilation
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # NCCL's watchdog thread polls events
        ag_out, rs_out = step()
    for case in (51, 52):
        fresh = _case_inputs(m, case, device)
        for name, tensor in fresh.items():
            static[name].copy_(tensor)
        graph.replay()
        a = _gather_ref(fresh["a_shard"], group)
        sa = _gather_ref(fresh["s_shard"], group)
        assert torch.equal(ag_out, _all_gather_reference(a, sa, fresh, out_dtype, m))
        partial = _per_shard_mm(fresh["a_rs"], fresh["b_rs"], fresh["s_rs"], fresh["sb_rs"], fresh["alpha"],
                                out_dtype, m)
        assert torch.equal(rs_out, _rank_order_sum_ref(partial, group))
    return True


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
def test_symmetric_memory_pipelines_on_gpus(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    results = run_on_ranks(_gpu_suite, world, backend="nccl", timeout=300, env=_GPU_ENV)
    for r in results:
        assert r["graph"] is True and r["capacity"] > 0
        assert r["modes"] == {80: "TILED", 2080: "DEQUANT_CUBLAS"}, r["modes"]
    print("fused vs one full GEMM, differing elements:", results[0]["full_gemm_mismatches"])
    print("row-block GEMM modes (bf16):", results[0]["modes"], "workspace bytes:", results[0]["capacity"])


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_in_rank_order_is_the_rank_ordered_fp32_sum(world, dtype):
    from fp4fuse.ops.collective_gemm import sum_in_rank_order
    gen = torch.Generator().manual_seed(world)
    partials = (torch.randn(world, 37, 53, generator=gen) * 1e3).to(dtype)
    expected = partials[0].float()
    for p in partials[1:]:
        expected = expected + p.float()
    got = sum_in_rank_order(partials)
    assert got.dtype == dtype and torch.equal(got, expected.to(dtype))
