"""The Hopper Gluon GEMM (fp4fuse/kernels/triton/mm_hopper.py): its shape rule (CPU), and on an sm_90
GPU with Triton 3.6 the kernel against the float64 reference at odd shapes, through ``mm_fp4``'s
dispatch, row blocks bitwise the whole product (what the collective GEMMs rely on), NaN scales,
the fallback for a misaligned weight, and compiled graphs lowering the kernel's calls."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
mm_hopper = pytest.importorskip("fp4fuse.kernels.triton.mm_hopper")  # needs Triton's Gluon

import fp4fuse  # noqa: E402,F401
from fp4fuse.config import FusionConfig  # noqa: E402
from fp4fuse.kernels.triton import mm as triton_mm  # noqa: E402
from fp4fuse.kernels.triton.alpha import GlobalScales  # noqa: E402
from fp4fuse.nvfp4 import format as nvfp4  # noqa: E402

ops = torch.ops.fp4fuse


def test_the_gluon_switch_is_read_on_every_call(monkeypatch):
    """``FusionPass.uuid`` reads ``FP4FUSE_DISABLE_GLUON`` whenever Inductor asks for a cache key, so
    the dispatch must follow the variable too (only the device's capability is cached): a process
    that sets it between two compiles gets the kernels the second key names."""
    monkeypatch.setattr(mm_hopper, "triton_version", lambda: mm_hopper.GLUON_TRITON)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.delenv(mm_hopper.ENV_DISABLE_GLUON, raising=False)
    mm_hopper.hopper_device.cache_clear()
    try:
        assert mm_hopper.hopper_available(0)
        monkeypatch.setenv(mm_hopper.ENV_DISABLE_GLUON, "1")
        assert not mm_hopper.hopper_available(0)
        monkeypatch.delenv(mm_hopper.ENV_DISABLE_GLUON)
        assert mm_hopper.hopper_available(0)
    finally:
        mm_hopper.hopper_device.cache_clear()


@pytest.mark.parametrize("m,n,k,out_dtype,serves", [
    (512, 8192, 8192, torch.bfloat16, True),     # 128 tiles of 256 x 128: one wave, filled
    (2048, 8192, 8192, torch.bfloat16, True),
    (2049, 8192, 8192, torch.bfloat16, False),   # dequantize + cuBLAS above
    (512, 3072, 4096, torch.bfloat16, False),    # 48 tiles: a third of one wave
    (1024, 3072, 4096, torch.bfloat16, False),   # 96 tiles: 0.73 of a wave
    (257, 28672, 8192, torch.bfloat16, False),   # 2 token tiles, the second holding 1 row
    (1024, 14336, 4096, torch.bfloat16, True),   # 448 tiles in 4 waves: 0.85 filled
    (257, 300, 192, torch.float16, True),        # fp16 / fp32: any fill, no upper bound (the tiled
    (9000, 8192, 8192, torch.float32, True),     # kernel, their other path, is slower)
    (256, 8192, 8192, torch.float32, True),      # up to 256 rows: split-K on weights of 3 * 2**22 elements
    (129, 8192, 4096, torch.bfloat16, True),
    (200, 4096, 7168, torch.bfloat16, True),
    (256, 3072, 4096, torch.bfloat16, True),     # the smallest: 3 * 2**22
    (128, 8192, 8192, torch.bfloat16, False),    # the decode GEMM's below 129 rows
    (200, 4096, 2048, torch.bfloat16, False),    # and on smaller weights
    (256, 3072, 4088, torch.bfloat16, False),
    (256, 8192, 4088, torch.float32, False),
    (1000, 8192, 8160, torch.bfloat16, False),   # K not a multiple of 64 (whole scale words per step)
    (1000, 0, 256, torch.float16, False),
    (1000, 64, 0, torch.float32, False),
])
def test_shape_rule(m, n, k, out_dtype, serves):
    assert mm_hopper.serves_shape(m, n, k, out_dtype, sms=132) is serves


def test_fill_rule_against_counted_tiles():
    """``fills_the_gpu`` against the fill counted tile by tile: outputs over launched capacity."""
    for sms in (132, 114):
        for m in range(257, 2049, 37):
            for n in (136, 3072, 4096, 8200, 14336, 28672):
                tiles = [(i, j) for i in range(0, m, 256) for j in range(0, n, 128)]
                waves = (len(tiles) + sms - 1) // sms
                fill = m * n / (waves * sms * 256 * 128)
                assert mm_hopper.fills_the_gpu(m, n, sms) == (fill >= 0.8), (m, n, sms, fill)


def test_a_traced_row_count_is_served_for_its_whole_range():
    """A symbolic M (a graph compiled with a dynamic batch) is decided by its hint, and the guards
    recorded hold for exactly the range the decision covers: 129 to 256 rows, the decode GEMM's
    last row range (``mm_decode.DECODE_ROW_RANGES``), so a compiled graph never runs a row count
    the other kernel would have taken."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    symbol = env.create_symbol(200, source=ConstantSource("m"))
    assert mm_hopper.serves_shape(env.create_symintnode(symbol, hint=200), 8192, 8192, torch.bfloat16, sms=132)
    holds = [all(bool(g.expr.subs(symbol, rows)) for g in env.guards) for rows in (100, 128, 129, 256, 257)]
    assert holds == [False, False, True, True, False]


def test_split_rule():
    """Split-K only up to 256 rows, where 256-token tiles number N / 128: enough K ranges to fill one
    wave, each at least 8 K steps long, at most 16."""
    assert mm_hopper.split_for(256, 8192, 8192, 132) == 2      # 64 tiles
    assert mm_hopper.split_for(200, 28672, 8192, 132) == 1     # 224 tiles: more than a wave
    assert mm_hopper.split_for(256, 14336, 4096, 132) == 1     # 112 tiles
    assert mm_hopper.split_for(256, 8192, 28672, 132) == 2
    assert mm_hopper.split_for(160, 2048, 65536, 132) == 8     # 16 tiles: 8 splits fill the wave
    assert mm_hopper.split_for(256, 1024, 4096, 132) == 8      # 64 steps: 8 per split
    assert mm_hopper.split_for(1024, 1024, 4096, 132) == 1     # above 256 rows: never


def test_not_served_off_cuda():
    assert not triton_mm.hopper_serves(1000, 4096, 4096, torch.bfloat16, torch.device("cpu"))


def _cpu_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """Operand tensors of the right dtypes and shapes (contents unused: the checks run first)."""
    return (torch.zeros(m, k // 2, dtype=torch.uint8), torch.zeros(n, k // 2, dtype=torch.uint8),
            torch.zeros(m, k // 16, dtype=torch.float8_e4m3fn), torch.zeros(n, k // 16, dtype=torch.float8_e4m3fn),
            torch.ones(1))


def test_refuses_operands_it_cannot_read_with_the_rule():
    """Bad operands get a ValueError naming the argument and the rule before any launch: K not a
    multiple of 64, a non-contiguous operand, scales the kernel cannot read as words, an output
    view it cannot write row by row."""
    a, b, sa, sb, alpha = _cpu_operands(300, 96, 192)
    with pytest.raises(ValueError, match="K % 64 == 0"):
        mm_hopper.mm_fp4_hopper(*_cpu_operands(300, 96, 160)[:4], alpha, torch.bfloat16)
    with pytest.raises(ValueError, match="b must be contiguous"):
        wide = torch.zeros(96, 192, dtype=torch.uint8)
        mm_hopper.mm_fp4_hopper(a, wide[:, :96], sa, sb, alpha, torch.bfloat16)
    sb_odd = _off_word(sb)
    assert sb_odd.data_ptr() % 4  # the storage offset puts the scales off a word boundary
    with pytest.raises(ValueError, match="4-byte aligned b_scale"):
        mm_hopper.mm_fp4_hopper(a, b, sa, sb_odd, alpha, torch.bfloat16)
    with pytest.raises(ValueError, match="block_m must be one of"):
        mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, block_m=96)
    with pytest.raises(ValueError, match="split_k must be at least 1"):
        mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, split_k=0)
    # a 2**23-row weight (untouched pages): the split partials' 32-bit offsets in a 256-row tile would wrap
    tall = torch.empty(1 << 23, 32, dtype=torch.uint8), torch.empty(1 << 23, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"split_k > 1 needs block_m \* N < 2\*\*31"):
        mm_hopper.mm_fp4_hopper(a[:, :32].contiguous(), tall[0], sa[:, :4].contiguous(), tall[1], alpha,
                                torch.bfloat16, split_k=2)
    with pytest.raises(ValueError, match="stages must be 2 to 4 for 256-token tiles"):
        mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, stages=5)  # 5 x 36 KiB: no room
    with pytest.raises(ValueError, match="stages must be 2 to 8 for 128-token tiles"):
        mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, block_m=128, stages=1)
    with pytest.raises(ValueError, match="step_k must be one of"):
        mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, step_k=96)
    with pytest.raises(ValueError, match="K % 128 == 0"):  # K = 192
        mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, step_k=128)
    with pytest.raises(ValueError, match="scale_ahead must be 0 or 1"):
        mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, scale_ahead=2)
    a2, b2, sa2, sb2, _ = _cpu_operands(300, 96, 256)
    sb_half_word = _off_word(sb2, offset=4)  # 4-byte aligned: enough for 64-element steps, not 128
    assert sb_half_word.data_ptr() % 8 == 4
    with pytest.raises(ValueError, match="8-byte aligned b_scale"):
        mm_hopper.mm_fp4_hopper(a2, b2, sa2, sb_half_word, alpha, torch.bfloat16, step_k=128)
    with pytest.raises(ValueError, match="stages must be 2 to 2 for 256-token tiles and 128-element steps"):
        mm_hopper.mm_fp4_hopper(a2, b2, sa2, sb2, alpha, torch.bfloat16, step_k=128, stages=3)
    with pytest.raises(ValueError, match="row stride 96"):
        mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, out=torch.empty(96, 300, dtype=torch.bfloat16).t())


# ---------------------------------------------------------------------------------------- CUDA

def _require_hopper() -> None:
    if not mm_hopper.hopper_available(torch.cuda.current_device()):
        pytest.skip("needs an sm_90 GPU and Triton 3.6 (the Gluon kernel's target)")


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``(a, sa, ga, b, sb, gb)``: random operands with block-varying magnitudes, quantized by the op."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def blocks(rows: int) -> torch.Tensor:
        spread = torch.rand(rows, k // 16, generator=gen, device="cuda").pow(4).repeat_interleave(16, 1)
        return (torch.randn(rows, k, generator=gen, device="cuda") * spread * 3).to(torch.bfloat16)

    xa, xb = blocks(m), blocks(n)
    ga = nvfp4.global_scale_from_amax(xa.float().abs().amax()).reshape(1)
    gb = nvfp4.global_scale_from_amax(xb.float().abs().amax()).reshape(1)
    a, sa = ops.scaled_fp4_quant(xa, ga)
    b, sb = ops.scaled_fp4_quant(xb, gb)
    return a, sa, ga, b, sb, gb


def _off_word(scales: torch.Tensor, offset: int = 1) -> torch.Tensor:
    """A copy of e4m3 ``scales`` ``offset`` bytes past an allocation's start (aligned to more than 8
    bytes; the kernel reads scales as 4- or 8-byte words)."""
    storage = torch.empty(scales.numel() + offset, dtype=torch.uint8, device=scales.device)
    copy = storage[offset:].view(scales.shape)
    copy.copy_(scales.view(torch.uint8))
    return copy.view(torch.float8_e4m3fn)


def _rel_error(out: torch.Tensor, a, b, sa, sb, alpha: torch.Tensor) -> float:
    ref = nvfp4.mm_fp4_reference(a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), alpha.cpu(), torch.float64)
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(257, 300, 192), (1000, 3000, 3584), (2048, 136, 640), (777, 8200, 1024),
                                   (1500, 14000, 1088)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_matches_float64(m, n, k, out_dtype):
    """The Gluon kernel at odd shapes is the float64 reference up to fp32 accumulation and one
    rounding; where ``mm_fp4`` sends the shape to it on this GPU, the op's output is bitwise its."""
    _require_hopper()
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=m + n + k)
    alpha = 1.0 / (ga * gb)
    out = mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, out_dtype)
    serves = triton_mm.hopper_serves(m, n, k, out_dtype, a.device)
    assert serves or out_dtype == torch.bfloat16  # fp16 / fp32: every M above the decode GEMM's
    if serves:
        assert torch.equal(ops.mm_fp4(a, b, sa, sb, alpha, out_dtype), out)
    assert out.dtype == out_dtype and out.shape == (m, n) and torch.isfinite(out).all()
    assert _rel_error(out, a, b, sa, sb, alpha) <= _TOL[out_dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k,block_m,split_k", [
    (100, 300, 1024, 128, 3),     # 16 K steps: 6 / 6 / 4
    (77, 8200, 1088, 64, 5),      # 17 steps: 4 per split, 5 splits
    (200, 136, 640, 64, 16),      # more splits asked than steps (10): one step each
    (130, 3000, 3584, 128, 7),    # a second token tile holding 2 rows
    (513, 520, 448, 256, 2),      # 7 steps: 4 / 3
    (13, 300, 1024, 16, 4),       # 16- and 32-token tiles
    (30, 1000, 2048, 32, 1),
])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cuda_split_k_and_small_tiles_match_float64(m, n, k, block_m, split_k, out_dtype):
    """Split-K (each split's fp32 partial sums, added in split order by a second launch) and the
    64- / 128-token tiles: the float64 reference up to fp32 accumulation and one rounding, and the
    same bits on a second call."""
    _require_hopper()
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=m * 7 + n + split_k)
    alpha = 1.0 / (ga * gb)
    out = mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, out_dtype, block_m=block_m, split_k=split_k)
    assert torch.equal(mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, out_dtype, block_m=block_m, split_k=split_k), out)
    if block_m <= 32:  # a register cap fitting three programs per multiprocessor: the same sums
        assert torch.equal(mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, out_dtype, block_m=block_m, split_k=split_k,
                                                   max_registers=56), out)
    # the deepest and the shallowest ring: other timing, the same sums
    for stages in (2, mm_hopper.max_stages(block_m)):
        assert torch.equal(mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, out_dtype, block_m=block_m, split_k=split_k,
                                                   stages=stages), out)
    assert out.shape == (m, n) and torch.isfinite(out).all()
    assert _rel_error(out, a, b, sa, sb, alpha) <= _TOL[out_dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k,block_m,split_k", [
    (13, 300, 1024, 16, 4),     # 8 steps of 128 elements: 2 per split
    (50, 1000, 1152, 64, 1),    # 9 steps of 128: an odd count (the loop's tail step)
    (100, 136, 1408, 128, 3),   # 11 steps of 128: 4 / 4 / 3
])
def test_cuda_wide_steps_and_scales_ahead_match_float64(m, n, k, block_m, split_k):
    """The sweep parameters ``step_k`` (128-element steps, one int64 word of scales a row) and
    ``scale_ahead`` (a step's scales loaded a step earlier): the float64 reference up to fp32
    accumulation and one rounding; the same bits on a second call (the prepared launch) and with
    the scales loaded ahead or not (the same sums)."""
    _require_hopper()
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=m + n + k)
    alpha = 1.0 / (ga * gb)
    for step_k in mm_hopper.STEP_K_CHOICES:
        out = mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, block_m=block_m, split_k=split_k,
                                      step_k=step_k)
        again = mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, block_m=block_m, split_k=split_k,
                                        step_k=step_k)
        ahead = mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, block_m=block_m, split_k=split_k,
                                        step_k=step_k, scale_ahead=1)
        assert torch.equal(again, out) and torch.equal(ahead, out), step_k
        assert _rel_error(out, a, b, sa, sb, alpha) <= _TOL[torch.bfloat16], step_k


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k,block_m,split_k", [
    (13, 300, 1024, 16, 4), (100, 136, 1408, 128, 3), (300, 1000, 640, 256, 2), (257, 520, 4096, 256, 1)])
def test_cuda_fragment_order_and_k_order_both_match_float64(m, n, k, block_m, split_k):
    """``fragment_order`` (shipped: contiguous code loads, each step's K in the fragments' order, the
    activation decoded in that order) and the K-order form: each within fp32 accumulation and one
    rounding of the float64 reference, for 64- and 128-element steps; the same bits on a second
    call; and a K permutation of both operands, so the two agree to a few fp32 roundings."""
    _require_hopper()
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=7 * m + n + k)
    alpha = 1.0 / (ga * gb)
    for step_k in mm_hopper.STEP_K_CHOICES:
        if k % step_k or mm_hopper.max_stages(block_m, step_k) < 2:
            continue
        stages = min(mm_hopper.STAGES, mm_hopper.max_stages(block_m, step_k))
        outs = {}
        for order in (True, False):
            outs[order] = mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.float32, block_m=block_m, split_k=split_k,
                                                  step_k=step_k, stages=stages, fragment_order=order)
            again = mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.float32, block_m=block_m, split_k=split_k,
                                            step_k=step_k, stages=stages, fragment_order=order)
            assert torch.equal(again, outs[order]), (step_k, order)
            assert _rel_error(outs[order], a, b, sa, sb, alpha) <= _TOL[torch.float32], (step_k, order)
        assert torch.allclose(outs[True], outs[False], rtol=1e-5, atol=1e-5 * outs[False].abs().max().item())


@pytest.mark.cuda
def test_cuda_fast_launch_serves_the_kernel_tritons_dispatch_picks(monkeypatch):
    """The Gluon launch goes through ``FastKernel`` (fp4fuse.kernels.triton.launch), keyed on its TMA
    descriptors' dtype, block shape and layout: token tiles of 16, 64 and 256 rows and split-K
    launches, interleaved, each served from its own cache entry, give the bits of launches
    through Triton's own dispatch."""
    _require_hopper()
    from fp4fuse.kernels.triton import launch

    fast = launch._fast(mm_hopper._mm_hopper_kernel)
    cases = [(300, 1000, 1024, 256, 1), (40, 1000, 1024, 16, 2), (300, 1000, 1024, 64, 3), (40, 1000, 1024, 256, 1)]
    operands = {case: _operands(*case[:3], seed=sum(case)) for case in cases}

    def run(case):
        a, sa, ga, b, sb, gb = operands[case]
        return mm_hopper.mm_fp4_hopper(a, b, sa, sb, 1.0 / (ga * gb), torch.bfloat16, block_m=case[3],
                                       split_k=case[4])

    fast.cache.clear()
    served = [run(case) for case in cases + cases]  # the second round hits the cache
    functions = {entry[1] for entry in fast.cache.values()}
    # one entry per case (integers are keyed by value); the two 256-row tiles without split-K share a
    # kernel (Triton specializes 300 and 40 alike: neither is 1 nor a multiple of 16)
    assert len(fast.cache) == 4 and len(functions) == 3
    monkeypatch.setattr(mm_hopper, "traceable", lambda kernel: kernel)  # Triton's own dispatch
    for case, out, again in zip(cases, served, served[len(cases):]):
        assert torch.equal(out, again) and torch.equal(run(case), out), case


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(300, 1000, 1024), (200, 1000, 2048)])  # one split; split-K (workspace per call)
def test_cuda_prepared_launch_reads_the_new_values_in_the_same_buffers(monkeypatch, m, n, k):
    """A repeated call (``mm_fp4_hopper_halves`` with its own output, as a compiled graph makes it)
    is a prepared launch (``launch.Relaunch``): descriptors encoded at the first call. Refilled
    in place with another activation and other global scales, the same buffers give that product's
    bits (a launch through Triton's own dispatch) and the float64 reference's values; another
    activation buffer gets a launch of its own."""
    _require_hopper()
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=m + k)
    a2, sa2, ga2, _, _, _ = _operands(m, n, k, seed=m + k + 1)
    ga, gb = ga.clone(), gb.clone()
    xlo, xhi = mm_hopper.decode_activation(a, sa)

    def call(xlo, xhi, ga):
        return mm_hopper.mm_fp4_hopper_halves(xlo, xhi, b, sb, GlobalScales(ga, gb, True), torch.bfloat16)

    mm_hopper._RELAUNCHES.clear()
    first = call(xlo, xhi, ga)
    assert len(mm_hopper._RELAUNCHES) == 1
    assert torch.equal(call(xlo, xhi, ga), first)
    lo2, hi2 = mm_hopper.decode_activation(a2, sa2)
    xlo.copy_(lo2)
    xhi.copy_(hi2)
    ga.copy_(ga2)
    again = call(xlo, xhi, ga)
    assert len(mm_hopper._RELAUNCHES) == 1  # served by the prepared launch
    assert not torch.equal(again, first)
    assert _rel_error(again, a2, b, sa2, sb, 1.0 / (ga2 * gb)) <= _TOL[torch.bfloat16]
    other = call(lo2, hi2, ga)  # other buffers: a launch prepared for them
    assert len(mm_hopper._RELAUNCHES) == 2 and torch.equal(other, again)
    hooked = []
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *args: hooked.append(args))
    assert torch.equal(call(lo2, hi2, ga), again) and hooked  # a launch hook (a profiler) sees every launch
    monkeypatch.setattr(mm_hopper, "traceable", lambda kernel: kernel)  # Triton's own dispatch, nothing prepared
    assert torch.equal(call(lo2, hi2, ga), again)


@pytest.mark.cuda
def test_cuda_split_k_row_blocks_are_bitwise_the_whole_product():
    """With one split count for every block (``RowBlockGemm`` takes the whole GEMM's), row blocks
    give the whole split-K product's bits."""
    _require_hopper()
    m, n, k = 200, 1000, 2048
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=17)
    alpha = 1.0 / (ga * gb)
    whole = mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, block_m=128, split_k=4)
    out = torch.full_like(whole, float("nan"))
    for r0, r1 in [(0, 37), (37, 150), (150, m)]:
        mm_hopper.mm_fp4_hopper(a[r0:r1], b, sa[r0:r1], sb, alpha, torch.bfloat16, out=out[r0:r1], block_m=128,
                                split_k=4)
    assert torch.equal(out, whole)


@pytest.mark.cuda
def test_cuda_dispatch_up_to_256_rows_and_grouped_calls():
    """From 129 to 256 rows ``mm_fp4`` sends a large weight's product to the Gluon GEMM with
    ``split_for``'s count (bitwise that launch, and the float64 reference); the grouped calls of
    ``mm_fp4_calls_triton`` (a layer's sibling GEMMs) give each call's own bits when one of them is
    the Gluon GEMM's and the others share a decode launch."""
    _require_hopper()
    m, n, k = 200, 8200, 4096
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=19)
    alpha = 1.0 / (ga * gb)
    assert triton_mm.hopper_serves(m, n, k, torch.bfloat16, a.device)
    split = mm_hopper.split_for(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    out = ops.mm_fp4(a, b, sa, sb, alpha, torch.bfloat16)
    assert torch.equal(out, mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16, split_k=split))
    assert _rel_error(out, a, b, sa, sb, alpha) <= _TOL[torch.bfloat16]
    small = [_operands(m, 700, k, seed=s)[3:] for s in (23, 29)]
    calls = [(a, b, sa, sb, alpha, torch.bfloat16)] + [(a, bb, sa, sbb, 1.0 / (ga * gbb), torch.bfloat16)
                                                        for bb, sbb, gbb in small]
    assert not any(triton_mm.hopper_serves(m, 700, k, torch.bfloat16, a.device) for _ in small)
    for got, call in zip(triton_mm.mm_fp4_calls_triton(calls), calls):
        assert torch.equal(got, triton_mm.mm_fp4_triton(*call))


@pytest.mark.cuda
def test_cuda_gluon_siblings_of_one_activation_decode_it_once():
    """Above 256 rows, Gluon GEMMs on one activation (a layer's gate and up projections) through
    ``mm_fp4_calls_triton``: the activation decoded once (``mm_fp4_hopper_products``), each output
    bitwise its own ``mm_fp4_triton`` call, and a third call on another activation left alone."""
    _require_hopper()
    m, n, k = 1024, 8192, 1024
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=31)
    up, sup, gup = _operands(m, n, k, seed=37)[3:]
    other, so, go = _operands(m, n, k, seed=41)[:3]
    assert triton_mm.hopper_serves(m, n, k, torch.bfloat16, a.device)
    calls = [(a, b, sa, sb, 1.0 / (ga * gb), torch.bfloat16), (a, up, sa, sup, 1.0 / (ga * gup), torch.bfloat16),
             (other, b, so, sb, 1.0 / (go * gb), torch.bfloat16)]
    outs = triton_mm.mm_fp4_calls_triton(calls)
    for got, call in zip(outs, calls):
        assert torch.equal(got, triton_mm.mm_fp4_triton(*call))
    assert _rel_error(outs[1], *calls[1][:5]) <= _TOL[torch.bfloat16]


@pytest.mark.cuda
@pytest.mark.parametrize("div_rn", [True, False])
def test_cuda_alpha_from_global_scales(div_rn):
    """``GlobalScales``: the epilogue forms ``1 / (gs_a * gs_b)``; with IEEE division it is the
    alpha eager torch computes, so the output is bitwise the one with that alpha passed in."""
    _require_hopper()
    a, sa, ga, b, sb, gb = _operands(600, 520, 448, seed=3)
    alpha = torch.reciprocal(ga * gb)
    got = mm_hopper.mm_fp4_hopper(a, b, sa, sb, GlobalScales(ga, gb, div_rn), torch.bfloat16)
    if div_rn:
        assert torch.equal(got, mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16))
    assert _rel_error(got, a, b, sa, sb, alpha) <= _TOL[torch.bfloat16]


@pytest.mark.cuda
def test_cuda_row_blocks_are_bitwise_the_whole_product():
    """Blocks of rows written into views of one output (``RowBlockGemm``'s HOPPER mode in the
    collective GEMMs) with the whole product's split count give the whole product's bits: each
    output's sums do not depend on M."""
    _require_hopper()
    m, n, k = 1301, 3000, 1024
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=5)
    alpha = 1.0 / (ga * gb)
    whole = mm_hopper.mm_fp4_hopper(a, b, sa, sb, alpha, torch.bfloat16)
    split = mm_hopper.split_for(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    out = torch.full_like(whole, float("nan"))
    for r0, r1 in [(0, 300), (300, 777), (777, 1300), (1300, m)]:  # the last block alone would split K
        mm_hopper.mm_fp4_hopper(a[r0:r1], b, sa[r0:r1], sb, alpha, torch.bfloat16, out=out[r0:r1], split_k=split)
    assert torch.equal(out, whole)


@pytest.mark.cuda
def test_cuda_nan_block_scales_propagate():
    """A NaN weight block scale makes its output column NaN; a NaN activation block scale its row."""
    _require_hopper()
    a, sa, ga, b, sb, gb = _operands(700, 200, 320, seed=7)
    sb.view(torch.uint8)[5, 3] = 0x7F
    sa.view(torch.uint8)[9, 17] = 0xFF
    out = mm_hopper.mm_fp4_hopper(a, b, sa, sb, 1.0 / (ga * gb), torch.float32)
    assert torch.isnan(out[:, 5]).all() and torch.isnan(out[9]).all()
    rest = torch.ones_like(out, dtype=torch.bool)
    rest[:, 5] = False
    rest[9] = False
    assert torch.isfinite(out[rest]).all()


@pytest.mark.cuda
def test_cuda_misaligned_weight_scales_take_the_other_path():
    """Scales the kernel cannot read as words (not 4-byte aligned): the kernel refuses them with the
    rule, and ``mm_fp4`` computes the product through its other path."""
    _require_hopper()
    m, n, k = 600, 96, 256
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=11)
    sb_odd = _off_word(sb)
    alpha = 1.0 / (ga * gb)
    with pytest.raises(ValueError, match="b_scale"):
        mm_hopper.mm_fp4_hopper(a, b, sa, sb_odd, alpha, torch.bfloat16)
    out = ops.mm_fp4(a, b, sa, sb_odd, alpha, torch.bfloat16)
    assert _rel_error(out, a, b, sa, sb, alpha) <= _TOL[torch.bfloat16]


def _gemm_graph(a, b, sa, sb, ga, gb):
    return ops.mm_fp4(a, b, sa, sb, torch.reciprocal(ga * gb), torch.bfloat16).relu()


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k,later,cpp_wrapper", [(1000, 4096, 256, None, False), (200, 8192, 4096, 250, False),
                                                     (1000, 4096, 256, None, True)])
def test_cuda_compiled_graph_lowers_the_gluon_gemm_with_its_bits(m, n, k, later, cpp_wrapper):
    """A compiled ``mm_fp4`` in the Gluon kernel's range is lowered: the activation's decode becomes
    a Triton launch, the Gluon launch one call of ``fp4fuse::_mm_fp4_hopper`` with alpha folded from
    the two global scales, and the output is the eager op's, bit for bit -- a prefill product, and a
    dynamic batch in the split-K range (200 rows, then 250 in the same graph); with Inductor's C++
    wrapper as well. A second call with other values (its Gluon launch the prepared one of the
    first call's buffers) gives its own product's bits."""
    _require_hopper()
    torch._dynamo.reset()
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=13)
    assert triton_mm.hopper_serves(m, n, k, torch.bfloat16, a.device)
    fusion = fp4fuse.FusionPass(FusionConfig())
    compiled = torch.compile(_gemm_graph, fullgraph=True,
                             options={"post_grad_custom_post_pass": fusion, "cpp_wrapper": cpp_wrapper})
    if later is not None:  # a dynamic batch: the row count symbolic, nothing else
        torch._dynamo.mark_dynamic(a, 0)
        torch._dynamo.mark_dynamic(sa, 0)
    assert torch.equal(compiled(a, b, sa, sb, ga, gb), _gemm_graph(a, b, sa, sb, ga, gb))
    assert fusion.match_counts.get("lowering.mm_fp4") == 1
    assert fusion.match_counts.get("lowering.alpha_from_global_scales") == 1
    a1, sa1, ga1 = _operands(m, n, k, seed=15)[:3]
    assert torch.equal(compiled(a1, b, sa1, sb, ga1, gb), _gemm_graph(a1, b, sa1, sb, ga1, gb))
    if later is not None:
        a2, sa2 = _operands(later, n, k, seed=14)[:2]
        assert torch.equal(compiled(a2, b, sa2, sb, ga, gb), _gemm_graph(a2, b, sa2, sb, ga, gb))
        # one graph serves the range: compiled here, or served from the FX graph cache of an earlier run
        assert fusion.calls + fusion.cached_graphs == 1


@pytest.mark.cuda
def test_cuda_lowered_launch_takes_the_other_path_for_a_misaligned_weight():
    """``fp4fuse::_mm_fp4_hopper`` (the lowered graph's Gluon launch) finds a weight's alignment only
    per call: with scales the kernel cannot read as words it computes what the eager ``mm_fp4``
    computes for them (its other path), bit for bit, and with aligned ones what the Gluon kernel does;
    an input requiring a gradient is refused outside torch.no_grad() (the op has no gradient)."""
    _require_hopper()
    m, n, k = 600, 96, 256
    a, sa, ga, b, sb, gb = _operands(m, n, k, seed=11)
    sb_odd = _off_word(sb)
    xlo, xhi = mm_hopper.decode_activation(a, sa)
    alpha = 1.0 / (ga * gb)
    got = ops._mm_fp4_hopper(a, sa, xlo, xhi, b, sb_odd, alpha, alpha, False, False, torch.bfloat16)
    assert torch.equal(got, ops.mm_fp4(a, b, sa, sb_odd, alpha, torch.bfloat16))
    # aligned, alpha folded from the two global scales (IEEE division in the epilogue)
    got = ops._mm_fp4_hopper(a, sa, xlo, xhi, b, sb, ga, gb, True, True, torch.bfloat16)
    assert torch.equal(got, mm_hopper.mm_fp4_hopper(a, b, sa, sb, GlobalScales(ga, gb, div_rn=True), torch.bfloat16))
    # an input that requires a gradient is refused (the op has none), not run without one
    with pytest.raises(RuntimeError, match="no gradient formula, and alpha_b requires"):
        ops._mm_fp4_hopper(a, sa, xlo, xhi, b, sb, ga, gb.clone().requires_grad_(), True, True, torch.bfloat16)
    # the e4m3 block scales too: an fp8 tensor can require a gradient
    with pytest.raises(RuntimeError, match="no gradient formula, and a_scale requires"):
        ops._mm_fp4_hopper(a, sa.clone().requires_grad_(), xlo, xhi, b, sb, ga, gb, True, True, torch.bfloat16)
    with pytest.raises(RuntimeError, match="no gradient formula, and b_scale requires"):
        ops._mm_fp4_hopper(a, sa, xlo, xhi, b, sb.clone().requires_grad_(), ga, gb, True, True, torch.bfloat16)
    with torch.no_grad():
        ops._mm_fp4_hopper(a, sa, xlo, xhi, b, sb, ga, gb.clone().requires_grad_(), True, True, torch.bfloat16)
