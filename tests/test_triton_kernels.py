"""fp4fuse's Triton kernels: under Triton's CPU interpreter, and on CUDA through torch.ops.fp4fuse.

The interpreter checks run tests/triton_interpreter_cases.py in a subprocess per kernel family
(TRITON_INTERPRET must be set before triton is imported); an interpreter process keeps one core
busy, so the families run side by side, one per core. The CUDA checks draw fresh random inputs on
odd shapes and compare with the pure-torch references: quantization bit for bit, GEMMs against
float64.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("triton")

import fp4fuse  # noqa: F401
import nvfp4_oracle as oracle
from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.ops.backend import Backend, backend_for
from fp4fuse.nvfp4.norms import fused_add_rms_norm_reference, rms_norm_reference

ops = torch.ops.fp4fuse
CASES_SCRIPT = os.path.join(os.path.dirname(__file__), "triton_interpreter_cases.py")


#: the kernel families of tests/triton_interpreter_cases.py, longest first (mm_decode takes about a third
#: of their time), the order in which they start
INTERPRETER_FAMILIES = ("mm_decode", "quant", "norm_quant", "mm", "norm")


def _run_interpreter_cases(family: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, CASES_SCRIPT, family], env=env, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def interpreter_runs(request):
    """``start(family)`` -> the Future of that family's subprocess. In one pytest process, the first
    test starts every selected family, as many at a time as there are cores; under pytest-xdist (which
    spreads the tests over workers) a family starts with its own test only."""
    selected = {item.callspec.params["family"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_kernels_under_triton_interpreter"}
    ahead = [] if os.environ.get("PYTEST_XDIST_WORKER") else [f for f in INTERPRETER_FAMILIES if f in selected]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    runs: dict[str, Future] = {}

    def start(family: str) -> Future:
        if family not in runs:
            runs[family] = pool.submit(_run_interpreter_cases, family)
        return runs[family]

    with ThreadPoolExecutor(max_workers=max(1, min(cores, len(INTERPRETER_FAMILIES)))) as pool:
        for family in ahead:
            start(family)
        yield start
        for run in runs.values():
            run.cancel()  # one not yet started when the module ends (its test failed to run) is not run


@pytest.mark.parametrize("family", INTERPRETER_FAMILIES)
def test_kernels_under_triton_interpreter(family, interpreter_runs):
    proc = interpreter_runs(family).result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_fast_launch_key_is_at_least_as_fine_as_tritons_specialization():
    """FastKernel (fp4fuse.kernels.triton.launch) reuses a compiled kernel for arguments with equal
    keys, and Triton compiles one kernel per specialization, so equal keys must mean equal
    specializations. Checked against Triton's own specialization function on ints (1, divisible by
    16 or not, int32 and int64, negative), bools, floats, None and CPU tensors of several dtypes,
    16-byte aligned and not, and TMA descriptors (``_tma_descriptors``); an argument it cannot key (a
    tuple) is refused, so it takes Triton's path."""
    import itertools

    libtriton = pytest.importorskip("triton._C.libtriton")
    if not hasattr(libtriton, "native_specialize_impl"):
        pytest.skip("this Triton has no native_specialize_impl")
    from triton.backends.nvidia.compiler import CUDABackend

    from fp4fuse.kernels.triton.launch import _arg_key

    base = torch.zeros(64, dtype=torch.float32)
    args = [1, 0, 16, 32, 17, -1, -16, 2**31 - 1, 2**31, 2**31 + 16, 2**40 + 3, True, False, 1.0, 1.5, None,
            base, base[1:], base[4:], base[2:], torch.zeros(64, dtype=torch.uint8)[3:],
            torch.zeros(64, dtype=torch.uint8), torch.zeros(8, dtype=torch.bfloat16),
            torch.zeros(8, dtype=torch.float8_e4m3fn)]

    def spec(arg):
        return libtriton.native_specialize_impl(CUDABackend, arg, False, True, True)

    args += _tma_descriptors()
    for x, y in itertools.combinations(args, 2):
        if _arg_key(x) == _arg_key(y):
            assert spec(x) == spec(y), (x, y)
    with pytest.raises(KeyError):
        _arg_key((1, 2))


def _tma_descriptors() -> list:
    """Host-side TMA descriptors (Triton's and, where this Triton has Gluon, Gluon's) over CPU
    tensors, differing in dtype, block shape, layout, padding, tf32 rounding, and in address,
    shape and strides (which Triton does not specialize on)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    u8 = torch.zeros(512, 256, dtype=torch.uint8)
    f16 = torch.zeros(512, 256, dtype=torch.float16)
    f32 = torch.zeros(64, 64, dtype=torch.float32)
    descs = [TensorDescriptor.from_tensor(f16, [128, 32]), TensorDescriptor.from_tensor(f16[:128], [128, 32]),
             TensorDescriptor.from_tensor(u8, [128, 32]), TensorDescriptor.from_tensor(f16[:, 64:], [64, 32])]
    if "round_f32_to_tf32" in TensorDescriptor.__dataclass_fields__:
        descs += [TensorDescriptor(f32, f32.shape, f32.stride(), [32, 32], round_f32_to_tf32=rounded)
                  for rounded in (False, True)]
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    except ImportError:
        return descs
    layout = gl.NVMMASharedLayout.get_default_for
    for t, ty in ((u8, gl.uint8), (f16, gl.float16)):
        for block in ([128, 32], [64, 32], [128, 64]):
            descs += [GluonDescriptor.from_tensor(t, block, layout(block, ty)),
                      GluonDescriptor.from_tensor(t[64:320, 32:], block, layout(block, ty))]
    descs.append(GluonDescriptor.from_tensor(f16, [128, 32], layout([128, 32], gl.float16), padding="nan"))
    return descs


# ---------------------------------------------------------------------------------------- CUDA

def _require_triton_backend():
    if backend_for(torch.empty(0, device="cuda")) is not Backend.TRITON:
        pytest.skip("the CUDA backend here is not fp4fuse's Triton code")


def _blocks(m: int, k: int, gen: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    spread = torch.rand(m, k // 16, generator=gen, device="cuda").pow(4).repeat_interleave(16, 1)
    return (torch.randn(m, k, generator=gen, device="cuda") * spread * 3).to(dtype)


def _quantized_operands(m: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``(a, sa, b, sb, alpha)``: random ``[m, k]`` and ``[n, k]`` operands (``_blocks``) quantized by
    the op with dynamic global scales, and the GEMM's ``alpha = 1 / (gs_a * gs_b)``."""
    xa, xb = _blocks(m, k, gen), _blocks(n, k, gen)
    ga = nvfp4.global_scale_from_amax(xa.float().abs().amax()).reshape(1)
    gb = nvfp4.global_scale_from_amax(xb.float().abs().amax()).reshape(1)
    a, sa = ops.scaled_fp4_quant(xa, ga)
    b, sb = ops.scaled_fp4_quant(xb, gb)
    return a, sa, b, sb, 1.0 / (ga * gb)


@pytest.mark.parametrize("num_sms", [132, 114, 78])
@pytest.mark.parametrize("n,k", [(48, 64), (423, 208), (3072, 4096), (4096, 4096), (8192, 8192), (28672, 4096),
                                 (4096, 14336)])
def test_decode_configuration_is_constant_over_each_row_range(n, k, num_sms):
    """A graph lowered with a dynamic row count launches the configuration of the top of the count's
    range (``mm_decode.config_rows``); it is the eager op's at every count of the range, so the
    compiled graph is bitwise the eager op, only if ``decode_config_for`` gives every count of a
    range that configuration."""
    from fp4fuse.kernels.triton import mm_decode

    low = 1
    for top in mm_decode.DECODE_ROW_RANGES:
        expected = mm_decode.decode_config_for(top, n, k, num_sms)
        changed = [m for m in range(low, top + 1) if mm_decode.decode_config_for(m, n, k, num_sms) != expected]
        assert not changed, (top, changed[:5])
        low = top + 1
    assert low == mm_decode.DECODE_MAX_M + 1


@pytest.mark.parametrize("ns,k", [((2048, 512, 512), 4096), ((7168, 7168), 4096), ((1024, 256, 256), 4096),
                                  ((3584, 3584), 4096), ((4096, 1024, 1024), 4096), ((14336, 14336), 4096)])
def test_grouped_launches_keep_each_products_own_configuration(ns, k):
    """A grouped decode launch runs each product under the configuration its own launch would take
    (split included), at every row count: otherwise grouping sibling GEMMs (the kernel lowering's
    q/k/v and gate/up) would change their bits against the graph without the pass. Llama-3-8B's
    q/k/v and gate/up shards at TP=2 and 4, and TP=1's."""
    from fp4fuse.kernels.triton import mm_decode

    for m in range(1, mm_decode.DECODE_MAX_M + 1):
        own = [mm_decode.decode_config_for(mm_decode.config_rows(m), n, k, 132) for n in ns]
        assert mm_decode.group_configs(m, list(ns), k, 132) in (own, None), m


def test_decode_rule_at_33_to_64_rows_takes_two_32_row_tiles_on_small_launches():
    """33-64 rows: two 32-row tiles of 256-element K steps on weights of fewer than 2**25 elements
    (Llama-3-8B's TP=2 shards, alone and in the grouped q/k/v and gate/up launches); the 64 x 128
    tile of 128-element steps on larger ones. 17-32 rows keep the 32-row tile at every size, and 16
    rows the narrow step on these small weights."""
    from fp4fuse.kernels.triton import mm_decode

    def tile(cfg):
        return cfg.block_m, cfg.block_n, cfg.block_k

    k = 4096
    for m in (33, 40, 64):
        for n in (512, 2048, 3072, 6144):  # q / k / v shards, q/k/v fused, TP=1 q/k/v
            assert tile(mm_decode.decode_config_for(m, n, k)) == (32, 64, 256), (m, n)
        assert tile(mm_decode.decode_config_for(m, 4096, 7168)) == (32, 64, 256), m  # down shard
        assert tile(mm_decode.decode_config_for(m, 14336, k)) == (64, 128, 128), m
        assert tile(mm_decode.decode_config_for(m, 8192, 8192)) == (64, 128, 128), m
        qkv = mm_decode.group_configs(m, [2048, 512, 512], k, 132)
        assert qkv is not None and {tile(c) for c in qkv} == {(32, 64, 256)}, m
        gate_up = mm_decode.group_configs(m, [7168, 7168], k, 132)
        assert gate_up is not None and {tile(c) for c in gate_up} == {(32, 64, 256)}, m
    # the split fills 4 programs per multiprocessor with at least 4 K steps each: the 2048-row q shard
    # at 64 rows has 2 x 32 tiles and 16 K steps of 256 -> min(4 * 132 / 64, 16 / 4) = 4
    assert mm_decode.decode_config_for(64, 2048, k).split_k == 4
    assert tile(mm_decode.decode_config_for(32, 14336, k)) == (32, 64, 256)
    assert mm_decode.decode_config_for(16, 2048, k).block_k == 128  # the narrow step


def test_decode_rule_at_65_to_128_rows_decodes_small_launches_in_the_kernel():
    """65-128 rows: four 32-row tiles with the activation decoded in the kernel on weights of at most
    2**23 elements (Llama-3-8B's TP=2 q, k/v and o shards, alone and in the grouped q/k/v launch);
    the pre-decoded 128 x 64 tile on larger ones (the 3072 x 4096 fused q/k/v shard, gate/up, down)
    and from 129 rows on every size."""
    from fp4fuse.kernels.triton import mm_decode

    def tile(cfg):
        return cfg.block_m, cfg.block_n, cfg.block_k, cfg.predecode

    in_kernel, pre_decoded = (32, 64, 256, False), (128, 64, 128, True)
    for m in (65, 100, 128):
        for n, k in ((2048, 4096), (512, 4096), (4096, 2048), (48, 64)):
            assert tile(mm_decode.decode_config_for(m, n, k)) == in_kernel, (m, n, k)
        for n, k in ((3072, 4096), (14336, 4096), (4096, 7168), (8192, 8192)):
            assert tile(mm_decode.decode_config_for(m, n, k)) == pre_decoded, (m, n, k)
        qkv = mm_decode.group_configs(m, [2048, 512, 512], 4096, 132)
        assert qkv is not None and {tile(c) for c in qkv} == {in_kernel}, m
        gate_up = mm_decode.group_configs(m, [7168, 7168], 4096, 132)
        assert gate_up is not None and {tile(c) for c in gate_up} == {pre_decoded}, m
    for m in (129, 200, 256):
        assert tile(mm_decode.decode_config_for(m, 512, 4096)) == pre_decoded, m
    # the split fills 4 programs per multiprocessor with at least 4 K steps of 256 each, counted at the
    # range's 128 rows: the o shard (4096 x 2048) has 4 x 64 tiles and 8 K steps -> min(4 * 132 / 256,
    # 8 / 4) = 2; the k/v shard 4 x 8 tiles and 16 K steps -> min(528 / 32, 16 / 4) = 4
    assert mm_decode.decode_config_for(100, 4096, 2048).split_k == 2
    assert mm_decode.decode_config_for(65, 512, 4096).split_k == 4


def test_quant_launch_rule_for_cuda_caps_its_programs_and_guards_no_dynamic_batch(monkeypatch):
    """The CUDA launch of the quantization: one program per 256-block chunk up to 16 programs per
    multiprocessor, then several chunks a program; for a traced launch with a dynamic batch the
    grid stays a symbolic ``min`` of the two, with no guard on the batch (runs on CPU: only the
    launch rule, no kernel)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fp4fuse.kernels.triton import quant

    monkeypatch.setattr(quant, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert quant.quant_launch_config(1000, cuda) == (256, 8, 4)
    assert quant.quant_launch_config(256 * 2112 + 1, cuda) == (256, 8, 2112)
    shape_env = ShapeEnv()
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = FakeTensorMode(shape_env=shape_env).from_tensor(torch.empty(100, 64), symbolic_context=ctx)
    blocks, warps, programs = quant.quant_launch_config(x.shape[0] * 4, cuda)  # 4 blocks of 16 a row
    assert (blocks, warps) == (256, 8) and isinstance(programs, torch.SymInt)
    assert not shape_env.guards
    rows = x.shape[0].node.expr
    assert int(programs.node.expr.subs(rows, 100)) == 2 and int(programs.node.expr.subs(rows, 10**6)) == 2112


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 16), (3, 48), (130, 1040), (7, 4112), (1000, 4096), (4099, 512)])
def test_cuda_quant_bit_equal(dtype, m, k):
    _require_triton_backend()
    from fp4fuse.kernels.triton.quant import QuantDivision, scaled_fp4_quant_triton
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + k)
    x = _blocks(m, k, gen, dtype)
    x[0, 0] = float("nan")
    x[-1, -1] = float("-inf")
    if m > 2:
        x[1, :16] = 0
        x[2, 16:32] *= 1e-6
    gs = nvfp4.global_scale_from_amax(x.float().nan_to_num(0, 0, 0).abs().amax()).reshape(1)
    rq, rs = nvfp4.quantize_reference(x.cpu(), gs.cpu())
    q, s = ops.scaled_fp4_quant(x, gs)
    assert q.is_cuda and q.shape == (m, k // 2) and s.shape == (m, k // 16)
    assert torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8))
    assert torch.equal(q.cpu(), rq)
    for div in QuantDivision:
        q2, s2 = scaled_fp4_quant_triton(x, gs, division=div)
        assert torch.equal(q2, q) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8)), div


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k", [(3, 48), (130, 1040), (1000, 4096)])
def test_cuda_quant_group_bit_equal(dtype, m, k):
    """One input under 2, 3 and 4 global scales (launches of 3 and 1), a NaN scale among them: each
    output the CPU reference quantizer's under its own scale."""
    _require_triton_backend()
    from fp4fuse.kernels.triton.quant import scaled_fp4_quant_group_triton
    gen = torch.Generator(device="cuda").manual_seed(m * 5 + k)
    x = _blocks(m, k, gen, dtype)
    x[0, 1] = float("nan")
    x[-1, -2] = float("inf")
    amax = x.float().nan_to_num(0, 0, 0).abs().amax()
    scales = [nvfp4.global_scale_from_amax(amax * f).reshape(1) for f in (1.0, 0.3, 3.7)]
    scales.append(torch.full((1,), float("nan"), device="cuda"))
    refs = [nvfp4.quantize_reference(x.cpu(), gs.cpu()) for gs in scales]
    for count in (2, 3, 4):
        got = scaled_fp4_quant_group_triton(x, scales[:count])
        for (q, s), (rq, rs), gs in zip(got, refs, scales):
            assert torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8)), (count, gs.item())
            assert torch.equal(q.cpu(), rq), (count, gs.item())


@pytest.mark.cuda
@pytest.mark.parametrize("m", [5, 20, 100, 200])
def test_cuda_decode_products_with_own_activations_equal_their_own_launches(m):
    """q/k/v-shaped products, each on its own quantization of one input (static scales): one
    grouped launch (the activations decoded in the kernel, or pre-decoded in one launch above 64
    rows), each output bitwise its own ``mm_fp4_decode`` call, call after call."""
    _require_triton_backend()
    from fp4fuse.kernels.triton import mm_decode
    gen = torch.Generator(device="cuda").manual_seed(m)
    k = 4096
    x = _blocks(m, k, gen, torch.bfloat16)
    amax = x.float().abs().amax()
    products = []
    for i, n in enumerate((2048, 512, 512)):
        ga = nvfp4.global_scale_from_amax(amax * (1 + 0.5 * i)).reshape(1)
        a, sa = ops.scaled_fp4_quant(x, ga)
        w = _blocks(n, k, gen, torch.bfloat16)
        gb = nvfp4.global_scale_from_amax(w.float().abs().amax()).reshape(1)
        b, sb = ops.scaled_fp4_quant(w, gb)
        products.append(mm_decode.DecodeProduct(a, sa, b, sb, torch.reciprocal(ga * gb)))
    want = [mm_decode.mm_fp4_decode(p.a, p.b, p.a_scale, p.b_scale, p.alpha, torch.bfloat16) for p in products]
    for _ in range(2):
        got = mm_decode.mm_fp4_decode_products(products, torch.bfloat16)
        for g, w in zip(got, want):
            assert torch.equal(g, w), m


@pytest.mark.cuda
@pytest.mark.parametrize("value", [0.0, -0.0, -2.5, float("inf"), float("-inf"), float("nan"), 1e30])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_quant_global_scale_rules(value, dtype):
    """A global scale outside (0, inf) poisons every block (scale 0x7F, codes 0); 1e30 saturates.
    Checked with the independent oracle (tests/nvfp4_oracle.py), on the op and on every division."""
    _require_triton_backend()
    from fp4fuse.kernels.triton.quant import QuantDivision, scaled_fp4_quant_triton
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = _blocks(37, 208, gen, dtype)
    x[2, 16:32] = 0
    gs = torch.tensor([value], device="cuda")
    results = [ops.scaled_fp4_quant(x, gs)] + [scaled_fp4_quant_triton(x, gs, division=d) for d in QuantDivision]
    for q, s in results:
        if value == 1e30:
            oracle.assert_quantized_by_the_rules(x.cpu(), value, q.cpu(), s.cpu())
        else:
            assert bool((oracle.scale_bits(s.cpu()) == oracle.E4M3_NAN_BITS).all()) and bool((q == 0).all())


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(0, 5, 32), (4, 0, 32), (0, 0, 48), (3, 5, 0), (300, 0, 64), (0, 300, 64)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cuda_empty_operands(m, n, k, out_dtype):
    """M = 0 or N = 0: the empty [M, N]; K = 0: alpha * 0 (an empty sum: -0 for a negative alpha,
    NaN for a non-finite one), as the float64 reference gives it. Through the op and through the
    Triton launcher directly (what a lowered graph traces)."""
    _require_triton_backend()
    from fp4fuse.kernels.triton.mm import mm_fp4_triton
    gs = torch.tensor([2.0], device="cuda")
    a, sa = ops.scaled_fp4_quant(torch.randn(m, k, device="cuda") + 0.5, gs)
    b, sb = ops.scaled_fp4_quant(torch.randn(n, k, device="cuda") + 0.5, gs)
    assert a.shape == (m, k // 2) and sa.shape == (m, k // 16) and a.is_cuda
    for value in (0.3, -0.3, float("inf"), float("nan")):
        alpha = torch.tensor([value], device="cuda")
        ref = nvfp4.mm_fp4_reference(a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), alpha.cpu(), out_dtype)
        for out in (ops.mm_fp4(a, b, sa, sb, alpha, out_dtype), mm_fp4_triton(a, b, sa, sb, alpha, out_dtype)):
            assert out.is_cuda and out.dtype == out_dtype and out.shape == (m, n)
            got = out.cpu()
            assert torch.equal(got.isnan(), ref.isnan()), (value, got, ref)
            assert torch.equal(torch.signbit(got[~ref.isnan()]), torch.signbit(ref[~ref.isnan()])), (value, got, ref)
            assert torch.equal(got[~ref.isnan()], ref[~ref.isnan()]), (value, got, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("gs", [float("nan"), float("inf"), 1e36, 1e-36, 3.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_quant_special_global_scales(gs, dtype):
    """NaN / infinite / huge / tiny global scales, signed zeros and infinities: every division mode
    bit-equal to the reference (with gs = inf, 0 * inf is a NaN quotient: code +0)."""
    _require_triton_backend()
    from fp4fuse.kernels.triton.quant import QuantDivision, scaled_fp4_quant_triton
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = _blocks(130, 1040, gen, dtype)
    x[0, :16] = -0.0
    x[1, 3] = float("-inf")
    x[2, 7] = float("nan")
    x[3, 16:32] = 0.0
    x[3, 17] = -0.0
    gs_t = torch.tensor([gs], device="cuda")
    rq, rs = nvfp4.quantize_reference(x.cpu(), gs_t.cpu())
    for div in QuantDivision:
        q, s = scaled_fp4_quant_triton(x, gs_t, division=div)
        assert torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8)), div
        assert torch.equal(q.cpu(), rq), div


@pytest.mark.cuda
@pytest.mark.parametrize("log2_gs", [126, 127])
def test_cuda_quant_subnormal_block_amaxes(log2_gs):
    """Blocks whose amax is an fp32 subnormal or in the lowest normal binades (``amax / 6`` in or
    near the subnormal range), with a global scale large enough that their block scales are live
    e4m3 values: bit-equal to the reference."""
    _require_triton_backend()
    from fp4fuse.kernels.triton.quant import scaled_fp4_quant_triton
    gen = torch.Generator().manual_seed(log2_gs)
    exponent = torch.randint(-149, -118, (96, 7, 1), generator=gen).float()
    x = (torch.rand(96, 7, 16, generator=gen) * 2 - 1) * torch.exp2(exponent)
    x = x.reshape(96, 112)
    gs = torch.tensor([2.0 ** log2_gs])
    rq, rs = nvfp4.quantize_reference(x, gs)
    assert bool((rs.float() > 0).any()), "no live block scale: the test would not see the division"
    q, s = scaled_fp4_quant_triton(x.cuda(), gs.cuda())
    assert torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8))
    assert torch.equal(q.cpu(), rq)


@pytest.mark.cuda
@pytest.mark.parametrize("config", [(128, 4, 3), (256, 4, 1000), (256, 8, 5), (512, 8, 7), (512, 4, 7)])
def test_cuda_quant_launch_configs(config):
    """Two blocks per thread, persistent grids (several chunks a program), a partial last chunk;
    more than MAX_BLOCKS_PER_THREAD blocks per thread is refused (FMA_SAT was wrong at 4)."""
    _require_triton_backend()
    from fp4fuse.kernels.triton.quant import MAX_BLOCKS_PER_THREAD, QuantDivision, scaled_fp4_quant_triton
    gen = torch.Generator(device="cuda").manual_seed(sum(config))
    x = _blocks(4099, 528, gen)
    gs = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    if config[0] > MAX_BLOCKS_PER_THREAD * 32 * config[1]:
        with pytest.raises(ValueError, match="blocks; at most"):
            scaled_fp4_quant_triton(x, gs, config=config)
        return
    rq, rs = nvfp4.quantize_reference(x.cpu(), gs.cpu())
    for div in QuantDivision:
        q, s = scaled_fp4_quant_triton(x, gs, division=div, config=config)
        assert torch.equal(q.cpu(), rq) and torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8)), div


@pytest.mark.cuda
@pytest.mark.parametrize("mant", range(8))
@pytest.mark.parametrize("division", ["IEEE_DIV", "FMA_SAT"])
def test_cuda_quant_every_mantissa_near_every_boundary(mant, division):
    """Block scale s = (8 + mant) / 8 (amax 6 s, gs 1); the other 15 elements of each block run
    through every fp32 mantissa of [s/8, 6 s]: codes equal RNE of the IEEE quotient x / s."""
    _require_triton_backend()
    from fp4fuse.kernels.triton.quant import QuantDivision, scaled_fp4_quant_triton
    s = (8 + mant) / 8
    bits = torch.arange(1 << 23, dtype=torch.int32, device="cuda")
    y = torch.cat([(bits | ((127 + e) << 23)).view(torch.float32) for e in range(-3, 3)]) * s
    y = y.clamp(max=6 * s)
    y = y[: y.numel() // 15 * 15].reshape(-1, 15)
    x = torch.cat([torch.full((y.shape[0], 1), 6 * s, device="cuda"), y], dim=1)
    q, sc = scaled_fp4_quant_triton(x, torch.tensor([1.0], device="cuda"), division=QuantDivision[division])
    assert torch.all(sc.float() == s)
    # tensor / tensor: torch's CUDA division by a Python scalar multiplies by its reciprocal
    assert torch.equal(nvfp4.unpack_nibbles(q), nvfp4.e2m1_encode(x / torch.full_like(x, s)))


@pytest.mark.cuda
@pytest.mark.parametrize("division", ["IEEE_DIV", "FMA_SAT"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_quant_sass_counts(division, dtype):
    """The SASS counter finds the kernel's loop (what bench_ops.py reports)."""
    _require_triton_backend()
    from fp4fuse.kernels.triton.quant import QuantDivision, quant_sass_counts
    counts = quant_sass_counts(QuantDivision[division], dtype)
    assert 0 < counts["loop"] <= counts["total"]
    assert 8 < counts["loop_per_element"] < 60


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(1, 4096, 8192), (3, 423, 208), (16, 8192, 512), (64, 1000, 1024),
                                   (100, 37, 1024), (130, 37, 1024), (257, 300, 48), (1000, 64, 256),
                                   (2048, 256, 512)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_mm_fp4_matches_float64(m, n, k, out_dtype):
    _require_triton_backend()
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    a, sa, b, sb, alpha = _quantized_operands(m, n, k, gen)
    out = ops.mm_fp4(a, b, sa, sb, alpha, out_dtype)
    ref = nvfp4.mm_fp4_reference(a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), alpha.cpu(), torch.float64)
    rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[out_dtype]
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert torch.isfinite(out).all()
    assert rel <= tol, rel


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(1, 3072, 4096), (3, 423, 208), (16, 8192, 1040), (17, 200, 48),
                                   (64, 1000, 1024), (45, 2056, 1040), (128, 4096, 7168), (5, 4104, 8208),
                                   (20, 2056, 8208), (100, 2056, 1040), (128, 4096, 2048)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_mm_fp4_decode_matches_float64(m, n, k, out_dtype):
    """The one-launch decode GEMM (default config and a 3-way split that does not divide the K
    steps) against float64; bitwise repeatable; counters back to zero; a NaN scale poisons its row.
    5 x 4104 x 8208 and 20 x 2056 x 8208: the default's 256-element K steps
    (mm_decode.wide_step_config) with a partial last step and a partial weight tile; 100 x 2056 x
    1040 and 128 x 4096 x 2048: the in-kernel decode of 65-128 rows on small weights (four 32-row
    tiles, mm_decode.wide_step_config), with and without a partial last step."""
    _require_triton_backend()
    from fp4fuse.kernels.triton import mm_decode
    gen = torch.Generator(device="cuda").manual_seed(m * 31 + n + k)
    a, sa, b, sb, alpha = _quantized_operands(m, n, k, gen)
    ref = nvfp4.mm_fp4_reference(a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), alpha.cpu(), torch.float64)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[out_dtype]
    split3 = mm_decode.DecodeConfig(block_m=16 if m <= 16 else 64, block_n=128, block_k=128, split_k=3,
                                    num_warps=4, num_stages=3)
    predecoded = dataclasses.replace(split3, block_m=128 if m > 64 else split3.block_m, num_warps=8 if m > 64 else 4,
                                     predecode=True)
    for cfg in (None, split3, predecoded):
        ws = None
        if cfg is not None:
            ws = mm_decode.empty_decode_workspace(*mm_decode.decode_workspace_numel(m, n, k, cfg), a.device)
        out = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, out_dtype, cfg, workspace=ws)
        again = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, out_dtype, cfg, workspace=ws)
        rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        assert out.dtype == out_dtype and out.shape == (m, n)
        assert torch.isfinite(out).all()
        assert rel <= tol, (cfg, rel)
        assert torch.equal(out, again), cfg
        if ws is not None:
            assert not ws.counters.any()
    # the pre-decoded activation feeds the same products in the same order as the in-kernel decode
    in_kernel = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, out_dtype, dataclasses.replace(predecoded, predecode=False))
    assert torch.equal(mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, out_dtype, predecoded), in_kernel)
    if m > 1:
        sa_nan = sa.clone()
        sa_nan.view(torch.uint8)[1, k // 32] = 0x7F
        out = mm_decode.mm_fp4_decode(a, b, sa_nan, sb, alpha, out_dtype, split3)
        assert torch.isnan(out[1]).all()
        assert torch.isfinite(out[0]).all() and torch.isfinite(out[2:]).all()


@pytest.mark.cuda
@pytest.mark.parametrize("m", [5, 16, 32])
def test_cuda_decode_scale_words_equal_byte_loads(m):
    """K/16 a multiple of 4: the activation's block scales load as int32 words (pipelined) in the
    default configuration and the narrow-step one, both with ``scale_words``; a copy of them 1 byte
    off a word boundary takes the byte loads. Same bits both ways, and the float64 reference; a NaN
    scale stays in its row."""
    _require_triton_backend()
    from fp4fuse.kernels.triton import mm_decode
    n, k = 1000, 2048
    gen = torch.Generator(device="cuda").manual_seed(m)
    a, sa, b, sb, alpha = _quantized_operands(m, n, k, gen)
    shifted = torch.empty(sa.numel() + 1, dtype=torch.uint8, device="cuda")[1:].view(sa.shape)
    shifted.copy_(sa.view(torch.uint8))
    shifted = shifted.view(torch.float8_e4m3fn)
    assert sa.data_ptr() % 4 == 0 and shifted.data_ptr() % 4 != 0
    ref = nvfp4.mm_fp4_reference(a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), alpha.cpu(), torch.float64)
    for cfg in (mm_decode.decode_config_for(m, n, k), mm_decode.narrow_step_config(m, n, k)):
        cfg = dataclasses.replace(cfg, scale_words=True)
        words = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.float32, cfg)
        assert torch.equal(words, mm_decode.mm_fp4_decode(a, b, shifted, sb, alpha, torch.float32, cfg)), cfg
        rel = ((words.double().cpu() - ref).norm() / ref.norm()).item()
        assert rel <= 1e-5, (cfg, rel)
        sa_nan = sa.clone()
        sa_nan.view(torch.uint8)[m // 2, 77] = 0x7F
        out = mm_decode.mm_fp4_decode(a, b, sa_nan, sb, alpha, torch.bfloat16, cfg)
        assert torch.isnan(out[m // 2]).all()
        assert torch.isfinite(out[: m // 2]).all() and torch.isfinite(out[m // 2 + 1:]).all()


@pytest.mark.cuda
def test_cuda_fast_launch_reuses_only_the_kernel_triton_would_pick():
    """FastKernel (fp4fuse.kernels.triton.launch) against Triton's own dispatch, on a kernel that
    Triton specializes on pointer alignment and integer divisibility: for aligned and misaligned
    pointers, ints 1, 16, 17 and 2**31 + 16, each launch gives the right values, a repeated launch is
    served from the cache, and the cached launcher is the one ``kernel[grid]`` returns for those
    arguments."""
    import triton
    import triton.language as tl
    from fp4fuse.kernels.triton.launch import FastKernel, _arg_key

    @triton.jit
    def add_kernel(x_ptr, out_ptr, n, shift, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + (shift % 1000), mask=mask)

    fast = FastKernel(add_kernel)
    base = torch.randn(4096 + 8, device="cuda", dtype=torch.float32)
    for offset in (0, 1, 4, 0):
        for n, shift in ((4096, 1), (4095, 16), (4096, 17), (33, 2**31 + 16)):
            x = base[offset:offset + n]
            out = torch.full((n + 1,), float("nan"), device="cuda")[offset % 2:][:n]
            for _ in range(2):
                out.fill_(float("nan"))
                fast[(triton.cdiv(n, 256),)](x, out, n, shift, BLOCK=256, num_warps=4)
                torch.testing.assert_close(out, x + (shift % 1000), rtol=0, atol=0)
            key = (torch.cuda.current_device(), (("BLOCK", 256), ("num_warps", 4)),
                   *(_arg_key(v) for v in (x, out, n, shift)))
            assert key in fast.cache
            compiled = add_kernel[(triton.cdiv(n, 256),)](x, out, n, shift, BLOCK=256, num_warps=4)
            assert fast.cache[key][0] is compiled.run and fast.cache[key][1] == compiled.function
    # the aligned and the misaligned pointers did get kernels of their own
    assert len({entry[1] for entry in fast.cache.values()}) > 1


@pytest.mark.cuda
def test_cuda_relaunch_repeats_a_launch_with_other_tensors():
    """``FastKernel.prepare`` (fp4fuse.kernels.triton.launch) launches and returns a ``Relaunch``
    that repeats the launch with other tensors in the tensors' places, on a kernel that reads
    through a host-side TMA descriptor (encoded once: its tensor's values may change, not its
    address) and through pointers: each relaunch gives its own inputs' result."""
    _require_triton_backend()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("host-side TMA descriptors need sm_90")
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fp4fuse.kernels.triton.launch import FastKernel

    @triton.jit
    def add_rows_kernel(x_desc, y_ptr, out_ptr, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0) * BLOCK_M
        rows = row + tl.arange(0, BLOCK_M)[:, None]
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = (rows < n) & (cols < BLOCK_N)
        x = x_desc.load([row, 0])
        tl.store(out_ptr + rows * BLOCK_N + cols, x + tl.load(y_ptr + rows * BLOCK_N + cols, mask=mask), mask=mask)

    n, width = 300, 32
    x = torch.randn(n, width, device="cuda")
    fast = FastKernel(add_rows_kernel)
    relaunch = None

    def launch(y, out):
        nonlocal relaunch
        args = (TensorDescriptor.from_tensor(x, [32, width]), y, out, n)
        if relaunch is None:
            relaunch = fast.prepare((triton.cdiv(n, 32),), *args, BLOCK_M=32, BLOCK_N=width, num_warps=4)
            assert relaunch is not None and len(relaunch.slots) == 2  # y and out
        else:
            relaunch(y, out)

    for step in range(3):
        x.copy_(torch.randn(n, width, device="cuda"))
        y = torch.randn(n, width, device="cuda")
        out = torch.full((n, width), float("nan"), device="cuda")
        launch(y, out)
        assert torch.equal(out, x + y), step
    with pytest.raises(ValueError):
        relaunch(y)  # a tensor short


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 5), (130, 4099), (1000, 2047)])
def test_cuda_scale_by_alpha_is_the_rounded_fp32_product(dtype, shape):
    """The alpha epilogue of the dequantize + cuBLAS path: ``x.dtype(fp32(x) * alpha)``, alpha not
    rounded to ``x.dtype`` first (PyTorch's ``x.mul_(alpha)`` with a CUDA 0-dim alpha rounds it)."""
    _require_triton_backend()
    from fp4fuse.kernels.triton import mm as triton_mm
    gen = torch.Generator(device="cuda").manual_seed(shape[1])
    x = (torch.randn(shape, generator=gen, device="cuda") * 300).to(dtype)
    x[0, 0] = float("inf")
    alpha = torch.rand(1, generator=gen, device="cuda") * 1e-3 + 1e-4
    got = triton_mm.scale_by_alpha_(x.clone(), alpha)
    assert torch.equal(got, (x.float() * alpha).to(dtype))
    with pytest.raises(ValueError, match="contiguous"):
        triton_mm.scale_by_alpha_(torch.ones(4, 6, device="cuda", dtype=dtype).t(), alpha)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("world", [3, 4, 8])
def test_cuda_sum_partials_in_order_is_bitwise_the_ordered_fp32_sum(dtype, world):
    _require_triton_backend()
    from fp4fuse.kernels.triton import reduce as triton_reduce
    gen = torch.Generator(device="cuda").manual_seed(world)
    parts = (torch.randn(world, 130, 4099, generator=gen, device="cuda") * 1e3).to(dtype)
    expected = parts[0].float()
    for p in parts[1:]:
        expected = expected + p.float()
    assert torch.equal(triton_reduce.sum_partials_in_order(parts), expected.to(dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("m", [5, 2048])
def test_cuda_mm_fp4_nan_scale_propagates(m):
    _require_triton_backend()
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = _blocks(m, 256, gen)
    x[1, 40] = float("nan")
    w = _blocks(48, 256, gen)
    gs = torch.tensor([7.0], device="cuda")
    a, sa = ops.scaled_fp4_quant(x, gs)
    b, sb = ops.scaled_fp4_quant(w, gs)
    out = ops.mm_fp4(a, b, sa, sb, 1.0 / (gs * gs), torch.bfloat16)
    assert torch.isnan(out[1]).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2:]).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,h", [(1, 16), (7, 4096), (33, 5120), (3, 20000)])
def test_cuda_norms(dtype, t, h):
    _require_triton_backend()
    gen = torch.Generator(device="cuda").manual_seed(t * h)
    x = torch.randn(t, h, generator=gen, device="cuda").to(dtype)
    r = torch.randn(t, h, generator=gen, device="cuda").to(dtype)
    w = (torch.rand(h, generator=gen, device="cuda") + 0.5).to(dtype)
    eps = 1e-6
    # one unit in the last place of the output dtype; fp32 sums rows in another order than torch
    ulp = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5

    def close(out, ref):
        return bool(((out.float() - ref.float()).abs() <= ulp * ref.float().abs() + 1e-30).all())

    assert close(ops.rms_norm(x, w, eps), rms_norm_reference(x, w, eps))
    out, res = ops.fused_add_rms_norm(x, r, w, eps)
    ref_out, ref_res = fused_add_rms_norm_reference(x, r, w, eps)
    assert torch.equal(res, ref_res)
    assert close(out, ref_out)


def _norm_inputs(t: int, h: int, dtype, gen, misaligned: bool = False):
    spread = torch.rand(t, h // 16, generator=gen, device="cuda").pow(3).repeat_interleave(16, 1) + 1e-3
    n = t * h
    offset = 8 // torch.empty((), dtype=dtype).element_size() if misaligned else 0  # 8 bytes off 16-byte alignment
    buf = torch.empty(n + offset, device="cuda", dtype=dtype)
    x = buf[offset:].view(t, h)
    x.copy_(torch.randn(t, h, generator=gen, device="cuda") * spread * 4)
    r = torch.randn(t, h, generator=gen, device="cuda").to(dtype)
    w = (torch.rand(h, generator=gen, device="cuda") + 0.5).to(dtype)
    x[0, :16] = 0.0
    x[0, 3] = -0.0
    return x, r, w


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,h", [(1, 16), (2, 32), (3, 48), (5, 112), (4, 208), (7, 272), (9, 784), (130, 1040),
                                 (6, 2064), (7, 4112), (33, 5120), (129, 8192), (3, 12288), (3, 20000)])
@pytest.mark.parametrize("misaligned", [False, True])
def test_cuda_norm_quant_bit_equal_to_unfused(dtype, t, h, misaligned):
    """Fused RMSNorm + quantize (with and without the residual add) == the Triton norm kernel followed
    by the Triton quantization kernel, and == the reference quantizer on that norm output, bit for
    bit; residual_out == the reference sum; the norm output within one ulp of the reference.

    The hidden sizes give every launch variant of ``norm_launch_config`` (BLOCK 16 .. 16384 and the
    two-pass chunks), each dtype, with and without 16-byte alignment: a miscompiled variant gives
    wrong codes whatever the data (as fp32 spans of 4-element rows did at 4 warps and more)."""
    _require_triton_backend()
    from fp4fuse.kernels.triton import norm as triton_norm, norm_quant as triton_norm_quant
    from fp4fuse.kernels.triton.quant import scaled_fp4_quant_triton
    gen = torch.Generator(device="cuda").manual_seed(t * h + misaligned)
    x, r, w = _norm_inputs(t, h, dtype, gen, misaligned)
    eps = 1e-6
    ref_out = rms_norm_reference(x, w, eps)
    gs = nvfp4.global_scale_from_amax(ref_out.float().abs().amax()).reshape(1)
    ulp = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5

    out = triton_norm.rms_norm_triton(x, w, eps)
    assert bool(((out.float() - ref_out.float()).abs() <= ulp * ref_out.float().abs() + 1e-30).all())
    q, s = triton_norm_quant.rms_norm_fp4_quant_triton(x, w, eps, gs)
    q2, s2 = scaled_fp4_quant_triton(out, gs)
    assert torch.equal(q, q2) and torch.equal(s.view(torch.uint8), s2.view(torch.uint8))
    rq, rs = nvfp4.quantize_reference(out.cpu(), gs.cpu())
    assert torch.equal(q.cpu(), rq) and torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8))

    out, res = triton_norm.fused_add_rms_norm_triton(x, r, w, eps)
    q, s, res_out = triton_norm_quant.fused_add_rms_norm_fp4_quant_triton(x, r, w, eps, gs)
    _, ref_res = fused_add_rms_norm_reference(x, r, w, eps)
    assert torch.equal(res_out, res) and torch.equal(res_out, ref_res)
    q2, s2 = scaled_fp4_quant_triton(out, gs)
    assert torch.equal(q, q2) and torch.equal(s.view(torch.uint8), s2.view(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("gs", [float("nan"), float("inf"), 1e36, 1e-36])
def test_cuda_norm_quant_special_global_scales(gs):
    _require_triton_backend()
    from fp4fuse.kernels.triton import norm as triton_norm, norm_quant as triton_norm_quant
    gen = torch.Generator(device="cuda").manual_seed(11)
    x, r, w = _norm_inputs(65, 2064, torch.bfloat16, gen)
    gs_t = torch.tensor([gs], device="cuda")
    q, s, _ = triton_norm_quant.fused_add_rms_norm_fp4_quant_triton(x, r, w, 1e-6, gs_t)
    out, _ = triton_norm.fused_add_rms_norm_triton(x, r, w, 1e-6)
    rq, rs = nvfp4.quantize_reference(out.cpu(), gs_t.cpu())
    assert torch.equal(q.cpu(), rq) and torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,h", [(3, 48), (130, 1040), (33, 5120), (3, 20000)])
def test_cuda_norm_amax(dtype, t, h):
    """Norm + amax: the same output as the plain norm kernel, amax = max |out| (NaN propagates)."""
    _require_triton_backend()
    from fp4fuse.kernels.triton import norm as triton_norm
    gen = torch.Generator(device="cuda").manual_seed(t + h)
    x, r, w = _norm_inputs(t, h, dtype, gen)
    out, amax = triton_norm.rms_norm_amax_triton(x, w, 1e-6)
    assert torch.equal(out, triton_norm.rms_norm_triton(x, w, 1e-6))
    assert torch.equal(amax, out.float().abs().amax().reshape(1))
    out, res, amax = triton_norm.fused_add_rms_norm_amax_triton(x, r, w, 1e-6)
    ref_out, ref_res = triton_norm.fused_add_rms_norm_triton(x, r, w, 1e-6)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
    assert torch.equal(amax, out.float().abs().amax().reshape(1))
    x[t // 2, h // 3] = float("nan")
    assert torch.isnan(triton_norm.rms_norm_amax_triton(x, w, 1e-6)[1]).all()


@pytest.mark.cuda
@pytest.mark.multigpu
def test_cuda_ops_run_on_their_inputs_device_not_the_current_one():
    """Inputs on cuda:1 while cuda:0 is current (one process over several GPUs, e.g. Hugging Face
    ``device_map="auto"``): every op runs on cuda:1's stream, so a consumer there sees the finished
    result. Launched on cuda:0's (here kept busy), the outputs were read before they were written.
    Expected values: the oracle (quantization) and the same op with its inputs on the current GPU."""
    _require_triton_backend()
    torch.cuda.set_device(0)
    torch.ones(1, device="cuda:0").to("cuda:1")  # peer access on: a launch on the wrong GPU would run
    torch.ones(1, device="cuda:1").to("cuda:0")
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(512, 1024, generator=gen) * 3).to(torch.bfloat16)
    r = torch.randn(512, 1024, generator=gen).to(torch.bfloat16)
    w = torch.rand(1024, generator=gen) + 0.5
    gs = torch.tensor([100.0])
    eps = 1e-6
    bq, bs = ops.scaled_fp4_quant(x[:64].cuda(), gs.cuda())
    alpha = torch.tensor([0.25])

    def calls(xd, rd, wd, gsd, bqd, bsd, ad):
        q, s = ops.scaled_fp4_quant(xd, gsd)
        return {
            "quant": (q, s),
            "mm_fp4": (ops.mm_fp4(q, bqd, s, bsd, ad, torch.bfloat16),),
            "rms_norm": (ops.rms_norm(xd, wd, eps),),
            "fused_add_rms_norm": ops.fused_add_rms_norm(xd, rd, wd, eps),
            "rms_norm_fp4_quant": ops.rms_norm_fp4_quant(xd, wd, eps, gsd),
            "fused_add_rms_norm_fp4_quant": ops.fused_add_rms_norm_fp4_quant(xd, rd, wd, eps, gsd),
        }

    inputs = (x, r, w, gs, bq, bs, alpha)
    want = {name: [t.cpu() for t in outs] for name, outs in calls(*(t.to("cuda:0") for t in inputs)).items()}
    on_1 = [t.to("cuda:1") for t in inputs]  # before the sleep: a copy from cuda:0 would wait for it
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    torch.cuda._sleep(2_000_000_000)  # cuda:0's stream busy for about a second
    got = {name: [t.cpu() for t in outs] for name, outs in calls(*on_1).items()}  # copies on cuda:1's stream
    torch.cuda.synchronize(0)
    oracle.assert_quantized_by_the_rules(x, gs, *got["quant"])
    for name, outs in got.items():
        for out, ref in zip(outs, want[name]):
            assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), name


@pytest.mark.cuda
def test_cuda_offsets_past_int32_read_their_own_operand():
    """A weight of more than 2**31 code bytes (tiled GEMM) and ``W * n`` partials past 2**31 elements
    (ordered sum): the kernels' offsets were int32 products, which wrapped, so the last weight rows /
    the last partial were read 2**32 elements early. Each operand sits right after a poisoned
    prefix (a wrapped read lands there and gives other values). Expected: the oracle / fp32 sums.
    About 11 GB of GPU memory; reproduced on the interpreter by triton_interpreter_cases.py mm."""
    _require_triton_backend()
    from fp4fuse.kernels.triton import mm as triton_mm, reduce as triton_reduce
    gen = torch.Generator().manual_seed(31)
    prefix = 1 << 31
    m, n, kb = 16, 128, (1 << 24) + (1 << 20)  # weight rows from 121 on start past 2**31 code bytes
    big = torch.full((prefix + n * kb,), 0x77, dtype=torch.uint8, device="cuda")  # 0x77: codes (6, 6)
    b = big[prefix:].view(n, kb)
    b.zero_()
    a = torch.zeros(m, kb, dtype=torch.uint8, device="cuda")
    a_head = torch.randint(0, 256, (m, 64), generator=gen, dtype=torch.uint8)
    b_head = torch.randint(0, 256, (n, 64), generator=gen, dtype=torch.uint8)
    a[:, :64], b[:, :64] = a_head.cuda(), b_head.cuda()
    one = torch.full((1,), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)  # e4m3 1.0
    sa = one.cuda().expand(m, kb // 8).contiguous()
    sb = one.cuda().expand(n, kb // 8).contiguous()
    config = triton_mm.MMConfig(block_m=16, block_n=128, block_g=8, split_k=64, num_warps=4, num_stages=3)
    out = triton_mm.mm_fp4_tiled(a, b, sa, sb, torch.ones(1, device="cuda"), torch.float32, config)
    ones = torch.full((1, 8), 0x38, dtype=torch.uint8)
    ref = oracle.dequantize(a_head, ones.expand(m, 8)) @ oracle.dequantize(b_head, ones.expand(n, 8)).T
    err = (out.double().cpu() - ref).abs()
    bad = (err > 1e-6 * ref.abs().max().item()).any(0)
    assert not bad.any(), f"weight rows wrong: {bad.nonzero().flatten().tolist()}"
    del big, b, a, sa, sb
    # W = 3 partials of 2**30 + 2048 elements: the third starts past 2**31
    w, count = 3, (1 << 30) + 2048
    big = torch.full((prefix + w * count,), 1000.0, dtype=torch.bfloat16, device="cuda")
    parts = big[prefix:].view(w, count)
    parts.random_(0, 64)  # small integers: every fp32 sum exact
    got = triton_reduce.sum_partials_in_order(parts)
    for cols in (slice(0, 1 << 20), slice(count - (1 << 20), count)):
        want = ((parts[0, cols].float() + parts[1, cols].float()) + parts[2, cols].float()).to(torch.bfloat16)
        assert torch.equal(got[cols], want), f"ordered sum, columns {cols}"
