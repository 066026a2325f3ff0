"""RMSNorm followed by NVFP4 quantization, fused into one op (static global scales).

fp4fuse's norm ops feeding ``scaled_fp4_quant`` become the fused norm + quantize ops, which read
the input once and never write the norm output (fp4fuse.ops.norm_ops)::

    before:  out = rms_norm(x, w, eps)                  after:  q, s = rms_norm_fp4_quant(x, w, eps, gs)
             q, s = scaled_fp4_quant(out, gs)

    before:  out, r = fused_add_rms_norm(x, res, w, eps)    after:  q, s, r = fused_add_rms_norm_fp4_quant(
             q, s = scaled_fp4_quant(out, gs)                                  x, res, w, eps, gs)

Several quants of one norm output with the same global-scale node share one fused op. The fused
ops compute ``scaled_fp4_quant(norm(...))`` bit for bit on every backend, so the rewrite is exact.
It fires only where nothing else needs the norm output (``check``, the reason logged otherwise):

* every reader of the norm output is a ``scaled_fp4_quant`` reading it directly (no-op views are
  folded first, fp4fuse.passes.cleanup), all with one global-scale node. A norm output read by
  anything else would keep the norm for that reader, re-reading the input: not measured to pay,
  so left alone. A dynamic scale is such a reader (``448 * 6 / amax(norm output)`` needs the
  whole output before the first element is quantized), and reported as one;
* the arguments satisfy the fused op's rules (fp4fuse.ops.validation: the same as the two ops');
* the fused op can take the norm's place or the first quant's: the global scale is defined before
  it and every reader of the residual sum comes after it.

Norms written in torch ops (``F.rms_norm``, ``x * rsqrt(mean(x^2) + eps) * w``, Hugging Face's
``LlamaRMSNorm``: the families of fp4fuse.patterns.sequence_parallel, traced the same way) are
not fused: Inductor generates their code, with its own reduction order and roundings (the Hugging
Face form rounds ``x * rsqrt(...)`` to x's dtype before multiplying by the weight), so the fused
op would not be bitwise equal to the graph it replaces. A quant of one is recorded as skipped
(key ``norm_quant.torch_norm``) with the reason.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._inductor import pattern_matcher as pm

from fp4fuse.config import FusionConfig
from fp4fuse.ops import norm_ops, validation  # noqa: F401  (norm_ops registers the fused ops)
from fp4fuse.patterns.base import (
    GraphRewrite, MatchRecorder, QuantCall, aot_trace, erase_if_unused, fake_value, get_arg, insert_call, is_call,
    registration_mode,
)
from fp4fuse.patterns.sequence_parallel import (
    EXAMPLE_EPS, NORM_SETS, NormFamily, TorchFP32Norm, TorchFunctionalNorm, TorchManualNorm, TorchOffsetFP32Norm,
)

__all__ = ["NormQuantFusion", "NormQuantMatch", "TorchNormQuants"]

aten = torch.ops.aten
fp4 = torch.ops.fp4fuse
QUANT = fp4.scaled_fp4_quant.default
NORM = fp4.rms_norm.default
ADD_NORM = fp4.fused_add_rms_norm.default
#: norm op -> (fused op, pattern key it counts under)
FUSED_OPS = {
    NORM: (fp4.rms_norm_fp4_quant.default, "rms_norm_fp4_quant"),
    ADD_NORM: (fp4.fused_add_rms_norm_fp4_quant.default, "fused_add_rms_norm_fp4_quant"),
}
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@dataclasses.dataclass(frozen=True)
class NormQuantMatch:
    """An fp4fuse norm whose output some ``scaled_fp4_quant`` reads.

    Attributes:
        norm: the ``rms_norm`` / ``fused_add_rms_norm`` call.
        residual_outs: the ``getitem(norm, 1)`` nodes (the residual sum; fused add only).
        quants: the quants reading the norm output, graph order.
        others: every other reader of the norm output (or of the norm, other than by getitem).
    """

    norm: fx.Node
    residual_outs: tuple[fx.Node, ...]
    quants: tuple[QuantCall, ...]
    others: tuple[fx.Node, ...]

    @property
    def fused_op(self) -> Any:
        return FUSED_OPS[self.norm.target][0]

    @property
    def key(self) -> str:
        return FUSED_OPS[self.norm.target][1]

    def norm_args(self) -> tuple[Any, ...]:
        """``(x, [residual,] weight, eps)`` of the norm call."""
        if self.norm.target is NORM:
            return (get_arg(self.norm, 0, "x"), get_arg(self.norm, 1, "weight"), get_arg(self.norm, 2, "eps"))
        return (get_arg(self.norm, 0, "x"), get_arg(self.norm, 1, "residual"), get_arg(self.norm, 2, "weight"),
                get_arg(self.norm, 3, "eps"))

    @classmethod
    def decode(cls, norm: fx.Node, order: _NodeOrder) -> NormQuantMatch | None:
        """The match at ``norm`` (an fp4fuse norm call), or None when no quant reads its output."""
        if norm.target is NORM:
            outputs, residual_outs, others = [norm], [], []
        else:
            by_index: dict[Any, list[fx.Node]] = {}
            others = []
            for user in norm.users:
                if is_call(user, operator.getitem):
                    by_index.setdefault(user.args[1], []).append(user)
                else:
                    others.append(user)
            outputs, residual_outs = by_index.get(0, []), by_index.get(1, [])
        quants = []
        for out in outputs:
            for user in out.users:
                if is_call(user, QUANT) and get_arg(user, 0, "x") is out:
                    quants.append(QuantCall.of(user))
                else:
                    others.append(user)
        if not quants:
            return None
        return cls(norm, tuple(residual_outs), tuple(sorted(quants, key=lambda q: order(q.quant))), tuple(others))


class _NodeOrder:
    """Positions of the nodes of one graph (recomputed when a rewrite has added nodes)."""

    def __init__(self, graph: fx.Graph) -> None:
        self.index = {n: i for i, n in enumerate(graph.nodes)}

    def __call__(self, node: fx.Node) -> int:
        if node not in self.index:  # inserted by an earlier rewrite: the order of the others holds
            self.index = {n: i for i, n in enumerate(node.graph.nodes)}
        return self.index[node]


def _depends_on(node: fx.Node, targets: set[fx.Node], stop_before: int, order: _NodeOrder) -> bool:
    """Whether ``node`` is computed from any of ``targets``, searching its inputs back to graph
    position ``stop_before`` (nothing earlier can depend on a target placed there or later)."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n in seen or order(n) < stop_before:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


class NormQuantFusion(GraphRewrite[NormQuantMatch]):
    """fp4fuse norm -> ``scaled_fp4_quant`` becomes the fused norm + quantize op (module docstring)."""

    name = "fused_norm_quant"

    def __init__(self, config: FusionConfig) -> None:
        super().__init__(config)
        self._order: _NodeOrder | None = None

    def apply(self, graph: fx.Graph, recorder: MatchRecorder) -> int:
        """:meth:`GraphRewrite.apply`, holding the graph's node order only for the call (a pass
        keeps no graph state: Inductor deep-copies its config, this pass included, per compile)."""
        self._order = _NodeOrder(graph)
        try:
            return super().apply(graph, recorder)
        finally:
            self._order = None

    def find(self, graph: fx.Graph) -> list[NormQuantMatch]:
        assert self._order is not None
        found = []
        for node in graph.nodes:
            if node.op == "call_function" and node.target in FUSED_OPS:
                match = NormQuantMatch.decode(node, self._order)
                if match is not None:
                    found.append(match)
        return found

    def anchor(self, match: NormQuantMatch) -> fx.Node:
        return match.norm

    def check(self, match: NormQuantMatch) -> str | None:
        order = self._order
        assert order is not None
        scales = {q.global_scale for q in match.quants}
        if match.others:
            outputs = {match.norm} if match.norm.target is NORM else {
                u for u in match.norm.users if is_call(u, operator.getitem) and u.args[1] == 0}
            if any(_depends_on(s, outputs, order(match.norm), order) for s in scales if isinstance(s, fx.Node)):
                return ("the global scale is computed from the norm output (a dynamic scale: amax of the whole "
                        "output); the fused op takes the scale as an input")
            return (f"the norm output is also read by {[n.name for n in match.others]}: fusing would keep the "
                    "norm for them and read its input twice (not measured to pay)")
        if len(scales) > 1:
            return (f"the norm output is quantized with {len(scales)} different global-scale nodes "
                    f"({sorted(getattr(s, 'name', repr(s)) for s in scales)}); one fused op per scale would "
                    "read the norm's input once per scale (not measured to pay)")
        if any(not is_call(u, operator.getitem) for q in match.quants for u in q.outputs):
            return "a quant's outputs are read other than through getitem"
        (scale,) = scales
        x, *residual, weight, eps = (fake_value(a) if isinstance(a, fx.Node) else a for a in match.norm_args())
        try:
            validation.check_norm_quant_inputs(match.key, x, weight, eps, fake_value(scale), *residual)
        except ValueError as exc:
            return f"the fused op does not accept the arguments: {exc}"
        at = order(self._insertion_point(match, scale))
        late = [n.name for r in match.residual_outs for n in r.users if order(n) < at]
        if late:
            return (f"the global scale {scale.name} is defined after the norm and the residual sum is read by "
                    f"{late} before the first quant: the fused op has no place that serves both")
        return None

    def _insertion_point(self, match: NormQuantMatch, scale: fx.Node) -> fx.Node:
        """The node the fused op goes before: the norm if the global scale is defined before it,
        else the first quant."""
        order = self._order
        assert order is not None
        return match.norm if order(scale) < order(match.norm) else match.quants[0].quant

    def rewrite(self, match: NormQuantMatch) -> str:
        """Insert the fused op at :meth:`_insertion_point`, point the quants' and the residual
        sum's readers at its outputs, erase the norm and the quants."""
        graph = match.norm.graph
        scale = match.quants[0].global_scale
        with graph.inserting_before(self._insertion_point(match, scale)):
            fused = insert_call(graph, match.fused_op, (*match.norm_args(), scale))
            outputs = [insert_call(graph, operator.getitem, (fused, i)) for i in range(len(fake_value(fused)))]
        for q in match.quants:
            for out in q.outputs:
                out.replace_all_uses_with(outputs[out.args[1]])
            erase_if_unused([*q.outputs, q.quant])
        for r in match.residual_outs:
            r.replace_all_uses_with(outputs[2])
        erase_if_unused([*match.residual_outs, *(u for u in match.norm.users), match.norm])
        erase_if_unused(outputs)
        return match.key


# --------------------------------------------------------------------------- torch-form norms (not fused)

#: The torch norm forms (fp4fuse.patterns.sequence_parallel) and how each is written, for the skip reason.
_TORCH_FORMS = {
    TorchFunctionalNorm: "F.rms_norm",
    TorchManualNorm: "x * rsqrt(mean(x^2) + eps) * weight in x's dtype",
    TorchFP32Norm: "the Hugging Face LlamaRMSNorm form, weight * (x.float() * rsqrt(...)).to(dtype): "
                   "rounded to x's dtype before the weight multiply",
    TorchOffsetFP32Norm: "the Hugging Face Gemma RMSNorm form, (x.float() * rsqrt(...) * (1 + weight.float()))"
                         ".to(dtype): fp32 throughout, rounded once",
}


def _search_fn(norm: NormFamily) -> Any:
    """``norm.norm`` as a function of exactly ``(x, weight, eps)`` (the pattern's argument names)."""
    def search(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.norm(x, weight, eps)
    return search


class TorchNormQuants:
    """Finds ``scaled_fp4_quant`` calls whose input is a norm written in torch ops, one of the
    sequence-parallel norm families (fp4fuse.patterns.sequence_parallel), and records each as
    skipped with the reason it is not fused (module docstring). Read through views (a linear's
    ``x.reshape(-1, hidden)``). The search patterns are traced once per activation dtype and rank."""

    key = "torch_norm"

    def __init__(self) -> None:
        self._patterns: dict[tuple[torch.dtype, int], list[tuple[type[NormFamily], pm.PatternExpr]]] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> TorchNormQuants:
        """A fresh instance: the traced patterns are a cache (rebuilt on use), and tracing state
        is not worth copying when Inductor deep-copies its config per compile."""
        return TorchNormQuants()

    def _patterns_for(self, dtype: torch.dtype, ndim: int) -> list[tuple[type[NormFamily], pm.PatternExpr]]:
        example_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16  # fp16 traces like bf16
        key = (example_dtype, ndim)
        if key not in self._patterns:
            self._patterns[key] = []
            for family in _TORCH_FORMS:
                with registration_mode():
                    x = torch.empty((2,) * (ndim - 1) + (32,), dtype=example_dtype)
                    w = torch.empty(32, dtype=example_dtype)
                    expr = pm.gen_pattern(_search_fn(family()), [x, w], aot_trace,
                                          scalar_workaround={"eps": EXAMPLE_EPS})
                self._patterns[key].append((family, expr))
        return self._patterns[key]

    def apply(self, graph: fx.Graph, recorder: MatchRecorder) -> int:
        """Record a skip for every quant of a torch-form norm in ``graph``; returns how many."""
        torch_set = next(s for s in NORM_SETS if s.name == "torch")
        if not torch_set.present(graph):
            return 0
        found = 0
        for quant in graph.find_nodes(op="call_function", target=QUANT):
            source = get_arg(quant, 0, "x")
            while is_call(source, *_VIEWS):
                source = source.args[0]
            val = fake_value(source)
            if not isinstance(val, torch.Tensor) or val.dim() < 2:
                continue
            family = next((f for f, expr in self._patterns_for(val.dtype, val.dim()) if expr.match(source)), None)
            if family is not None:
                recorder.skipped(self.key, quant, (
                    f"the quantized tensor is an RMSNorm written in torch ops ({family.name}: "
                    f"{_TORCH_FORMS[family]}); Inductor generates its code with its own reduction order "
                    "and roundings, so fp4fuse's fused norm + quantize op would not be bitwise equal to it "
                    "(fp4fuse's norm ops, e.g. fp4fuse.tp.RMSNorm with NormImpl.FP4FUSE, fuse)"))
                found += 1
        return found
