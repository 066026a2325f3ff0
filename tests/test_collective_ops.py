"""fp4fuse's collective NVFP4 GEMMs: results, empty calls, argument errors, workspace sizing.

Expected values never come from the collectives under test (or copies of them): every rank
regenerates every other rank's seeded inputs, so the gathered activation is the concatenation of
known shards, a reduce-scatter's value is the float64 sum of every rank's partial, and GEMMs are
checked against float64 math on values decoded by tests/nvfp4_oracle.py.

CPU tests run on gloo ranks (world sizes 2 and 3): the ops take the functional-collective path
there. ``multigpu`` tests spawn NCCL ranks and force the symmetric-memory pipelines (threshold 0).
"""
from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist

import fp4fuse  # noqa: F401  (registers the ops)
import nvfp4_oracle as oracle
from dist_utils import RankError, run_on_ranks
from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.distributed import groups
from fp4fuse.distributed.symm_mem import policy
from fp4fuse.distributed.symm_mem import workspace
from fp4fuse.distributed.symm_mem.workspace import all_gather_layout, reduce_scatter_layout
from fp4fuse.ops import collective_ops

ops = torch.ops.fp4fuse
# torch's schema check compares inputs with allclose, which has no float8 kernel on CPU.
FP8_SAFE_OPCHECKS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
SHARD_ROWS = (1, 40, 64, 130)
N, K = 101, 208  # odd N; K a multiple of 16 with an odd number of scale blocks
GS = nvfp4.global_scale_from_amax(torch.tensor([10.0]))
FP32_EPS = torch.finfo(torch.float32).eps


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


def _case_inputs(m: int, case: int, device: torch.device, rank: int | None = None) -> dict[str, torch.Tensor]:
    """One case's inputs of ``rank`` (default: this rank): its activation shard, its reduce-scatter
    operand, the weights. Any rank can rebuild any other rank's inputs from the seeds."""
    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size()
    a_shard, s_shard = _quantized(m, K, 1000 * case + rank, device)
    a_rs, s_rs = _quantized(world * m, K, 2000 * case + rank, device)
    b, sb = _quantized(N, K, 3000 * case, device)                  # column-parallel weight: same everywhere
    b_rs, sb_rs = _quantized(N, K, 4000 * case + rank, device)     # row-parallel weight: a K-shard per rank
    alpha = (1.0 / (GS * GS)).to(device)
    return dict(a_shard=a_shard, s_shard=s_shard, a_rs=a_rs, s_rs=s_rs, b=b, sb=sb, b_rs=b_rs, sb_rs=sb_rs,
                alpha=alpha)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0 (float8 through a uint8 view: no float8 cat on every device)."""
    if parts[0].dtype == torch.float8_e4m3fn:
        return torch.cat([p.view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn)
    return torch.cat(parts)


def _expected_gather(m: int, case: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What the all-gather must deliver: every rank's shard (rebuilt from its seed), rank order."""
    shards = [_case_inputs(m, case, device, rank=r) for r in range(dist.get_world_size())]
    return _cat_rows([t["a_shard"] for t in shards]), _cat_rows([t["s_shard"] for t in shards])


def _exact_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``alpha * A @ B^T`` in float64 on the oracle's decode (CPU), and ``|alpha| * |A| @ |B|^T``
    (the scale of the fp32 accumulation error)."""
    da, db = oracle.dequantize(a.cpu(), sa.cpu()), oracle.dequantize(b.cpu(), sb.cpu())
    scale = float(alpha.double().abs().item())
    return (da @ db.t()) * float(alpha.double().item()), (da.abs() @ db.abs().t()) * scale


def _within_gemm_bound(out: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, k: int) -> bool:
    """A GEMM accumulated in fp32 and rounded to out's dtype (twice on the dequantize + cuBLAS
    path: the product, then the alpha scale), element by element: ``|out - exact| <= eps(out)
    |exact| + (k eps32 + 2 eps(out)) magnitude``. The ``2 eps(out)`` term covers cuBLAS reducing
    split-K partials in the output dtype (PyTorch allows it for bf16 by default)."""
    eps = torch.finfo(out.dtype).eps
    error = (out.double().cpu() - exact).abs()
    bound = eps * exact.abs() + (k * FP32_EPS + 2 * eps) * magnitude + torch.finfo(out.dtype).tiny
    return bool((error <= bound).all())


def _reduce_scatter_partials(m: int, case: int, out_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every rank's ``out_dtype`` partial ``mm_fp4(a_rs, b_rs)`` (rebuilt from the seeds), restricted
    to this rank's output rows, as float64 ``[W, m, N]``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    partials = []
    for r in range(world):
        t = _case_inputs(m, case, device, rank=r)
        partial = ops.mm_fp4(t["a_rs"], t["b_rs"], t["s_rs"], t["sb_rs"], t["alpha"], out_dtype)
        partials.append(partial[rank * m:(rank + 1) * m].double().cpu())
    return torch.stack(partials)


def _check_reduce_scatter_sum(out: torch.Tensor, partials: torch.Tensor) -> None:
    """The contract: the out_dtype partials summed in fp32, rounded once. Two ranks: one fp32
    addition of two out_dtype values is their exact sum correctly rounded, so bit for bit the
    float64 sum rounded to out_dtype. More ranks: the fp32 summation order is the backend's, so
    within ``ulp(out) |sum| + 2 eps32 sum |partial|``."""
    exact = partials.sum(0)
    if partials.shape[0] == 2:
        assert torch.equal(out.cpu(), exact.to(out.dtype)), "reduce-scatter differs from the exact sum"
        return
    eps = torch.finfo(out.dtype).eps
    bound = eps * exact.abs() + 2 * FP32_EPS * partials.abs().sum(0) + torch.finfo(out.dtype).tiny
    assert bool(((out.double().cpu() - exact).abs() <= bound).all()), "reduce-scatter off the exact sum"


def _check_cases(out_dtypes: tuple[torch.dtype, ...]) -> int:
    """Every shard size x out dtype on the functional path. Returns the number of cases."""
    world, group = dist.get_world_size(), _group_name()
    device = torch.device("cpu")
    count = 0
    for case, m in enumerate(SHARD_ROWS):
        for out_dtype in out_dtypes:
            t = _case_inputs(m, case, device)
            a, sa = _expected_gather(m, case, device)
            # the contract: mm_fp4 of the gathered activation (mm_fp4 itself is checked against float64
            # in test_ops.py), bit for bit
            expected = ops.mm_fp4(a, t["b"], sa, t["sb"], t["alpha"], out_dtype)
            out = ops.fused_all_gather_fp4_matmul(t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"],
                                                  out_dtype, group)
            assert out.dtype == out_dtype and out.shape == (world * m, N)
            assert torch.equal(out, expected), f"all-gather GEMM differs: m={m} {out_dtype}"
            out2, a2, sa2 = ops.fused_all_gather_fp4_matmul_gathered(
                t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"], out_dtype, group)
            assert torch.equal(out2, expected) and torch.equal(a2, a)
            assert torch.equal(sa2.view(torch.uint8), sa.view(torch.uint8))

            out_rs = ops.fused_fp4_matmul_reduce_scatter(t["a_rs"], t["b_rs"], t["s_rs"], t["sb_rs"], t["alpha"],
                                                         out_dtype, group)
            assert out_rs.dtype == out_dtype and out_rs.shape == (m, N)
            _check_reduce_scatter_sum(out_rs, _reduce_scatter_partials(m, case, out_dtype, device))
            if case == 0:  # the ops' CUDA kernels (run on GPUs below) take the functional path for CPU tensors
                cuda_out, cuda_a, cuda_sa = collective_ops._all_gather_matmul_cuda(
                    True, t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"], out_dtype, group)
                assert torch.equal(cuda_out, expected) and torch.equal(cuda_a, a)
                assert torch.equal(collective_ops._all_gather_matmul_cuda(
                    False, t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"], out_dtype, group)[0], expected)
                assert torch.equal(collective_ops._matmul_reduce_scatter_cuda(
                    t["a_rs"], t["b_rs"], t["s_rs"], t["sb_rs"], t["alpha"], out_dtype, group), out_rs)
            count += 1
    return count


def _check_empty_calls(device: torch.device) -> int:
    """0 rows, N = 0 or both: the empty result of the contract's shape and dtype; the gathered
    activation is still every rank's (empty or not) shard. Returns the number of calls checked."""
    world, group = dist.get_world_size(), _group_name()
    alpha = (1.0 / (GS * GS)).to(device)
    calls = 0
    for case, (m, n) in enumerate(((0, N), (5, 0), (0, 0)), start=60):
        t = _case_inputs(m, case, device)
        b, sb = _quantized(n, K, 3000 * case, device)
        b_rs, sb_rs = _quantized(n, K, 4000 * case, device)
        a, sa = _expected_gather(m, case, device)
        for out_dtype in (torch.bfloat16, torch.float32):
            out = ops.fused_all_gather_fp4_matmul(t["a_shard"], t["s_shard"], b, sb, alpha, out_dtype, group)
            assert out.shape == (world * m, n) and out.dtype == out_dtype
            out2, a2, sa2 = ops.fused_all_gather_fp4_matmul_gathered(t["a_shard"], t["s_shard"], b, sb, alpha,
                                                                     out_dtype, group)
            assert out2.shape == (world * m, n) and out2.dtype == out_dtype
            assert torch.equal(a2, a) and torch.equal(sa2.view(torch.uint8), sa.view(torch.uint8))
            out_rs = ops.fused_fp4_matmul_reduce_scatter(t["a_rs"], b_rs, t["s_rs"], sb_rs, alpha, out_dtype, group)
            assert out_rs.shape == (m, n) and out_rs.dtype == out_dtype
            calls += 3
    return calls


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
    # Local validation errors after agreement are identical on every rank, and name the op's arguments.
    messages.append(_expect_value_error(
        lambda: ops.fused_all_gather_fp4_matmul(a_ok, s_ok[:, :-1].contiguous(), b, sb, alpha, torch.bfloat16,
                                                group),
        r"\ba_scale_shard\b"))
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
    result["empty"] = _check_empty_calls(torch.device("cpu"))
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
        assert r["empty"] == 18
        assert len(r["errors"]) == 6
        if world_size == 2:
            assert r["opcheck"] == 3
    assert "rank 1: a_shard[64, 104]" in results[0]["errors"][1]


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
# 2 or 4 GPUs, NCCL, symmetric memory forced on (threshold 0)
# ----------------------------------------------------------------------------------------------
_GPU_ENV = {policy.ENV_MIN_ROWS: "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0",
            "NVSHMEM_DISABLE_NVLS": "1", workspace.ENV_TIMEOUT_MS: "60000"}


def _check_gpu_all_gather(t: dict[str, torch.Tensor], m: int, case: int, out_dtype: torch.dtype,
                          mismatches: list) -> None:
    """Every schedule: the gathered activation is every rank's shard; the output is within the
    fp32-accumulation bound of the float64 GEMM, and bit for bit the unfused ``mm_fp4`` where the
    docs promise it (decode-gather: one GEMM over all rows; fp32 output: the tiled kernel with the
    whole GEMM's configuration). Other differences are appended to ``mismatches``."""
    from fp4fuse.distributed.symm_mem.policy import AllGatherSchedule
    group, device = _group_name(), t["a_shard"].device
    a, sa = _expected_gather(m, case, device)
    exact, magnitude = _exact_gemm(a, sa, t["b"], t["sb"], t["alpha"])
    full = ops.mm_fp4(a, t["b"], sa, t["sb"], t["alpha"], out_dtype)
    for schedule in AllGatherSchedule:
        os.environ[policy.ENV_AG_SCHEDULE] = schedule.value
        out = ops.fused_all_gather_fp4_matmul(t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"], out_dtype,
                                              group)
        out2, a2, sa2 = ops.fused_all_gather_fp4_matmul_gathered(
            t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"], out_dtype, group)
        where = f"AG {schedule.value} m={m} {out_dtype}"
        assert torch.equal(a2, a) and torch.equal(sa2.view(torch.uint8), sa.view(torch.uint8)), where
        assert torch.equal(out2, out), where
        assert _within_gemm_bound(out, exact, magnitude, K), where
        if schedule is AllGatherSchedule.DECODE_GATHER or out_dtype == torch.float32:
            assert torch.equal(out, full), where + ": differs from the unfused GEMM"
        elif not torch.equal(out, full):
            mismatches.append((where, int((out != full).sum())))
    os.environ.pop(policy.ENV_AG_SCHEDULE)


def _check_gpu_reduce_scatter(t: dict[str, torch.Tensor], m: int, case: int, out_dtype: torch.dtype) -> None:
    """Within the bound of the float64 sum of every rank's float64 GEMM (partials rounded to
    out_dtype, fp32 accumulation); fp32 output (tiled kernel: partials bitwise the unfused GEMM's
    rows): the contract's fp32 sum of the partials (``_check_reduce_scatter_sum``)."""
    rank, world, group = dist.get_rank(), dist.get_world_size(), _group_name()
    out = ops.fused_fp4_matmul_reduce_scatter(t["a_rs"], t["b_rs"], t["s_rs"], t["sb_rs"], t["alpha"], out_dtype,
                                              group)
    rows = slice(rank * m, (rank + 1) * m)
    exacts, magnitudes = zip(*(
        _exact_gemm(r["a_rs"][rows], r["s_rs"][rows], r["b_rs"], r["sb_rs"], r["alpha"])
        for r in (_case_inputs(m, case, t["a_rs"].device, rank=other) for other in range(world))))
    exact = sum(exacts)
    eps = torch.finfo(out_dtype).eps
    # each partial as _within_gemm_bound allows, plus one rounding of the fp32 sum to out_dtype
    bound = eps * (exact.abs() + sum(e.abs() for e in exacts)) + (K * FP32_EPS + 2 * eps) * sum(magnitudes)
    assert bool(((out.double().cpu() - exact).abs() <= bound + torch.finfo(out_dtype).tiny).all()), \
        f"RS m={m} {out_dtype}"
    if out_dtype == torch.float32:
        _check_reduce_scatter_sum(out, _reduce_scatter_partials(m, case, out_dtype, t["a_rs"].device))


def _gpu_suite() -> dict[str, object]:
    rank, group = dist.get_rank(), _group_name()
    device = torch.device("cuda", rank)
    mismatches: list = []
    report: dict[str, object] = {"full_gemm_mismatches": mismatches}
    for case, m in enumerate(SHARD_ROWS + (384, 1040)):
        for out_dtype in (torch.bfloat16, torch.float32):
            t = _case_inputs(m, case, device)
            _check_gpu_all_gather(t, m, case, out_dtype, mismatches)
            _check_gpu_reduce_scatter(t, m, case, out_dtype)
    report["empty"] = _check_empty_calls(device)  # empty operands take the functional path at any threshold
    ws = workspace._REGISTRY[(group, rank)][1]
    assert isinstance(ws, workspace.SymmWorkspace) and ws.capacity > 0, ws
    report["capacity"] = ws.capacity
    t = _case_inputs(8, 99, device)
    from fp4fuse.ops.collective_gemm import RowBlockGemm
    report["modes"] = {f"{str(dtype)[6:]}/{rows}": RowBlockGemm(t["b"], t["sb"], t["alpha"], dtype, rows // 2, rows).mode.name
                       for dtype, rows in ((torch.bfloat16, 80), (torch.bfloat16, 2080), (torch.float32, 400))}
    report["graph"] = [_gpu_graph_capture(device, group, mode) for mode in ("first", "always")]
    report["other_device"] = _from_another_current_device(device, group)
    return report


def _from_another_current_device(device: torch.device, group: str) -> int:
    """Calls made while another GPU is current (its stream kept busy): each op runs on its inputs'
    GPU and stream, so the results equal the same calls made from their own GPU, and the current
    device and streams are what they were. Launched on the current GPU's stream (no device guard),
    the consumers on the inputs' stream read the outputs before they were written."""
    other = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    m, out_dtype = 136, torch.bfloat16
    t = _case_inputs(m, 60, device)

    def calls() -> list[torch.Tensor]:
        ag = ops.fused_all_gather_fp4_matmul(t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"], out_dtype, group)
        gathered = ops.fused_all_gather_fp4_matmul_gathered(t["a_shard"], t["s_shard"], t["b"], t["sb"], t["alpha"],
                                                            out_dtype, group)
        rs = ops.fused_fp4_matmul_reduce_scatter(t["a_rs"], t["b_rs"], t["s_rs"], t["sb_rs"], t["alpha"], out_dtype,
                                                 group)
        return [ag, *gathered, rs]

    want = [x.cpu() for x in calls()]
    torch.cuda.synchronize(device)
    with torch.cuda.device(other):
        before = (torch.cuda.current_stream(device), torch.cuda.current_stream(other))
        torch.cuda._sleep(1_000_000_000)  # the other GPU's stream busy for about half a second
        got = [x.cpu() for x in calls()]  # copies on the inputs' GPU's stream
        assert torch.cuda.current_device() == other.index
        assert (torch.cuda.current_stream(device), torch.cuda.current_stream(other)) == before
    torch.cuda.synchronize(other)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                           w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w), f"output {i}"
    return len(got)


def _gpu_graph_capture(device: torch.device, group: str, check_mode: str) -> str:
    """Reserve, capture both fused ops in one CUDA graph, replay on new inputs; grow the workspace
    with a larger eager call and replay again. Under ``always`` the capture holds the device-side
    signature check (groups module doc), which must pass."""
    os.environ[groups.ENV_CHECK] = check_mode
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

    def replay_equals_eager(case: int) -> None:
        fresh = _case_inputs(m, case, device)
        for name, tensor in fresh.items():
            static[name].copy_(tensor)
        graph.replay()
        a, sa = _expected_gather(m, case, device)
        exact, magnitude = _exact_gemm(a, sa, fresh["b"], fresh["sb"], fresh["alpha"])
        assert _within_gemm_bound(ag_out, exact, magnitude, K), f"captured AG ({check_mode}, case {case})"
        assert torch.equal(ag_out, ops.fused_all_gather_fp4_matmul(
            fresh["a_shard"], fresh["s_shard"], fresh["b"], fresh["sb"], fresh["alpha"], out_dtype, group)), case
        assert torch.equal(rs_out, ops.fused_fp4_matmul_reduce_scatter(
            fresh["a_rs"], fresh["b_rs"], fresh["s_rs"], fresh["sb_rs"], fresh["alpha"], out_dtype, group)), case

    replay_equals_eager(51)
    replay_equals_eager(52)
    # A larger eager call grows the workspace after the capture; the generation the graph captured
    # stays mapped (workspace module doc), so its replays still give the eager results.
    ws = workspace._REGISTRY[(group, device.index)][1]
    generation, retired = ws.generation, len(ws.retired)
    big = m
    while reduce_scatter_layout(world, big, N, out_dtype).nbytes <= ws.capacity:
        big *= 2
    grow = _case_inputs(big, 53, device)
    ops.fused_fp4_matmul_reduce_scatter(grow["a_rs"], grow["b_rs"], grow["s_rs"], grow["sb_rs"], grow["alpha"],
                                        out_dtype, group)
    assert (ws.generation, len(ws.retired)) == (generation + 1, retired + 1), (generation, ws.generation)
    replay_equals_eager(54)
    os.environ.pop(groups.ENV_CHECK)
    return check_mode


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
def test_symmetric_memory_pipelines_on_gpus(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    results = run_on_ranks(_gpu_suite, world, backend="nccl", timeout=300, env=_GPU_ENV)
    for r in results:
        assert r["graph"] == ["first", "always"] and r["capacity"] > 0 and r["empty"] == 18
        assert r["other_device"] == 5, r["other_device"]  # ag, gathered (out, a, a_scale), rs
        # as mm_fp4 on the whole GEMM: decode GEMM up to 256 rows, then dequantize + cuBLAS for bf16
        # output and the tiled kernel for the others (fp4fuse/kernels/triton/mm.py)
        assert r["modes"] == {"bfloat16/80": "DECODE", "bfloat16/2080": "DEQUANT_CUBLAS", "float32/400": "TILED"}, r["modes"]
    print("fused vs one full GEMM, differing elements:", results[0]["full_gemm_mismatches"])
    print("row-block GEMM modes:", results[0]["modes"], "workspace bytes:", results[0]["capacity"])


def _captured_signature_mismatch() -> None:
    """``always`` under capture: rank 1 captures the GEMM with a weight of other rows than rank
    0's (the collectives still pair up: only the signature differs). The device-side check must
    fail the replay on every rank."""
    rank, group = dist.get_rank(), _group_name()
    device = torch.device("cuda", rank)
    t = _case_inputs(16, 70, device)
    b, sb = (t["b"], t["sb"]) if rank == 0 else _quantized(N + 16, K, 71, device)

    def gemm():
        return ops.fused_all_gather_fp4_matmul(t["a_shard"], t["s_shard"], b, sb, t["alpha"], torch.bfloat16, group)
    os.environ[groups.ENV_CHECK] = "off"
    gemm()  # eager warm-up (kernels compiled outside the capture); nothing checked
    torch.cuda.synchronize()
    os.environ[groups.ENV_CHECK] = "always"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        gemm()
    graph.replay()
    torch.cuda.synchronize()  # raises: device-side assertion


@pytest.mark.multigpu
def test_always_check_fails_a_mismatched_captured_graph_on_every_rank():
    env = {policy.ENV_DISABLE: "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"}
    with pytest.raises(RankError) as info:
        run_on_ranks(_captured_signature_mismatch, 2, backend="nccl", timeout=180, grace=30, env=env)
    failures = info.value.failures
    assert set(failures) == {0, 1}, info.value
    assert all("device-side assert" in text for text in failures.values()), failures


@pytest.mark.cuda
@pytest.mark.parametrize(("out_dtype", "total_rows", "blocks", "n", "k", "mode"), [
    (torch.bfloat16, 40, 2, N, K, "DECODE"),            # activation decoded in the kernel
    (torch.bfloat16, 16, 2, 4104, 4096, "DECODE"),      # 256-element K steps, split-K
    (torch.bfloat16, 80, 2, N, K, "DECODE"),            # activation pre-decoded
    (torch.bfloat16, 250, 5, N, K, "DECODE"),
    (torch.float32, 400, 2, N, K, "TILED"),
    (torch.float16, 300, 3, N, K, "TILED"),
    (torch.bfloat16, 1024, 4, 4096, 256, "HOPPER"),     # sm_90 + Triton 3.6: the Gluon GEMM, into the views
    (torch.float16, 600, 3, 1000, 320, "HOPPER"),
    (torch.bfloat16, 250, 5, 8200, 4096, "HOPPER"),     # up to 256 rows: the whole GEMM's split-K count
])
def test_row_block_gemm_equals_one_mm_fp4_bitwise(out_dtype, total_rows, blocks, n, k, mode):
    """On one GPU, what makes the fused collective GEMMs bitwise equal to the unfused graph: row
    blocks run with the mode and configuration of the whole GEMM give exactly the rows of one
    ``mm_fp4`` over all of them. (DEQUANT_CUBLAS is left out: cuBLAS picks kernels by shape.)"""
    from fp4fuse.ops.collective_gemm import RowBlockGemm
    device = torch.device("cuda")
    if mode == "HOPPER":
        from fp4fuse.kernels.triton import mm as triton_mm
        if not triton_mm.hopper_serves(total_rows, n, k, out_dtype, device):
            pytest.skip("the Hopper Gluon GEMM does not serve this product here (needs sm_90 and Triton 3.6)")
    a, sa = _quantized(total_rows, k, 11, device)
    b, sb = _quantized(n, k, 12, device)
    alpha = (1.0 / (GS * GS)).to(device)
    whole = ops.mm_fp4(a, b, sa, sb, alpha, out_dtype)
    rows = total_rows // blocks
    gemm = RowBlockGemm(b, sb, alpha, out_dtype, rows, total_rows)
    assert gemm.mode.name == mode
    out = torch.full((total_rows, n), float("nan"), dtype=out_dtype, device=device)
    for i in range(blocks):
        gemm(out[i * rows:(i + 1) * rows], a[i * rows:(i + 1) * rows], sa[i * rows:(i + 1) * rows])
    assert torch.equal(out, whole)


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
