"""``parallelize``: put an existing model (e.g. a Hugging Face ``LlamaForCausalLM``) on tensor
parallelism with NVFP4 (or unquantized) linears, in place.

    import torch.distributed as dist
    from fp4fuse.tp import parallelize
    dist.init_process_group("nccl")
    model = parallelize(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda())
    #   every nn.Linear named by model.config.base_model_tp_plan is now a column- or
    #   row-parallel NVFP4 linear holding this rank's shard

What changes: each planned ``nn.Linear`` is replaced by a column- or row-parallel linear built
from its weight and bias (fp4fuse.tp.linear for NVFP4, fp4fuse.tp.dense for the model's dtype),
and the input embedding (``model.get_input_embeddings()``) by a vocab-parallel one
(``embedding=True``, the default): each rank holds ``vocab / size`` rows and one all-reduce sums
the lookups. That all-reduce is what lets sequence parallelism fuse a Hugging Face model without a
per-call check: the residual stream starts as a collective's result, the same on every rank by
construction (fp4fuse.patterns.rank_uniform), where a replicated embedding computes it from the
per-call ``input_ids``. Norms and the LM head stay replicated. Attention keeps
working because Hugging Face attention infers its head count from the projection width
(``view(*input_shape, -1, head_dim)``): q/k/v hold ``heads / size`` whole heads on each rank, which
``parallelize`` checks against ``config.num_attention_heads`` / ``num_key_value_heads``.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from fp4fuse.nvfp4 import format as nvfp4
from fp4fuse.tp.dense import ColumnParallelLinear, RowParallelLinear
from fp4fuse.tp.layers import VocabParallelEmbedding
from fp4fuse.tp.linear import ColumnParallelNVFP4Linear, RowParallelNVFP4Linear, global_scale_tensor
from fp4fuse.tp.parallel import TPGroup
from fp4fuse.tp.plan import ParallelStyle, extra_forward, resolve_plan

__all__ = ["WeightFormat", "parallelize"]

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class WeightFormat(enum.Enum):
    """What the parallel linears hold.

    ``NVFP4``: weights quantized once to NVFP4 (full-weight global scale), activations quantized
    per call (dynamic global scale by default, static from ``activation_scales``), ``mm_fp4``.
    ``BF16``: unquantized weights in the model's own dtype (bf16 for a bf16 model) and ``F.linear``:
    the same TP structure, the baseline for NVFP4."""

    NVFP4 = "nvfp4"
    BF16 = "bf16"


#: (weight format, column-parallel) -> layer class
_LAYERS = {
    (WeightFormat.NVFP4, True): ColumnParallelNVFP4Linear,
    (WeightFormat.NVFP4, False): RowParallelNVFP4Linear,
    (WeightFormat.BF16, True): ColumnParallelLinear,
    (WeightFormat.BF16, False): RowParallelLinear,
}
#: the layer options of each style
_STYLE_OPTIONS = {
    ParallelStyle.COLWISE: {},
    ParallelStyle.COLWISE_GATHER: {"gather_output": True},
    ParallelStyle.ROWWISE: {},
    ParallelStyle.ROWWISE_SPLIT: {"input_is_parallel": False},
}


def parallelize(model: nn.Module, group: dist.ProcessGroup | None = None, plan: Mapping[str, object] | None = None,
                *, weight_format: WeightFormat = WeightFormat.NVFP4,
                activation_scales: Mapping[str, float | torch.Tensor] | None = None,
                embedding: bool = True) -> nn.Module:
    """Replace the ``nn.Linear`` modules named by ``plan`` with tensor-parallel linears; return ``model``.

    ``group``: the TP process group (default: the default group); call on every rank of it.
    ``plan``: ``{module pattern: "colwise" | "rowwise" | "colwise_gather_output" | "rowwise_split_input"}``
    (fp4fuse.tp.plan; ``*`` matches one name component); default ``model.config.base_model_tp_plan``.
    Patterns match full module names or names relative to a Hugging Face base model (``layers.*``
    finds ``model.layers.*`` in a ``*ForCausalLM``). Column-parallel linears shard output features
    and bias; row-parallel ones shard input features, all-reduce the output (functional
    collectives) and add the bias once;
    ``colwise_gather_output`` all-gathers a column-parallel output's features (every rank gets the
    whole output), ``rowwise_split_input`` gives a row-parallel linear a whole input, of which each
    rank multiplies its features.
    Inputs may have any leading dimensions.
    ``weight_format``: ``WeightFormat.NVFP4`` or ``WeightFormat.BF16`` (see :class:`WeightFormat`).
    ``activation_scales``: None (dynamic activation scales) or ``{full module name: global scale}``
    for NVFP4 linears, each an encode-convention scale ``448 * 6 / amax`` (float or one-element
    tensor; finite, > 0) held by its layer as the buffer ``input_global_scale``: model state, in the
    state_dict and a tensor input of compiled graphs. Names not in the plan are an error.
    ``embedding``: shard the input embedding over the vocabulary (``VocabParallelEmbedding``, its
    lookups summed by a functional all-reduce); left replicated, with a warning, when the vocabulary
    does not divide by the TP size, the model has no ``nn.Embedding`` input embedding, or its
    embedding computes more than a lookup (a subclass overriding ``forward``, a forward replaced on
    the instance, forward hooks, ``max_norm``).

    Raises ``ValueError`` naming the module for a planned linear that computes more than
    ``nn.Linear.forward`` (a subclass overriding it, a replaced ``forward``, forward hooks: its TP
    replacement would drop what they add), for a dimension that does not split (features not
    divisible by the TP size; NVFP4 needs 16 | K and 16 | K / size for row-parallel), a head count
    that does not split, and for any plan the rules of fp4fuse.tp.plan reject.
    """
    if not isinstance(weight_format, WeightFormat):
        raise TypeError(f"parallelize: weight_format must be a WeightFormat, got {weight_format!r}")
    tp = TPGroup.from_process_group(group)
    if plan is None:
        plan = _config_plan(model)
    styles = resolve_plan(model, plan)
    scales = _activation_scales(activation_scales, styles, weight_format)
    if ParallelStyle.COLWISE in styles.values():
        _check_heads(model, tp)
    modules = dict(model.named_modules())
    for name, style in styles.items():  # every check before the first replacement: errors leave the model as it was
        _check_dims(name, style, modules[name], tp, weight_format)
    for name, style in styles.items():
        linear = modules[name]
        layer_cls = _LAYERS[weight_format, style.shards_output()]
        if weight_format is WeightFormat.NVFP4:
            layer = layer_cls.from_linear(linear, tp, input_global_scale=scales.get(name), **_STYLE_OPTIONS[style])
        else:
            layer = layer_cls.from_linear(linear, tp, **_STYLE_OPTIONS[style])
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, layer)
    if embedding:
        _shard_input_embedding(model, tp)
    logger.info("parallelize: %d linears on TP=%d (rank %d, %s): %d column-parallel, %d row-parallel, "
                "%d static activation scales", len(styles), tp.size, tp.rank, weight_format.value,
                sum(s.shards_output() for s in styles.values()),
                sum(not s.shards_output() for s in styles.values()), len(scales))
    return model


def _shard_input_embedding(model: nn.Module, tp: TPGroup) -> None:
    """Replace ``model.get_input_embeddings()`` by a ``VocabParallelEmbedding`` of its weight,
    where that computes what the embedding computes; else warn why it stays replicated."""
    getter = getattr(model, "get_input_embeddings", None)
    table = getter() if callable(getter) else None
    if not isinstance(table, nn.Embedding):
        reason = f"{type(model).__name__} has no nn.Embedding input embedding"
    elif extra := extra_forward(table, nn.Embedding):
        # e.g. Gemma 3's Gemma3TextScaledWordEmbedding multiplies the lookup by sqrt(hidden); a forward
        # hook or a forward replaced on the instance may change the lookup too
        reason = f"its input embedding, {extra}"
    elif table.max_norm is not None:
        reason = f"its input embedding renormalizes the rows it looks up (max_norm={table.max_norm})"
    elif table.num_embeddings % tp.size:
        reason = f"the vocabulary {table.num_embeddings} does not divide by the TP size {tp.size}"
    else:
        model.set_input_embeddings(VocabParallelEmbedding(table.weight.detach(), tp))
        return
    logger.warning("parallelize: %s; the input embedding stays replicated (sequence parallelism then needs "
                   "FusionConfig(rank_check='always'))", reason)


def _config_plan(model: nn.Module) -> Mapping[str, object]:
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"parallelize: no plan given and {type(model).__name__} has no "
                         f"config.base_model_tp_plan; pass plan={{'layers.*.q_proj': 'colwise', ...}}")
    return plan


def _activation_scales(scales: Mapping[str, float | torch.Tensor] | None, styles: dict[str, ParallelStyle],
                       weight_format: WeightFormat) -> dict[str, torch.Tensor]:
    if not scales:
        return {}
    if weight_format is not WeightFormat.NVFP4:
        raise ValueError(f"parallelize: activation_scales quantize NVFP4 activations; weight_format "
                         f"{weight_format} has none")
    unknown = sorted(set(scales) - set(styles))
    if unknown:
        raise ValueError(f"parallelize: activation_scales names {unknown}, which the plan does not parallelize; "
                         f"keys are full module names such as {next(iter(styles))!r}")
    return {name: global_scale_tensor(value, f"activation_scales[{name!r}]") for name, value in scales.items()}


def _check_dims(name: str, style: ParallelStyle, linear: nn.Linear, tp: TPGroup, weight_format: WeightFormat) -> None:
    def fail(rule: str) -> None:
        raise ValueError(f"parallelize: {name} ({style.value}, weight {list(linear.weight.shape)}): {rule}")

    split_dim, what = (linear.out_features, "out_features") if style.shards_output() else (
        linear.in_features, "in_features")
    if split_dim % tp.size:
        fail(f"{what} = {split_dim} is not divisible by the tensor-parallel size {tp.size}")
    if weight_format is WeightFormat.NVFP4:
        if linear.weight.dtype not in _FLOAT_DTYPES:
            fail(f"NVFP4 needs a bf16, fp16 or fp32 weight, got {linear.weight.dtype}")
        local_k = linear.in_features if style.shards_output() else linear.in_features // tp.size
        if local_k % nvfp4.BLOCK_SIZE:
            fail(f"NVFP4 needs input features per rank ({local_k}) to be a multiple of {nvfp4.BLOCK_SIZE}")


def _check_heads(model: nn.Module, tp: TPGroup) -> None:
    """Column-parallel q/k/v must hold whole heads: HF attention infers heads from the width.
    Checked where the plan has a ``colwise`` linear (with gathered outputs only, attention runs
    whole on every rank)."""
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp.size:
            raise ValueError(f"parallelize: config.{field} = {heads} is not divisible by the tensor-parallel "
                             f"size {tp.size}; column-parallel attention projections would split a head")
