"""End to end, TP=2 on gloo: static activation scales held as buffers, the run-time rank check,
3-D activations and Hugging Face's norm form.

The model mirrors a Hugging Face decoder's structure on fp4fuse's ops (written here, so the test
depends on nothing but the ops): ``[batch, seq]`` token ids, a vocab-parallel embedding (its
all-reduce starts the residual stream), per layer ``LlamaRMSNorm`` (fp32 statistics, ``weight *
x.to(dtype)``) -> column-parallel gate/up -> SwiGLU -> row-parallel down (all-reduce of the 2-D
rows, viewed back to ``[batch, seq, hidden]``) -> ``residual + hidden`` in bf16; a final norm.
Every NVFP4 linear quantizes its input with a static global scale held as a buffer, as a
calibrated checkpoint's ``input_scale`` is.

Expected fusions for L layers (fp4fuse.FusionPass(FusionConfig(enable_async_tp=True))):
sequence_parallel first / middle / last = 1 / L-1 / 1 (``torch_fp32``, the HF form),
quant_before_gather = L (the gate/up input, its scale a buffer), async_tp all_gather_mm_fp4 = L,
mm_fp4_reduce_scatter = L. The rewrites rely on 2L+1 tensors of model state being the same on
every rank (L+1 norm weights, L input scales), which the compiled graph verifies on its first call.

One spawn of two ranks checks: the counts and bitwise equality with the same model compiled
without fp4fuse at batch 1 (``[1, 4, hidden]``, 2 tokens per rank); the check comes before every collective
in Inductor's code; a rank holding a different input scale or norm weight gets the error naming
it (on both ranks, no hang, no output); ``rank_check='off'`` runs that model without a check and
returns a different answer than the graph without the pass (what the check is there to stop).
"""
from __future__ import annotations

import re

import pytest
import torch

from dist_utils import COMPILE_THREADS, run_on_ranks

WORLD = 2
LAYERS = 2
HIDDEN, INTER, VOCAB, SEQ = 64, 128, 64, 4
TIMEOUT_S = 600.0
BATCHES = (1,)  # each batch compiles both graphs again (static shapes)


def expected_counts(layers: int) -> dict[str, int]:
    return {"sequence_parallel.first.torch_fp32": 1, "sequence_parallel.middle.torch_fp32": layers - 1,
            "sequence_parallel.last.torch_fp32": 1, "sequence_parallel.quant_before_gather": layers,
            "async_tp.all_gather_mm_fp4": layers, "async_tp.mm_fp4_reduce_scatter": layers}


def _rank_main(cache_dir: str) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F
    from torch import nn
    from torch._inductor.utils import run_and_get_code

    import fp4fuse  # noqa: F401  (registers the ops)
    from fp4fuse.config import FusionConfig
    from fp4fuse.distributed.rank_check import RankMismatchError
    from fp4fuse.nvfp4.format import global_scale_from_amax
    from fp4fuse.passes.manager import FusionPass

    group, rank = dist.group.WORLD.group_name, dist.get_rank()
    fp4 = torch.ops.fp4fuse

    def seeded(name: str, *shape: int, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(shape))
        return (torch.randn(shape, generator=gen) * std + mean).to(torch.bfloat16)

    class Embedding(nn.Module):
        """Vocab-parallel: rank r looks up its rows, zeros elsewhere; the partial lookups are summed."""

        def __init__(self) -> None:
            super().__init__()
            rows = VOCAB // WORLD
            self.start = rank * rows
            self.weight = nn.Parameter(seeded("embed", VOCAB, HIDDEN)[self.start:self.start + rows].clone(),
                                       requires_grad=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            local = (ids >= self.start) & (ids < self.start + self.weight.shape[0])
            out = F.embedding(torch.where(local, ids - self.start, 0), self.weight)
            return funcol.all_reduce(torch.where(local.unsqueeze(-1), out, 0), "sum", group)

    class LlamaRMSNorm(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.weight = nn.Parameter(seeded(name, HIDDEN, mean=1.0, std=0.1), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            xf = x.to(torch.float32)
            variance = xf.pow(2).mean(-1, keepdim=True)
            return self.weight * (xf * torch.rsqrt(variance + 1e-6)).to(x.dtype)

    class StaticScaleNVFP4Linear(nn.Module):
        """Column- or row-parallel NVFP4 linear; the activation's global scale is a buffer."""

        def __init__(self, name: str, parts: list[torch.Tensor], rowwise: bool, input_scale: float) -> None:
            super().__init__()
            full = torch.cat(parts)
            local = torch.cat([p.chunk(WORLD, dim=1 if rowwise else 0)[rank] for p in parts]).contiguous()
            gs = global_scale_from_amax(full.float().abs().amax().reshape(1))
            q, s = fp4.scaled_fp4_quant(local, gs)
            self.register_buffer("weight_q", q)
            self.register_buffer("weight_scale", s)
            self.register_buffer("weight_global_scale", gs)
            self.register_buffer("input_scale", torch.tensor([input_scale]))
            self.rowwise = rowwise

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1])
            q, s = fp4.scaled_fp4_quant(rows, self.input_scale)
            alpha = torch.reciprocal(self.input_scale * self.weight_global_scale)
            y = fp4.mm_fp4(q, self.weight_q, s, self.weight_scale, alpha, torch.bfloat16)
            if self.rowwise:
                y = funcol.all_reduce(y, "sum", group)
            return y.view(*x.shape[:-1], -1)

    class Layer(nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.norm = LlamaRMSNorm(f"layers.{i}.norm")
            gate, up = (seeded(f"layers.{i}.{p}", INTER, HIDDEN, std=HIDDEN ** -0.5) for p in ("gate", "up"))
            self.gate_up = StaticScaleNVFP4Linear(f"layers.{i}.gate_up", [gate, up], False, 448 * 6 / 4.0)
            self.down = StaticScaleNVFP4Linear(f"layers.{i}.down", [seeded(f"layers.{i}.down", HIDDEN, INTER,
                                                                          std=INTER ** -0.5)], True, 448 * 6 / 2.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
            return x + self.down((F.silu(gate.float()) * up.float()).to(x.dtype))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = Embedding()
            self.layers = nn.ModuleList(Layer(i) for i in range(LAYERS))
            self.norm = LlamaRMSNorm("norm")

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    def ids(batch: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(batch))

    def compiled(model: nn.Module, fusion: FusionPass) -> torch.nn.Module:
        return torch.compile(model, dynamic=False, options={"post_grad_custom_post_pass": fusion})

    out: dict = {"runs": []}
    model = Model()
    fusion = FusionPass(FusionConfig(enable_async_tp=True))
    fused, unfused = compiled(model, fusion), compiled(model, FusionPass())
    with torch.no_grad():
        for batch in BATCHES:
            result, code = run_and_get_code(fused, ids(batch))
            reference = unfused(ids(batch))
            call = code[0][code[0].index("def call("):]
            out["runs"].append({
                "batch": batch, "equal": bool(torch.equal(result, reference)), "shape": tuple(result.shape),
                "counts": {k: v for k, v in fusion.last_match_counts.items() if k.startswith(("sequence", "async"))},
                "skips": [(s.key, s.reason) for s in fusion.last_skips if s.key.startswith(("sequence", "async"))],
                "checked": [site.labels for site in fusion.passes[1].rank_checks],
                "check_first": call.index("check_rank_uniform") < call.index("_c10d_functional"),
            })

        def differing(tensor_of) -> Model:
            bad = Model()
            if rank == 1:
                tensor_of(bad).mul_(1.25)
            return bad

        errors = {}
        for what, tensor_of in (("input_scale", lambda m: m.layers[0].gate_up.input_scale),
                                ("norm_weight", lambda m: m.layers[1].norm.weight)):
            try:
                compiled(differing(tensor_of), fusion)(ids(1))
                errors[what] = None
            except RankMismatchError as err:
                errors[what] = str(err)
        out["errors"] = errors

        unchecked = FusionPass(FusionConfig(enable_async_tp=True, rank_check="off"))
        bad = differing(lambda m: m.layers[0].gate_up.input_scale)
        off = compiled(bad, unchecked)(ids(1))
        out["off"] = {"equal": bool(torch.equal(off, compiled(bad, FusionPass())(ids(1)))),
                      "checked": [site.labels for site in unchecked.passes[1].rank_checks],
                      "counts": {k: v for k, v in unchecked.last_match_counts.items() if k.startswith("sequence")}}
    return out


@pytest.fixture(scope="module")
def results(rank_inductor_cache) -> list[dict]:
    return run_on_ranks(_rank_main, WORLD, rank_inductor_cache, timeout=TIMEOUT_S, backend="gloo",
                        env={"TORCHINDUCTOR_CACHE_DIR": rank_inductor_cache,
                             "TORCHINDUCTOR_COMPILE_THREADS": COMPILE_THREADS})


def test_static_scales_fuse_and_match_the_unfused_graph_bitwise(results):
    for per_rank in results:
        for run in per_rank["runs"]:
            assert run["shape"] == (run["batch"], SEQ, HIDDEN)
            assert run["counts"] == expected_counts(LAYERS), run
            assert run["skips"] == [], run["skips"]
            assert run["equal"], f"batch {run['batch']}: fused output differs from the unfused compiled graph"


def test_the_check_covers_the_model_state_the_rewrites_rely_on(results):
    (labels,) = results[0]["runs"][0]["checked"]
    sources = [re.sub(r"^\S+ \((.*)\)$", r"\1", label) for label in labels]
    expected = {f"L['self'].layers[{i}].norm.weight" for i in range(LAYERS)} | {"L['self'].norm.weight"}
    expected |= {f"L['self'].layers[{i}].gate_up.input_scale" for i in range(LAYERS)}
    assert set(sources) == expected
    assert all(run["check_first"] for per_rank in results for run in per_rank["runs"])


@pytest.mark.parametrize("what, source", [
    ("input_scale", "L['self'].layers[0].gate_up.input_scale"),
    ("norm_weight", "L['self'].layers[1].norm.weight"),
])
def test_a_rank_with_different_model_state_gets_a_clear_error(results, what, source):
    for per_rank in results:
        message = per_rank["errors"][what]
        assert message is not None, f"{what} differs on rank 1 and nothing was raised"
        assert f"({source}): differs from rank 0's on rank 1" in message
        assert message.count("differs from rank 0's") == 1  # only the tensor that differs is named


def test_rank_check_off_runs_unchecked(results):
    for per_rank in results:
        off = per_rank["off"]
        assert off["checked"] == [] and off["counts"]["sequence_parallel.quant_before_gather"] == LAYERS
        assert not off["equal"]  # rank 1's other scale changed the answer: the check is what stops this
