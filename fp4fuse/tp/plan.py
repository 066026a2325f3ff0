"""Hugging Face-style tensor-parallel plans: which ``nn.Linear`` modules split how.

A plan maps module-name patterns to a style::

    {"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.mlp.down_proj": "rowwise"}

Styles (``ParallelStyle``): ``colwise`` / ``rowwise``, and the forms whose output or input is whole
on every rank, ``colwise_gather_output`` / ``rowwise_split_input`` (OLMo 2's q/k/v before its
full-width q/k norms, GLM's merged gate/up before its ``chunk``, Phi-3's merged projections).

``*`` matches one dotted name component (a layer index), the rest matches literally, and a pattern
names whole modules (``fullmatch``). Patterns are matched against each module's name in the model
and, for a Hugging Face ``*ForCausalLM`` whose base model sits under a prefix (``model.``), against
the name relative to that base model, so ``model.config.base_model_tp_plan`` works on the causal-LM
wrapper as on the base model. ``resolve_plan`` returns full names (as ``model.named_modules()``
spells them).

Every pattern must match at least one ``nn.Linear`` and nothing else, every module at most one
style, and the style must be one fp4fuse implements; a split linear must compute what ``nn.Linear``
computes (``x @ W^T + b``), which a TP linear replaces: an ``nn.Linear`` subclass overriding
``forward``, an instance whose ``forward`` was replaced, or one with forward hooks (all of which the
replacement would silently drop) is refused. Anything else is a ``ValueError`` naming the
pattern, the module and the rule (a plan that half applies would shard q but not k and compute
garbage, not fail). One style leaves its modules as they are, of any type:
``replicated_with_grad_allreduce`` (Qwen3's and Gemma 3's per-head ``q_norm`` / ``k_norm``, whose
weights every rank holds whole). Its name asks for the gradients to be all-reduced; ``parallelize``
builds inference models (frozen weights), where no gradient arises, so replicating is all it means.
"""
from __future__ import annotations

import enum
import re
from collections.abc import Mapping

from torch import nn

__all__ = ["ParallelStyle", "base_model_prefix", "extra_forward", "resolve_plan"]


class ParallelStyle(enum.Enum):
    """How a linear is split: ``COLWISE`` shards output features (and bias), so each rank outputs
    its features; ``COLWISE_GATHER`` the same, then all-gathers the output features, so every rank
    holds the whole output; ``ROWWISE`` shards input features (the input holds this rank's features)
    and all-reduces the output (bias added once); ``ROWWISE_SPLIT`` the same on a whole input, of
    which each rank takes its features. ``REPLICATED``: any module, left whole on every rank (module
    docstring). Hugging Face's ``colwise_rep`` / ``rowwise_rep`` are the two gather / split styles
    under other names (``transformers.distributed.tensor_parallel`` registers them alike)."""

    COLWISE = "colwise"
    COLWISE_GATHER = "colwise_gather_output"
    ROWWISE = "rowwise"
    ROWWISE_SPLIT = "rowwise_split_input"
    REPLICATED = "replicated_with_grad_allreduce"

    def shards_output(self) -> bool:
        """Whether the weight is split by output features (column-parallel)."""
        return self in (ParallelStyle.COLWISE, ParallelStyle.COLWISE_GATHER)


_ALIASES = {"colwise_rep": ParallelStyle.COLWISE_GATHER, "rowwise_rep": ParallelStyle.ROWWISE_SPLIT}


def _style(value: object, pattern: str, module: str) -> ParallelStyle:
    if isinstance(value, ParallelStyle):
        return value
    if value in _ALIASES:
        return _ALIASES[value]
    try:
        return ParallelStyle(value)
    except ValueError:
        supported = ", ".join([repr(s.value) for s in ParallelStyle] + [repr(a) for a in _ALIASES])
        raise ValueError(f"parallelize: plan entry {pattern!r} gives module {module!r} the style {value!r}; "
                         f"fp4fuse supports {supported}") from None


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(r"[^.]+".join(re.escape(part) for part in pattern.split("*")))


def extra_forward(module: nn.Module, base: type[nn.Module]) -> str | None:
    """Why ``module`` (an instance of ``base``) computes more than ``base.forward``, as a phrase:
    "a <type>, overrides nn.<base>.forward" (a subclass), "a <type> whose forward was replaced on
    the instance" (e.g. by a wrapper library) or "a <type> with <n> forward (pre-)hook(s) ...";
    None when it computes exactly that. A TP layer built from its weights would drop what these add."""
    name = type(module).__name__
    kind = f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}"
    if type(module).forward is not base.forward:
        return f"{kind}, overrides nn.{base.__name__}.forward"
    if "forward" in vars(module):
        return f"{kind} whose forward was replaced on the instance"
    hooks = len(module._forward_pre_hooks) + len(module._forward_hooks)
    if hooks:
        return f"{kind} with {hooks} forward (pre-)hook(s), which its replacement would not run"
    return None


def base_model_prefix(model: nn.Module) -> str:
    """The dotted prefix of a Hugging Face model's base model (``"model."`` for a
    ``LlamaForCausalLM``), or ``""`` when ``model`` is its own base model or no HF model."""
    base = getattr(model, "base_model", model)
    if base is model or not isinstance(base, nn.Module):
        return ""
    for name, module in model.named_modules():
        if module is base:
            return f"{name}."
    return ""


def resolve_plan(model: nn.Module, plan: Mapping[str, object]) -> dict[str, ParallelStyle]:
    """``{full module name: style}`` for every ``nn.Linear`` that ``plan`` splits, in module order
    (modules it replicates are checked, not returned)."""
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"parallelize: the plan must be a non-empty mapping of module patterns to styles, got {plan!r}")
    prefix = base_model_prefix(model)
    modules = dict(model.named_modules())
    matched: dict[str, tuple[str, ParallelStyle]] = {}
    for pattern, value in plan.items():
        regex = _regex(pattern)
        names = [n for n in modules if regex.fullmatch(n) or (prefix and n.startswith(prefix)
                                                             and regex.fullmatch(n[len(prefix):]))]
        if not names:
            where = f" or under the base model prefix {prefix!r}" if prefix else ""
            raise ValueError(f"parallelize: plan entry {pattern!r} matches no module of {type(model).__name__}"
                             f"{where}")
        for name in names:
            style = _style(value, pattern, name)
            if style is not ParallelStyle.REPLICATED and not isinstance(modules[name], nn.Linear):
                raise ValueError(f"parallelize: plan entry {pattern!r} names {name!r}, a "
                                 f"{type(modules[name]).__name__}; only nn.Linear modules can be split")
            extra = None if style is ParallelStyle.REPLICATED else extra_forward(modules[name], nn.Linear)
            if extra:
                raise ValueError(f"parallelize: plan entry {pattern!r} names {name!r}, {extra}; only a module "
                                 f"computing nn.Linear's x @ W^T + b can be split (its TP replacement computes "
                                 f"that alone)")
            if name in matched and matched[name][1] is not style:
                raise ValueError(f"parallelize: module {name!r} is {matched[name][1].value} by plan entry "
                                 f"{matched[name][0]!r} and {style.value} by {pattern!r}")
            matched[name] = (pattern, style)
    return {name: matched[name][1] for name in modules
            if name in matched and matched[name][1] is not ParallelStyle.REPLICATED}
