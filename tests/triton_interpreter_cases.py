"""Checks of fp4fuse's Triton kernels under Triton's CPU interpreter.

Run by tests/test_triton_kernels.py in a subprocess with ``TRITON_INTERPRET=1`` (the variable must
be set before triton is imported, so these cannot share a process with CUDA tests):

    TRITON_INTERPRET=1 python tests/triton_interpreter_cases.py quant mm mm_decode norm norm_quant

Each case raises AssertionError with the failing shape; exit status 0 means all passed.
"""
from __future__ import annotations

import dataclasses
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import numpy as np
import torch
from triton.runtime import interpreter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.kernels.triton import mm as triton_mm, mm_decode, norm as triton_norm, norm_quant as triton_norm_quant
from fp4fuse.kernels.triton import quant as triton_quant
import nvfp4_oracle as oracle  # noqa: E402  (tests/, the script's own folder)
from fp4fuse.nvfp4.norms import (
    fused_add_rms_norm_fp4_quant_reference, fused_add_rms_norm_reference, rms_norm_fp4_quant_reference, rms_norm_reference,
)


def _fix_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a runtime loop bound into an int with ``int(array of shape
    (1,))``, which numpy >= 2.4 rejects (triton-lang/triton#9171, fixed upstream by #9172).
    Re-register its ``tensor.__index__`` the way the fix does; a no-op on fixed versions."""
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _rand_blocks(m: int, k: int, gen: torch.Generator, spread: float = 3.0) -> torch.Tensor:
    """Random data whose 16-element blocks span several orders of magnitude."""
    block = torch.rand(m, k // 16, generator=gen).pow(4).repeat_interleave(16, 1)
    return torch.randn(m, k, generator=gen) * block * spread


def _boundary_blocks() -> torch.Tensor:
    """fp32 blocks whose block scale is exactly ``(8 + mm) / 8 * 2**e`` and whose other elements sit
    on, just above and just below every e2m1 decision point ``t * s`` (gs = 1)."""
    rows = []
    thresholds = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    for e in (-8, -3, 0, 5):
        for mm in range(8):
            s = (8 + mm) / 8 * 2.0 ** e
            vals = []
            for t in thresholds:
                c = np.float32(t * s)
                vals += [c, np.nextafter(c, np.float32(np.inf)), np.nextafter(c, np.float32(0))]
            vals = np.array(vals, dtype=np.float32)
            signs = np.where(np.arange(vals.size) % 2 == 0, 1, -1).astype(np.float32)
            vals = vals * signs
            for chunk in (vals[:15], vals[15:]):
                block = np.zeros(16, dtype=np.float32)
                block[0] = 6 * s                     # amax: block scale = e4m3(6 s / 6) = s
                block[1:1 + chunk.size] = chunk
                rows.append(block)
    return torch.from_numpy(np.concatenate(rows).reshape(-1, 64))


def case_quant() -> None:
    gen = torch.Generator().manual_seed(1)
    # the kernel sees a flat array of 16-element blocks: shapes differ only in the partial last chunk
    shapes = {torch.bfloat16: ((3, 48), (130, 64), (1, 16), (7, 1040)),
              torch.float16: ((3, 48), (7, 1040)), torch.float32: ((130, 64), (1, 16))}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m, k in shapes[dtype]:
            x = _rand_blocks(m, k, gen).to(dtype)
            x[0, 5] = float("nan")
            x[-1, -1] = -0.0
            if m > 2:
                x[2, 17] = float("inf")
                x[2, 18] = float("-inf")
                x[1, :16] = 0
                x[1, 16:32] *= 1e-4
                x[1, 32:48] = -0.0
            finite = x.float().nan_to_num(0, 0, 0)
            scales = [nvfp4.global_scale_from_amax(finite.abs().amax()).reshape(1), torch.tensor([1e4])]
            if dtype == torch.bfloat16 and m == 130:
                # NaN, +inf (0 * inf is a NaN quotient: code +0), overflow of x * gs, all scales 0
                scales += [torch.tensor([float(v)]) for v in ("nan", "inf", 1e36, 1e-36)]
            for gs in scales:
                rq, rs = nvfp4.quantize_reference(x, gs)
                for div in triton_quant.QuantDivision:
                    q, s = triton_quant.scaled_fp4_quant_triton(x, gs, division=div)
                    where = f"quant {dtype} {m}x{k} gs={gs.item():g} {div.name}"
                    assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), where + ": scales differ"
                    assert torch.equal(q, rq), where + ": codes differ"
    x = _boundary_blocks()
    gs = torch.tensor([1.0])
    for dtype in (torch.float32, torch.bfloat16):
        # bf16: the boundary values rounded to bf16, which puts many exactly on a decision point
        xd = x.to(dtype)
        rq, rs = nvfp4.quantize_reference(xd, gs)
        for div in triton_quant.QuantDivision:
            q, s = triton_quant.scaled_fp4_quant_triton(xd, gs, division=div)
            assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), f"boundary scales {dtype} {div.name}"
            assert torch.equal(q, rq), f"boundary codes {dtype} {div.name}"
    # several chunks per program (a persistent grid), and a partial last chunk
    x = _rand_blocks(130, 64, gen).to(torch.bfloat16)
    gs = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    rq, rs = nvfp4.quantize_reference(x, gs)
    for div in triton_quant.QuantDivision:
        q, s = triton_quant.scaled_fp4_quant_triton(x, gs, division=div)
        assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), f"boundary scales {div.name}"
        assert torch.equal(q, rq), f"boundary codes {div.name}"
    _check_global_scale_rules(gen)
    q, s = triton_quant.scaled_fp4_quant_triton(x, gs, config=(128, 4, 2))
    assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), "persistent grid"
    tiny = torch.full((1, 32), 3e-38) * torch.randn(1, 32, generator=gen)
    gs = torch.tensor([5e30])
    rq, rs = nvfp4.quantize_reference(tiny, gs)
    for div in triton_quant.QuantDivision:
        q, s = triton_quant.scaled_fp4_quant_triton(tiny, gs, division=div)
        assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), f"tiny values {div.name}"
    _check_quant_group(gen)
    _check_quant_of_maxima(gen)


def _check_quant_of_maxima(gen: torch.Generator) -> None:
    """``scaled_fp4_quant_of_maxima_triton``: the global scale computed in the launch from the row
    maxima of |x| (2-D and 3-D inputs, maxima as one row or a [B, S] grid, more than one block of
    maxima) is bitwise the quantizer's eager scale (``quantizer.group_amax`` +
    ``format.global_scale_from_amax``), and so are the codes and block scales; also with a NaN, an
    inf and all zeros (scale NaN, NaN, 1). The interpreter divides IEEE under both ``div_rn``."""
    from fp4fuse.nvfp4.quantizer import NVFP4Quantizer

    for shape, dtype in (((5, 48), torch.bfloat16), ((2, 3, 80), torch.float16), ((37, 32), torch.float32),
                         ((300, 16), torch.bfloat16)):
        for case in ("random", "nan", "inf", "zeros"):
            x = _rand_blocks(int(np.prod(shape[:-1])), shape[-1], gen).reshape(shape).to(dtype)
            if case == "nan":
                x.view(-1, shape[-1])[1, 3] = float("nan")
            elif case == "inf":
                x.view(-1, shape[-1])[-1, 0] = float("-inf")
            elif case == "zeros":
                x.zero_()
            maxima = x.abs().amax(dim=-1)
            if maxima.numel() > triton_quant.MAX_MAXIMA:
                maxima = maxima.reshape(-1, 2).amax(dim=-1)  # the same maximum from 150 partial ones
            rq, rs, rgs = NVFP4Quantizer().quantize(x.reshape(-1, shape[-1]))
            for div_rn in (True, False):
                q, s, gs = triton_quant.scaled_fp4_quant_of_maxima_triton(x.reshape(-1, shape[-1]), maxima, div_rn)
                where = f"quant of maxima {shape} {dtype} {case} div_rn={div_rn}"
                assert torch.equal(gs.view(torch.int32), rgs.view(torch.int32)), f"{where}: {gs} vs {rgs}"
                assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), where + ": scales differ"
                assert torch.equal(q, rq), where + ": codes differ"
    # whatever the maxima are (the graph's amax of them is exact): all negative, a -inf among them
    for maxima in (-torch.rand(7, generator=gen) - 0.5, torch.tensor([-3.0, float("-inf"), -0.25])):
        amax = maxima.amax().reshape(1)
        want = nvfp4.global_scale_from_amax(torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax))
        for div_rn in (True, False):
            _, _, gs = triton_quant.scaled_fp4_quant_of_maxima_triton(torch.ones(2, 16), maxima, div_rn)
            assert torch.equal(gs.view(torch.int32), want.view(torch.int32)), f"negative maxima: {gs} vs {want}"
    for bad in (torch.zeros(0), torch.ones(triton_quant.MAX_MAXIMA + 1)):
        try:
            triton_quant.scaled_fp4_quant_of_maxima_triton(torch.ones(2, 16), bad, True)
        except ValueError as exc:
            assert "maxima has" in str(exc)
        else:
            raise AssertionError(f"quant of maxima accepted {bad.numel()} maxima")


def _check_quant_group(gen: torch.Generator) -> None:
    """``scaled_fp4_quant_group_triton``: one input under 2, 3 and 4 global scales (a launch of 3 and
    one of 1), each output the reference quantizer's under its own scale, an invalid scale (NaN)
    among valid ones included."""
    for m, k, dtype in ((7, 1040, torch.bfloat16), (130, 64, torch.float32)):
        x = _rand_blocks(m, k, gen).to(dtype)
        x[0, 3] = float("nan")
        amax = x.float().nan_to_num(0, 0, 0).abs().amax()
        scales = [nvfp4.global_scale_from_amax(amax * f).reshape(1) for f in (1.0, 0.37, 2.9)]
        scales.append(torch.tensor([float("nan")]))
        for count in (2, 3, 4):
            got = triton_quant.scaled_fp4_quant_group_triton(x, scales[:count])
            assert len(got) == count
            for (q, s), gs in zip(got, scales):
                rq, rs = nvfp4.quantize_reference(x, gs)
                where = f"quant group of {count}, {dtype} {m}x{k} gs={gs.item():g}"
                assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), where + ": scales differ"
                assert torch.equal(q, rq), where + ": codes differ"
    calls = [(x, scales[0]), (x.clone(), scales[1])]  # two inputs: one launch each
    for (q, s), (xi, gs) in zip(triton_quant.scaled_fp4_quant_calls_triton(calls), calls):
        rq, rs = nvfp4.quantize_reference(xi, gs)
        assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), "quant calls, two inputs"


def _check_global_scale_rules(gen: torch.Generator) -> None:
    """The global-scale rules of format.py, stated independently of the reference: a scale
    outside (0, inf) gives e4m3 NaN (0x7F) for every block scale and code 0 everywhere; 1e30
    saturates every block with a nonzero element to 448 (0x7E) and every nonzero element to
    +-6 (magnitude code 7, sign bit 8)."""
    x = _rand_blocks(5, 80, gen).to(torch.bfloat16)
    x[2, :16] = 0
    x[3, 7] = 0
    nonzero = x != 0
    for value in (0.0, -0.0, -3.5, float("inf"), float("-inf"), float("nan"), 1e30):
        gs = torch.tensor([value])
        for div in triton_quant.QuantDivision:
            q, s = triton_quant.scaled_fp4_quant_triton(x, gs, division=div)
            codes = nvfp4.unpack_nibbles(q).long()
            scale_bits = s.view(torch.uint8).long()
            where = f"global scale {value} {div.name}"
            if value == 1e30:
                block_nonzero = nonzero.reshape(5, 5, 16).any(-1)
                assert torch.equal(scale_bits, torch.where(block_nonzero, 0x7E, 0)), where
                expected = torch.where(nonzero, 7 + 8 * (x < 0).long(), 0)
                assert torch.equal(codes, expected), where
            else:
                assert bool((scale_bits == 0x7F).all()) and bool((codes == 0).all()), where
            rq, rs = nvfp4.quantize_reference(x, gs)
            assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), where


def _quantized(m: int, k: int, gen: torch.Generator):
    x = _rand_blocks(m, k, gen)
    gs = nvfp4.global_scale_from_amax(x.abs().amax()).reshape(1)
    q, s = nvfp4.quantize_reference(x, gs)
    return q, s, gs


def _check_empty_operands(gen: torch.Generator) -> None:
    """M = 0 or N = 0: the empty [M, N] (tiled and dequantize + cuBLAS paths); K = 0: alpha * 0, as the
    float64 reference gives it (-0 for a negative alpha, NaN for a non-finite one; what the op's
    CUDA kernel runs for an empty operand, and what a lowered graph's traced launch must match)."""
    for m, n, k in ((0, 5, 32), (4, 0, 32), (0, 0, 48), (3, 5, 0), (triton_mm.DEQUANT_MIN_M, 0, 32)):
        a, sa = triton_quant.scaled_fp4_quant_triton(torch.randn(m, k, generator=gen) + 0.5, torch.tensor([2.0]))
        b, sb = triton_quant.scaled_fp4_quant_triton(torch.randn(n, k, generator=gen) + 0.5, torch.tensor([2.0]))
        assert a.shape == (m, k // 2) and sa.shape == (m, k // 16), f"quant {m}x{k}"
        for out_dtype in (torch.bfloat16, torch.float32):
            for value in (0.3, -0.3, float("inf"), float("nan")):
                alpha = torch.tensor([value])
                out = triton_mm.mm_fp4_triton(a, b, sa, sb, alpha, out_dtype)
                ref = nvfp4.mm_fp4_reference(a, b, sa, sb, alpha, out_dtype)
                same = torch.equal(out.isnan(), ref.isnan()) and torch.equal(
                    torch.where(ref.isnan(), 0, out).view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                    torch.where(ref.isnan(), 0, ref).view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32))
                assert out.dtype == out_dtype and out.shape == (m, n) and same, \
                    f"empty mm {m}x{n}x{k} {out_dtype} alpha={value}: {out} against the reference's {ref}"


def _check_alpha_from_global_scales(gen: torch.Generator) -> None:
    """Every alpha epilogue given ``GlobalScales(ga, gb)`` gives the bits of alpha = 1 / (ga * gb)
    passed as a tensor (the interpreter divides IEEE either way; the PTX division's rounding is
    checked on CUDA in test_lowering.py): decode (one launch, split-K), tiled (split-K reduction
    and direct epilogue), dequantize + cuBLAS (``_scale_group_kernel``)."""
    from fp4fuse.kernels.triton.alpha import GlobalScales
    C, D = triton_mm.MMConfig, mm_decode.DecodeConfig
    m, n, k = 19, 37, 160
    a, sa, ga = _quantized(m, k, gen)
    b, sb, gb = _quantized(n, k, gen)
    gb = gb * 3.7  # a product that is not a power of two
    alpha = torch.reciprocal(ga * gb)
    paths = {
        "decode": lambda al: mm_decode.mm_fp4_decode(a, b, sa, sb, al, torch.float32, D(16, 32, 64, 1, 4, 2)),
        "decode split": lambda al: mm_decode.mm_fp4_decode(a, b, sa, sb, al, torch.bfloat16, D(16, 16, 64, 3, 4, 2)),
        "tiled": lambda al: triton_mm.mm_fp4_tiled(a, b, sa, sb, al, torch.float32, C(16, 16, 2, 1, 4, 2)),
        "tiled split": lambda al: triton_mm.mm_fp4_tiled(a, b, sa, sb, al, torch.float16, C(16, 16, 2, 3, 4, 2)),
        "dequant + mm": lambda al: triton_mm.mm_fp4_dequant_mm(a, b, sa, sb, al),
    }
    for name, run in paths.items():
        want = run(alpha)
        for div_rn in (True, False):
            assert torch.equal(run(GlobalScales(ga, gb, div_rn)), want), f"GlobalScales {name} div_rn={div_rn}"


def _fragment_slots(group: int) -> list[int]:
    """Column of a ``group``-column K step (32 Q code bytes) that holds each code byte when each of
    a wgmma A fragment's four lane columns t loads 8 Q contiguous bytes and fills its slots in
    register order: instruction i (16 slots each), then slot pair j (2 t + 8 j), then b. The
    m16n8k16 A layout written out: lane column t holds slots 2t, 2t+1, 2t+8, 2t+9 of each k16."""
    q = group // 32
    slots = [0] * group
    for t in range(4):
        held = [16 * i + 2 * t + 8 * j + b for i in range(2 * q) for j in range(2) for b in range(2)]
        for offset, slot in enumerate(held):
            slots[8 * q * t + offset] = slot
    return slots


def _check_halves_in_fragment_order(gen: torch.Generator) -> None:
    """``decode_fp4_halves(fragment_group=G)`` is the K-order decode with each group of G columns
    permuted as ``_fragment_slots`` derives from the fragment layout; K/2 not a multiple of G is
    refused."""
    for m, k, group in ((5, 192, 32), (3, 256, 64), (130, 64, 32), (1, 128, 64)):
        a, sa, _ = _quantized(m, k, gen)
        lo, hi = triton_mm.decode_fp4_halves(a, sa)
        flo, fhi = triton_mm.decode_fp4_halves(a, sa, group)
        slots = torch.tensor(_fragment_slots(group))
        for plain, ordered in ((lo, flo), (hi, fhi)):
            expect = torch.empty_like(plain).view(m, -1, group)
            expect[:, :, slots] = plain.view(m, -1, group)
            assert torch.equal(ordered, expect.view(m, -1)), f"fragment order {m}x{k} G={group}"
    a, sa, _ = _quantized(2, 96, gen)
    try:
        triton_mm.decode_fp4_halves(a, sa, 32)
    except ValueError as exc:
        assert "fragment_group must be 0, 32 or 64 and divide K/2" in str(exc)
    else:
        raise AssertionError("decode_fp4_halves accepted K/2 = 48 with fragment_group 32")


def case_mm() -> None:
    gen = torch.Generator().manual_seed(2)
    _check_empty_operands(gen)
    _check_alpha_from_global_scales(gen)
    _check_shared_activation(gen)
    _check_offsets_past_int32(torch.Generator().manual_seed(20))  # own stream: the draws below unchanged
    _check_halves_in_fragment_order(torch.Generator().manual_seed(21))
    C = triton_mm.MMConfig
    configs = (C(16, 16, 2, 1, 4, 2), C(32, 16, 4, 2, 4, 2), C(16, 32, 2, 3, 4, 2), C(64, 16, 4, 1, 4, 2))
    for m, n, k in ((3, 5, 48), (1, 5, 16), (130, 37, 64), (17, 70, 160)):
        a, sa, ga = _quantized(m, k, gen)
        b, sb, gb = _quantized(n, k, gen)
        alpha = 1.0 / (ga * gb)
        ref = nvfp4.mm_fp4_reference(a, b, sa, sb, alpha, torch.float64)
        for i, cfg in enumerate(configs):
            dtypes = ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3))
            for out_dtype, tol in dtypes if i == 0 else dtypes[:1]:
                out = triton_mm.mm_fp4_tiled(a, b, sa, sb, alpha, out_dtype, cfg)
                rel = ((out.double() - ref).norm() / ref.norm()).item()
                assert out.dtype == out_dtype and out.shape == (m, n)
                assert rel <= tol, f"mm {m}x{n}x{k} {cfg} {out_dtype}: rel {rel:.2e}"
        deq = triton_mm.dequantize_fp4_triton(a, sa)
        assert torch.equal(deq.float(), nvfp4.dequantize_reference(a, sa)), f"dequant {m}x{k}"
        lo, hi = triton_mm.decode_fp4_halves(a, sa)
        halves = torch.stack((lo.float(), hi.float()), dim=-1).flatten(-2) * 2.0 ** 14
        assert torch.equal(halves, nvfp4.dequantize_reference(a, sa)), f"halves {m}x{k}"
        into = torch.full((m + 2, k), 7.0, dtype=torch.bfloat16)
        triton_mm.dequantize_fp4_triton(a, sa, out=into[1:m + 1])
        assert torch.equal(into[1:m + 1], deq), f"dequant out= {m}x{k}"
        assert (into[0] == 7).all() and (into[m + 1] == 7).all(), f"dequant out= {m}x{k} wrote outside"
        pair = triton_mm.dequantize_fp4_pair_triton(a, sa, b, sb)
        assert torch.equal(pair[0], deq) and torch.equal(pair[1], triton_mm.dequantize_fp4_triton(b, sb)), \
            f"dequant pair {m}x{n}x{k}"
        out = triton_mm.mm_fp4_dequant_mm(a, b, sa, sb, alpha)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel <= 1e-2, f"dequant+mm {m}x{n}x{k}: rel {rel:.2e}"
        # ordered fp32 sum of partials (fp32 out: bitwise; bf16: the interpreter truncates, 1 ulp)
        from fp4fuse.kernels.triton import reduce as triton_reduce
        from fp4fuse.kernels.triton.alpha import GlobalScales
        for dtype in (torch.float32, torch.bfloat16):
            parts = (torch.randn(3, m, n, generator=gen) * 1e3).to(dtype)
            ordered = ((parts[0].float() + parts[1].float()) + parts[2].float()).to(dtype)
            got = triton_reduce.sum_partials_in_order(parts)
            ok = torch.equal(got, ordered) if dtype == torch.float32 else _ulps_ok(got, ordered, 1)
            assert ok, f"sum_partials_in_order {dtype} {m}x{n}"
        # split-K partials (the Gluon GEMM's): fp32 sums in split order, then * 2**28 * alpha, one rounding
        splits = (torch.randn(4, m, n, generator=gen) * 2.0 ** -20).float()
        in_order = ((splits[0] + splits[1]) + splits[2]) + splits[3]
        ga2 = torch.rand(1, generator=gen) + 0.5
        for alpha_form, alpha_value in ((alpha.reshape(1).float(), alpha.reshape(1).float()),
                                        (GlobalScales(ga.reshape(1), ga2), torch.reciprocal(ga.reshape(1) * ga2))):
            for dtype in (torch.float32, torch.bfloat16):
                want = ((in_order * 2.0 ** 28) * alpha_value).to(dtype)
                got = triton_reduce.sum_split_partials(splits, torch.empty(m, n, dtype=dtype), alpha_form)
                ok = torch.equal(got, want) if dtype == torch.float32 else _ulps_ok(got, want, 1)
                assert ok, f"sum_split_partials {dtype} {type(alpha_form).__name__} {m}x{n}"
        # the rounded fp32 product (the interpreter truncates fp32 -> bf16: 1 ulp here, bitwise on
        # CUDA in test_triton_kernels.py)
        x = (torch.randn(m, n, generator=gen) * 100).to(torch.bfloat16)
        got = triton_mm.scale_by_alpha_(x.clone(), alpha.reshape(1).float())
        assert _ulps_ok(got, (x.float() * alpha).to(torch.bfloat16), 1), f"scale_by_alpha_ {m}x{n}"
        out = triton_mm.mm_fp4_triton(a, b, sa, sb, alpha, torch.float32)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel <= 1e-5, f"dispatch {m}x{n}x{k}: rel {rel:.2e}"


def _check_shared_activation(gen: torch.Generator) -> None:
    """Above the decode GEMM's rows, bf16 sibling GEMMs of one activation (dequantize + cuBLAS on
    CPU): ``mm_fp4_calls_triton`` gives each call's own bits with the activation dequantized once
    (``dequantize_fp4_group_triton``: 1 to 6 tensors, in launches of up to 4, each the values of
    its own ``dequantize_fp4_triton``) and the alphas applied together (``scale_by_alphas_``: each
    the rounded fp32 product; mixed alpha forms)."""
    m, k = 300, 48
    a, sa, ga = _quantized(m, k, gen)
    weights = [_quantized(n, k, gen) for n in (40, 24, 24, 8, 16)]
    for count in range(1, 7):
        tensors = [(a, sa), *((b, sb) for b, sb, _ in weights)][:count]
        for got, (q, s) in zip(triton_mm.dequantize_fp4_group_triton(tensors), tensors):
            assert torch.equal(got.float(), nvfp4.dequantize_reference(q, s)), f"dequant group of {count}"
    from fp4fuse.kernels.triton.alpha import GlobalScales
    xs = [(torch.randn(m, n, generator=gen) * 100).to(torch.bfloat16) for n in (40, 24, 24, 8)]
    alphas = [1.0 / (ga * gb) for *_, gb in weights[:4]]
    alphas[1] = GlobalScales(ga, weights[1][2])
    got = triton_mm.scale_by_alphas_([x.clone() for x in xs], alphas)
    for g, x, alpha in zip(got, xs, alphas):
        value = alpha if isinstance(alpha, torch.Tensor) else 1.0 / (alpha.a * alpha.b)
        assert _ulps_ok(g, (x.float() * value).to(torch.bfloat16), 1), "scale_by_alphas_"
        assert torch.equal(g, triton_mm.scale_by_alpha_(x.clone(), alpha)), "scale_by_alphas_ vs scale_by_alpha_"
    other, so, _ = _quantized(m, k, gen)
    calls = [(a, b, sa, sb, 1.0 / (ga * gb), torch.bfloat16) for b, sb, gb in weights[:3]]
    calls.append((other, weights[3][0], so, weights[3][1], 1.0 / (ga * weights[3][2]), torch.bfloat16))
    for got, call in zip(triton_mm.mm_fp4_calls_triton(calls), calls):
        assert torch.equal(got, triton_mm.mm_fp4_triton(*call)), f"shared activation {tuple(call[1].shape)}"
        ref = nvfp4.mm_fp4_reference(*call[:5], torch.float64)
        assert ((got.double() - ref).norm() / ref.norm()).item() <= 1e-2, "shared activation vs float64"


def _check_decode_group(gen: torch.Generator) -> None:
    """``mm_fp4_decode_group``: each product bitwise its own ``mm_fp4_decode`` call, with split
    counts that differ between the segments of one launch (1, 3, 2), 2 and 3 segments, the
    pre-decoded activation, both alpha kinds, 4 products (a launch of 3 and one of 1), and alphas of
    two kinds (separate launches)."""
    from fp4fuse.kernels.triton.alpha import GlobalScales
    C, W = mm_decode.DecodeConfig, mm_decode.DecodeWeight
    cases = ((5, (96, 33, 40), 400, C(16, 32, 64, 1, 4, 2), (1, 3, 2)),
             (70, (40, 72), 160, C(32, 16, 128, 1, 4, 2, None, True), (2, 1)))
    for m, ns, k, cfg, splits in cases:
        a, sa, ga = _quantized(m, k, gen)
        products = [_quantized(n, k, gen) for n in ns]
        configs = [dataclasses.replace(cfg, split_k=s) for s in splits]
        for fold, out_dtype in ((False, torch.float32), (True, torch.bfloat16)):
            weights = [W(b, sb, GlobalScales(ga, gb) if fold else torch.reciprocal(ga * gb)) for b, sb, gb in products]
            got = mm_decode.mm_fp4_decode_group(a, sa, weights, out_dtype, configs)
            for w, c, out in zip(weights, configs, got):
                want = mm_decode.mm_fp4_decode(a, w.b, sa, w.b_scale, w.alpha, out_dtype, c)
                assert torch.equal(out, want), f"decode group {m}x{ns}x{k} {c} fold={fold}"
    m, k = 20, 160
    a, sa, ga = _quantized(m, k, gen)
    products = [_quantized(n, k, gen) for n in (33, 65, 17, 50)]
    for mixed in (False, True):
        weights = [W(b, sb, GlobalScales(ga, gb) if mixed and i == 1 else torch.reciprocal(ga * gb))
                   for i, (b, sb, gb) in enumerate(products)]
        got = mm_decode.mm_fp4_decode_group(a, sa, weights, torch.float32)
        for w, out in zip(weights, got):
            assert torch.equal(out, mm_decode.mm_fp4_decode(a, w.b, sa, w.b_scale, w.alpha, torch.float32)), \
                f"decode group of 4, mixed alphas={mixed}"
    _check_decode_products(gen)


def _check_decode_products(gen: torch.Generator) -> None:
    """``mm_fp4_decode_products`` with one activation per product (one input quantized under each
    product's own static scale): each output bitwise its own ``mm_fp4_decode`` call, with the
    activation decoded in the kernel and pre-decoded, both alpha kinds."""
    from fp4fuse.kernels.triton.alpha import GlobalScales
    C, P = mm_decode.DecodeConfig, mm_decode.DecodeProduct
    cases = ((5, (96, 33, 40), 400, C(16, 32, 64, 1, 4, 2), (1, 3, 2)),
             (70, (40, 72), 160, C(32, 16, 128, 1, 4, 2, None, True), (2, 1)))
    for m, ns, k, cfg, splits in cases:
        x = _rand_blocks(m, k, gen)
        amax = x.abs().amax()
        configs = [dataclasses.replace(cfg, split_k=s) for s in splits]
        for fold, out_dtype in ((False, torch.float32), (True, torch.bfloat16)):
            products = []
            for i, n in enumerate(ns):
                ga = nvfp4.global_scale_from_amax(amax * (1.0 + 0.7 * i)).reshape(1)
                a, sa = nvfp4.quantize_reference(x, ga)
                b, sb, gb = _quantized(n, k, gen)
                products.append(P(a, sa, b, sb, GlobalScales(ga, gb) if fold else torch.reciprocal(ga * gb)))
            got = mm_decode.mm_fp4_decode_products(products, out_dtype, configs)
            for p, c, out in zip(products, configs, got):
                want = mm_decode.mm_fp4_decode(p.a, p.b, p.a_scale, p.b_scale, p.alpha, out_dtype, c)
                assert torch.equal(out, want), f"decode products {m}x{ns}x{k} {c} fold={fold}"


def _in_split_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """The split-K reduction's contract (``mm_decode.finish_tile``), written out: fp32 partials
    added one after another, split 0 first."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _check_decode_split_order(gen: torch.Generator) -> None:
    """Split-K asked for 2 to 7 splits (a partial last K step) is bitwise the fp32 sum, in split
    order, of the splits' own products: each split's K range computed by a one-split
    launch on that slice of the operands, with alpha 1 (the epilogue's scaling by 2**28 is then exact
    and commutes with the sums). Counters are zero after every call."""
    C = mm_decode.DecodeConfig
    m, n, k = 5, 40, 1040  # 17 K steps of 64 elements, the last one partial
    a, sa, _ = _quantized(m, k, gen)
    b, sb, _ = _quantized(n, k, gen)
    one = torch.ones(1)
    step_bytes, step_groups = 32, 4
    for split in range(2, 8):
        cfg = C(16, 32, 64, split, 4, 2)
        steps = -(-(k // 2) // step_bytes)
        iters = -(-steps // split)  # K steps per split; the last split takes what is left
        splits = -(-steps // iters)
        ws = mm_decode.empty_decode_workspace(*mm_decode.decode_workspace_numel(m, n, k, cfg), a.device)
        got = mm_decode.mm_fp4_decode(a, b, sa, sb, one, torch.float32, cfg, workspace=ws)
        assert not ws.counters.any(), f"decode split {split}: counters not reset"
        parts = []
        for s in range(splits):
            cb = slice(s * iters * step_bytes, (s + 1) * iters * step_bytes)
            cg = slice(s * iters * step_groups, (s + 1) * iters * step_groups)
            parts.append(mm_decode.mm_fp4_decode(a[:, cb].contiguous(), b[:, cb].contiguous(), sa[:, cg].contiguous(),
                                                 sb[:, cg].contiguous(), one, torch.float32, C(16, 32, 64, 1, 4, 2)))
        assert torch.equal(got, _in_split_order(parts)), f"decode split {split}: not the sum of its splits in order"


def case_mm_decode() -> None:
    """The one-launch decode GEMM against the float64 reference: odd shapes, every output dtype,
    split counts that do and do not divide the K steps, NaN scales, determinism, workspace reuse."""
    gen = torch.Generator().manual_seed(4)
    _check_decode_group(gen)
    C = mm_decode.DecodeConfig
    # (block_m, block_n, block_k, split_k, warps, stages); K steps of 32 code bytes at block_k 64
    configs = (C(16, 16, 64, 1, 4, 2), C(16, 32, 64, 2, 4, 2), C(32, 16, 128, 3, 4, 2), C(64, 64, 64, 5, 4, 2))
    dtypes = ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3))
    for m, n, k in ((1, 37, 1040), (3, 70, 160), (17, 200, 48), (64, 37, 16), (45, 50, 272)):
        a, sa, ga = _quantized(m, k, gen)
        b, sb, gb = _quantized(n, k, gen)
        alpha = 1.0 / (ga * gb)
        ref = nvfp4.mm_fp4_reference(a, b, sa, sb, alpha, torch.float64)
        for i, cfg in enumerate(configs + (None,)):
            for out_dtype, tol in dtypes if i == 2 else dtypes[:1]:
                out = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, out_dtype, cfg)
                rel = ((out.double() - ref).norm() / ref.norm()).item()
                assert out.dtype == out_dtype and out.shape == (m, n), f"decode {m}x{n}x{k} {cfg}: shape"
                assert rel <= tol, f"decode {m}x{n}x{k} {cfg} {out_dtype}: rel {rel:.2e}"
    # 65-128 rows of a small weight: the default decodes the activation in the kernel, in four 32-row
    # tiles (mm_decode.wide_step_config), here with a partial last K step and a partial token tile
    for m, n, k in ((100, 70, 1040), (65, 37, 272)):
        a, sa, ga = _quantized(m, k, gen)
        b, sb, gb = _quantized(n, k, gen)
        alpha = 1.0 / (ga * gb)
        cfg = mm_decode.decode_config_for(m, n, k, 132)
        assert (cfg.block_m, cfg.predecode) == (32, False), f"decode {m}x{n}x{k}: default {cfg}"
        ref = nvfp4.mm_fp4_reference(a, b, sa, sb, alpha, torch.float64)
        out = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.float32)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel <= 1e-5, f"decode {m}x{n}x{k} {cfg}: rel {rel:.2e}"
    # split 3 over 17 K steps (6, 6, 5): bitwise repeatable, counters back to zero, buffer reusable
    m, n, k = 17, 70, 1040
    a, sa, ga = _quantized(m, k, gen)
    b, sb, gb = _quantized(n, k, gen)
    alpha = 1.0 / (ga * gb)
    cfg = C(16, 32, 64, 3, 4, 2)
    ws = mm_decode.empty_decode_workspace(*mm_decode.decode_workspace_numel(m, n, k, cfg), a.device)
    first = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.float32, cfg, workspace=ws)
    assert not ws.counters.any(), "decode: counters not reset"
    again = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.float32, cfg, workspace=ws)
    assert torch.equal(first, again) and not ws.counters.any(), "decode: second call differs"
    fresh = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.float32, cfg)
    assert torch.equal(first, fresh), "decode: a fresh workspace gives other bits"
    # a NaN activation block scale poisons exactly its row, through the split reduction
    sa_nan = sa.clone()
    sa_nan.view(torch.uint8)[5, 40] = 0x7F
    out = mm_decode.mm_fp4_decode(a, b, sa_nan, sb, alpha, torch.bfloat16, cfg, workspace=ws)
    assert torch.isnan(out[5]).all(), "decode: NaN scale lost"
    assert torch.isfinite(out[:5]).all() and torch.isfinite(out[6:]).all(), "decode: NaN leaked"
    assert not ws.counters.any(), "decode: counters not reset after NaN call"
    _check_decode_split_order(gen)
    # K / 16 a multiple of 4: the activation scales load as int32 words (a partial last K step: the
    # word mask); a view of them 1 byte off a word boundary takes the byte loads. Both give the
    # float64 reference and the same bits.
    m, n, k = 17, 37, 576
    a, sa, ga = _quantized(m, k, gen)
    b, sb, gb = _quantized(n, k, gen)
    alpha = 1.0 / (ga * gb)
    ref = nvfp4.mm_fp4_reference(a, b, sa, sb, alpha, torch.float64)
    shifted = torch.empty(sa.numel() + 1, dtype=torch.uint8)[1:].view(sa.shape)
    shifted.copy_(sa.view(torch.uint8))
    shifted = shifted.view(torch.float8_e4m3fn)
    assert shifted.data_ptr() % 4 != 0 and sa.data_ptr() % 4 == 0
    for cfg in (C(16, 32, 128, 3, 4, 2, scale_words=True), C(32, 16, 256, 1, 4, 2, scale_words=True)):
        words = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.float32, cfg)
        rel = ((words.double() - ref).norm() / ref.norm()).item()
        assert rel <= 1e-5, f"decode {m}x{n}x{k} {cfg}, scale words: rel {rel:.2e}"
        assert torch.equal(words, mm_decode.mm_fp4_decode(a, b, shifted, sb, alpha, torch.float32, cfg)), \
            f"decode {m}x{n}x{k} {cfg}: scale words and bytes differ"
    sa_nan = sa.clone()
    sa_nan.view(torch.uint8)[5, 25] = 0x7F
    out = mm_decode.mm_fp4_decode(a, b, sa_nan, sb, alpha, torch.bfloat16, C(16, 32, 128, 3, 4, 2, scale_words=True))
    assert torch.isnan(out[5]).all() and torch.isfinite(out[:5]).all() and torch.isfinite(out[6:]).all(), \
        "decode, scale words: NaN scale not confined to its row"
    for m, n in ((0, 5), (4, 0)):
        empty = mm_decode.mm_fp4_decode(a[:m], b[:n], sa[:m], sb[:n], alpha, torch.bfloat16, cfg)
        assert empty.shape == (m, n), "decode: empty shapes"
    # the pre-decoded activation: planes equal to the oracle's values (in the step's permuted order
    # the multiset of each step's values), the product against the reference, a partial last step
    for m, n, k, block_k in ((37, 70, 1040, 128), (70, 37, 160, 64)):
        a, sa, ga = _quantized(m, k, gen)
        b, sb, gb = _quantized(n, k, gen)
        alpha = 1.0 / (ga * gb)
        lo, hi = mm_decode.predecode_activation(a, sa, block_k)
        bkb = block_k // 2
        assert lo.shape == (m, -(-k // block_k) * bkb), f"predecode {m}x{k}: plane shape {lo.shape}"
        dense = oracle.dequantize(a, sa).double() * 2.0 ** -14
        for step in range(lo.shape[1] // bkb):
            cols = slice(step * bkb, (step + 1) * bkb)
            got = torch.cat((lo[:, cols], hi[:, cols]), dim=1).double().sort(dim=1).values
            want = dense[:, step * block_k:(step + 1) * block_k]
            want = torch.cat((want, want.new_zeros(m, block_k - want.shape[1])), dim=1).sort(dim=1).values
            assert torch.equal(got, want), f"predecode {m}x{k}: step {step} values differ"
        ref = nvfp4.mm_fp4_reference(a, b, sa, sb, alpha, torch.float64)
        for split in (1, 3):
            cfg = C(32, 16, block_k, split, 4, 2, None, True)
            out = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.float32, cfg)
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            assert rel <= 1e-5, f"predecoded decode {m}x{n}x{k} {cfg}: rel {rel:.2e}"
            fused = mm_decode.mm_fp4_decode(a, b, sa, sb, alpha, torch.float32,
                                            dataclasses.replace(cfg, predecode=False))
            assert torch.equal(out, fused), f"predecoded decode {m}x{n}x{k} {cfg}: differs from in-kernel decode"
    # the default rule: split never beyond what fills one wave, and at least one K step per split
    for n, k in ((3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168), (8192, 8192), (28672, 8192),
                 (8192, 28672)):
        for m in (1, 4, 16, 32, 64, 128):
            cfg = mm_decode.decode_config_for(m, n, k, 132)
            plan = mm_decode._plan(cfg, m, n, k)
            assert 1 <= plan.split <= mm_decode.MAX_SPLIT and plan.iters_per_split >= 1, (m, n, k, cfg)


def _ulps_ok(out: torch.Tensor, ref: torch.Tensor, ulps: int) -> bool:
    """|out - ref| within ``ulps`` units in the last place of ref's dtype (fp32 for fp32)."""
    eps = torch.finfo(ref.dtype).eps
    tol = ulps * eps * ref.float().abs() + torch.finfo(ref.dtype).tiny
    return bool(((out.float() - ref.float()).abs() <= tol).all())


def case_norm() -> None:
    # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: allow 2 ulps here;
    # the CUDA tests hold the GPU to 1 ulp and an exact residual sum.
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for t, h in ((3, 48), (5, 1000), (2, triton_norm.MAX_SINGLE_PASS + 1000)):
            x = torch.randn(t, h, generator=gen).to(dtype)
            r = torch.randn(t, h, generator=gen).to(dtype)
            w = (torch.rand(h, generator=gen) + 0.5).to(dtype)
            out = triton_norm.rms_norm_triton(x, w, 1e-6)
            assert _ulps_ok(out, rms_norm_reference(x, w, 1e-6), 2), f"rms_norm {dtype} {t}x{h}"
            out, res = triton_norm.fused_add_rms_norm_triton(x, r, w, 1e-6)
            ref_out, ref_res = fused_add_rms_norm_reference(x, r, w, 1e-6)
            assert _ulps_ok(res, ref_res, 1), f"fused_add residual {dtype} {t}x{h}"
            assert _ulps_ok(out, ref_out, 3), f"fused_add out {dtype} {t}x{h}"


def case_norm_quant() -> None:
    """Fused norm + quantize == the reference quantizer applied to the Triton norm's output, bit
    for bit (the interpreter truncates fp32 -> bf16 in both kernels alike; on CUDA,
    tests/test_triton_kernels.py also compares with the Triton quantization kernel), and the
    residual sum equals the norm kernel's."""
    gen = torch.Generator().manual_seed(4)
    eps = 1e-6
    cases = ((torch.bfloat16, 3, 48), (torch.bfloat16, 5, 1040), (torch.float16, 2, 4112), (torch.float32, 3, 208),
             (torch.bfloat16, 2, triton_norm.MAX_SINGLE_PASS + 1040))
    for dtype, t, h in cases:
        x = (torch.randn(t, h, generator=gen) * _rand_blocks(t, h, gen, 1.0).abs().clamp(min=1e-3) * 4).to(dtype)
        r = torch.randn(t, h, generator=gen).to(dtype)
        w = (torch.rand(h, generator=gen) + 0.5).to(dtype)
        x[0, 3] = -0.0
        x[-1, :16] = 0.0
        gs = nvfp4.global_scale_from_amax(rms_norm_reference(x, w, eps).float().abs().amax()).reshape(1)
        out = triton_norm.rms_norm_triton(x, w, eps)
        assert _ulps_ok(out, rms_norm_reference(x, w, eps), 2), f"norm {dtype} {t}x{h}"
        rq, rs = nvfp4.quantize_reference(out, gs)
        q, s = triton_norm_quant.rms_norm_fp4_quant_triton(x, w, eps, gs)
        where = f"rms_norm_fp4_quant {dtype} {t}x{h}"
        assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), where + ": scales differ"
        assert torch.equal(q, rq), where + ": codes differ"
        out, res = triton_norm.fused_add_rms_norm_triton(x, r, w, eps)
        rq, rs = nvfp4.quantize_reference(out, gs)
        q, s, res_out = triton_norm_quant.fused_add_rms_norm_fp4_quant_triton(x, r, w, eps, gs)
        where = f"fused_add_rms_norm_fp4_quant {dtype} {t}x{h}"
        assert torch.equal(res_out, res), where + ": residual differs"
        assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), where + ": scales differ"
        assert torch.equal(q, rq), where + ": codes differ"
    # norm + amax (for a dynamic global scale): the same output, amax = max |out|, NaN propagates
    for dtype, t, h in ((torch.bfloat16, 3, 48), (torch.float32, 2, triton_norm.MAX_SINGLE_PASS + 1040)):
        x = torch.randn(t, h, generator=gen).to(dtype)
        r = torch.randn(t, h, generator=gen).to(dtype)
        w = (torch.rand(h, generator=gen) + 0.5).to(dtype)
        out, amax = triton_norm.rms_norm_amax_triton(x, w, eps)
        assert torch.equal(out, triton_norm.rms_norm_triton(x, w, eps)), f"norm amax out {dtype} {t}x{h}"
        assert amax.item() == out.float().abs().amax().item(), f"norm amax {dtype} {t}x{h}"
        out, res, amax = triton_norm.fused_add_rms_norm_amax_triton(x, r, w, eps)
        assert amax.item() == out.float().abs().amax().item(), f"fused_add norm amax {dtype} {t}x{h}"
        x[-1, 5] = float("nan")
        assert torch.isnan(triton_norm.rms_norm_amax_triton(x, w, eps)[1]).all(), f"norm amax NaN {dtype}"
    # the pure-torch compositions are what they say
    x = torch.randn(3, 48, generator=gen).to(torch.bfloat16)
    r = torch.randn(3, 48, generator=gen).to(torch.bfloat16)
    w = torch.rand(48, generator=gen).to(torch.bfloat16) + 0.5
    gs = torch.tensor([100.0])
    q, s = rms_norm_fp4_quant_reference(x, w, eps, gs)
    rq, rs = nvfp4.quantize_reference(rms_norm_reference(x, w, eps), gs)
    assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), "reference composition"
    q, s, res = fused_add_rms_norm_fp4_quant_reference(x, r, w, eps, gs)
    out, rres = fused_add_rms_norm_reference(x, r, w, eps)
    rq, rs = nvfp4.quantize_reference(out, gs)
    assert torch.equal(q, rq) and torch.equal(res, rres), "fused reference composition"


def _check_offsets_past_int32(gen: torch.Generator) -> None:
    """Element offsets past 2**31 (a weight of N * K/2 >= 2**31 code bytes; ``W * n >= 2**31``
    partials): ``_mm_fp4_kernel`` and ``_sum_in_order_kernel`` computed them as int32 products,
    which wrapped (reads before the operand: a crash here, another allocation's bytes on a GPU).
    One program of each, launched directly, on buffers allocated but written only where it reads
    (the OS commits the pages written): address space, not memory. Expected values: the oracle."""
    try:
        kb = (1 << 24) + (1 << 20)  # K/2 code bytes a row: weight rows from 121 on start past 2**31
        w = torch.empty((128, kb), dtype=torch.uint8)
        ws = torch.empty((128, kb // 8), dtype=torch.float8_e4m3fn)
        xlo, xhi = (torch.empty((16, kb), dtype=torch.float16) for _ in range(2))
    except (RuntimeError, MemoryError) as exc:  # an address space this small cannot reach the bug
        print(f"offsets past int32: skipped ({exc})", flush=True)
        return
    # the tiled GEMM's one K step of 2 groups (32 elements) on 16 activation x 128 weight rows
    a, sa, _ = _quantized(16, 32, gen)
    b, sb, _ = _quantized(128, 32, gen)
    dense = oracle.dequantize(a, sa) * 2.0 ** -14  # the GEMM's fp16 operand encoding (exact)
    xlo[:, :16], xhi[:, :16] = dense[:, 0::2].half(), dense[:, 1::2].half()
    w[:, :16], ws[:, :2] = b, sb
    out = torch.empty((16, 128), dtype=torch.float32)
    one = torch.ones(1)
    triton_mm._mm_fp4_kernel[(1, 1)](xlo, xhi, w, ws, one, one, out, 16, 128, kb // 8, 2, BLOCK_M=16,
                                     BLOCK_N=128, BLOCK_G=2, GROUP_M=8, PARTIAL=False, EVEN_K=True,
                                     FAST_DECODE=False)
    ref = oracle.dequantize(a, sa) @ oracle.dequantize(b, sb).T
    bad = ((out.double() - ref).abs() > 1e-6 * ref.abs().max().item()).any(0)
    assert not bad.any(), f"tiled GEMM, weight rows past 2**31 code bytes wrong: {bad.nonzero().flatten().tolist()}"
    del w, ws, xlo, xhi
    # the ordered sum's first 2048 elements of 3 partials of 2**30 + 2048 (the third starts past 2**31)
    from fp4fuse.kernels.triton import reduce as triton_reduce
    n = (1 << 30) + 2048
    try:
        parts = torch.empty(3 * n, dtype=torch.uint8)
    except (RuntimeError, MemoryError) as exc:
        print(f"offsets past int32 (ordered sum): skipped ({exc})", flush=True)
        return
    for i in range(3):
        parts[i * n:i * n + 2048] = torch.randint(0, 64, (2048,), generator=gen, dtype=torch.uint8)
    got = torch.empty(2048, dtype=torch.float32)
    triton_reduce._sum_in_order_kernel[(1,)](parts, got, parts, parts, n, 3, BLOCK=2048)
    want = sum(parts[i * n:i * n + 2048].double() for i in range(3))
    assert torch.equal(got.double(), want), "sum_partials_in_order: partials past 2**31 elements"


CASES = {"quant": case_quant, "mm": case_mm, "mm_decode": case_mm_decode, "norm": case_norm,
         "norm_quant": case_norm_quant}


if __name__ == "__main__":
    _fix_interpreter_loop_bounds()
    for name in sys.argv[1:] or list(CASES):
        CASES[name]()
        print(f"{name}: ok", flush=True)
