"""``FusionPass``: fp4fuse's pass pipeline as one Inductor ``post_grad_custom_post_pass``.

    fusion = FusionPass(FusionConfig(enable_async_tp=True))
    model = torch.compile(model, options={"post_grad_custom_post_pass": fusion})
    fusion.match_counts        # cumulative per-pattern counts, e.g. {"async_tp.mm_fp4_reduce_scatter": 2}
    fusion.last_match_counts   # the last graph's

Order of the pipeline (each pass sees the previous one's output):

1. ``cleanup`` (always): no-op view chains removed, so producers are visible to the patterns.
2. ``sequence_parallelism`` (``enable_sequence_parallelism``): all_reduce + norm (+ quant) ->
   reduce_scatter + norm + quant + all_gather.
3. ``async_tp`` (``enable_async_tp``): the collectives of 2. (and any in the model) fused with
   their GEMMs.
3b. ``all_reduce`` (``enable_symm_all_reduce``, on by default): the remaining all-reduces (sum) of
   two-rank groups -> ``fp4fuse::all_reduce_sum`` (symmetric-memory kernels on CUDA, bitwise NCCL's
   sum; fp4fuse.passes.all_reduce).
4. ``cse`` (always): repeated pure computations merged, above all the quantization of one
   activation that several linears read (q/k/v, gate/up: fp4fuse.passes.cse).
5. ``norm_quant`` (``enable_norm_quant_fusion``, on by default): fp4fuse's norm -> NVFP4 quant
   with a static global scale -> one fused norm + quantize op (fp4fuse.passes.norm_quant), also
   the shard's norm -> quant that 2. writes.
6. ``lowering`` (``lower_kernels``, on by default): fp4fuse's op calls on CUDA replaced by the
   Triton launches they run (fp4fuse.passes.lowering), so no op costs a Python call per kernel.

Caching: ``uuid()`` is composed, not scraped: the config's ``hash_key()``, each enabled pass's own
``uuid()`` (its name and the source of its module, patterns and ops), and this module's source,
so Inductor's FX graph cache stays on and never serves a graph compiled under other settings or
other code. A pass that bakes process-group state into its rewrites (``reads_process_groups``)
adds this process's rank and group layout.

Constructing a ``FusionPass`` makes the compile caches' guard expressions parenthesize each guard
(fp4fuse.passes.cache_guards): without it a cached graph compiled under a rewrite's guard can be
served to sizes that fail the guard.

A graph served from the FX graph cache does not run the passes again; the counts recorded when it
was compiled travel with its cache entry (fp4fuse.passes.cache_record) and are added to
``match_counts`` (and to ``cached_match_counts`` / ``cached_graphs``), so a second run of a
script reports what fused in the first.

Logging (logger ``fp4fuse.passes.manager``): one INFO line per graph,
``fp4fuse: replaced N patterns: key=count, ... (...)`` when the passes ran, or
``fp4fuse: served G graph(s) from the FX graph cache: N fusions recorded at compile time: ...``;
each skipped match is a DEBUG line from its pass's logger (``fp4fuse.passes.<module>``) with the
reason. ``FusionConfig.log_level`` makes these lines visible without configuring ``logging``
(fp4fuse.passes.log_handler).
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
from pathlib import Path

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from fp4fuse.config import FusionConfig, compile_time_env
from fp4fuse.passes import cache_guards, cache_record
from fp4fuse.passes.all_reduce import SymmAllReducePass
from fp4fuse.passes.async_tp import AsyncTPPass
from fp4fuse.passes.base import GraphPass, process_group_fingerprint
from fp4fuse.passes.cleanup import NoOpViewCleanupPass
from fp4fuse.passes.cse import CommonSubexpressionPass
from fp4fuse.passes.log_handler import apply_log_level
from fp4fuse.passes.lowering import KernelLoweringPass
from fp4fuse.passes.norm_quant import NormQuantFusionPass
from fp4fuse.passes.sequence_parallel import SequenceParallelismPass
from fp4fuse.patterns.base import Skip

__all__ = ["FusionPass", "PACKAGE_ROOT", "is_fusion", "package_sources_digest"]

logger = logging.getLogger(__name__)

# Pattern-key prefixes of the passes that fuse nothing: cleanup, symmetric-memory all-reduce,
# common subexpressions, lowering.
_NOT_FUSIONS = tuple(f"{p.name}." for p in (NoOpViewCleanupPass, SymmAllReducePass, CommonSubexpressionPass,
                                            KernelLoweringPass))


def is_fusion(key: str) -> bool:
    """Whether pattern key ``key`` counts a fusion (not a no-op view removed, not an all-reduce run
    through symmetric memory, not a repeated computation merged, not an op lowered)."""
    return not key.startswith(_NOT_FUSIONS)


def _summary(counts: dict[str, int]) -> tuple[int, str, str]:
    """(fusions, ``": key=n, ..."`` of the fusions, ``"N no-op views removed, N all-reduces through
    symmetric memory, N repeated computations merged, N op calls lowered to kernels"``)."""
    fused = {k: v for k, v in counts.items() if is_fusion(k)}
    detail = ", ".join(f"{k}={v}" for k, v in sorted(fused.items()))

    def total(prefix: str) -> int:
        return sum(v for k, v in counts.items() if k.startswith(prefix))

    cleanup, all_reduce, cse, lowering = (total(prefix) for prefix in _NOT_FUSIONS)
    rest = (f"{cleanup} no-op views removed, {all_reduce} all-reduces through symmetric memory, {cse} repeated "
            f"computations merged, {lowering} op calls lowered to kernels")
    return sum(fused.values()), f": {detail}" if detail else "", rest


#: The fp4fuse package's directory.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def package_sources_digest(root: Path | None = None) -> str:
    """sha256 over the path and bytes of every ``.py`` file under ``root`` (default
    ``PACKAGE_ROOT``, the fp4fuse package), in path order: part of :meth:`FusionPass.uuid`."""
    root = PACKAGE_ROOT if root is None else root
    hasher = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        hasher.update(str(path.relative_to(root)).encode())
        hasher.update(path.read_bytes())
    return hasher.hexdigest()


class FusionPass(CustomGraphPass):
    """Runs fp4fuse's passes in order on a post-grad graph; see the module docstring.

    Equal only to itself (identity, no ``__eq__``): two ``torch.compile`` calls given different
    FusionPass objects have different options, which Dynamo uses to keep their compiled models
    apart when module guards are skipped (README, "Use"). Its ``uuid()``, not equality, is what
    Inductor's FX graph cache keys on.

    Attributes:
        config: the (normalized) configuration.
        passes: the enabled passes, in the order they run.
        match_counts: per-pattern counts (``"pass.pattern" -> n``) of every graph compiled under
            this pass: graphs the passes ran on, plus graphs served from the FX graph cache (their
            counts recorded at compile time).
        fusion_counts: ``match_counts`` without the passes that fuse nothing (see :func:`is_fusion`).
        cached_match_counts, cached_graphs: the part of ``match_counts`` served from the FX graph
            cache, and how many graphs that was.
        last_match_counts: per-pattern counts of the last graph the passes ran on.
        last_skips: the matches the last run left alone, with reasons.
        calls: how many graphs the passes ran on (cache hits not included).
    """

    def __init__(self, config: FusionConfig | None = None) -> None:
        self.config = config if config is not None else FusionConfig()
        cache_guards.install()
        if self.config.log_level_number is not None:
            apply_log_level(self.config.log_level_number)
        self.passes: list[GraphPass] = [NoOpViewCleanupPass(self.config)]
        if self.config.enable_sequence_parallelism:
            self.passes.append(SequenceParallelismPass(self.config))
        if self.config.enable_async_tp:
            self.passes.append(AsyncTPPass(self.config))
        if self.config.enable_symm_all_reduce:
            self.passes.append(SymmAllReducePass(self.config))
        self.passes.append(CommonSubexpressionPass(self.config))
        if self.config.enable_norm_quant_fusion:
            self.passes.append(NormQuantFusionPass(self.config))
        if self.config.lower_kernels:
            self.passes.append(KernelLoweringPass(self.config))
        self._run_counts: collections.Counter[str] = collections.Counter()
        self._cached_counts: collections.Counter[str] = collections.Counter()
        self._cached_graphs = 0
        self.last_match_counts: dict[str, int] = {}
        self.last_skips: list[Skip] = []
        self.calls = 0

    def __setstate__(self, state: dict) -> None:
        """Unpickled (Inductor's compile subprocess, ``TORCHINDUCTOR_FX_COMPILE_MODE=subprocess``): it writes
        the same guard expressions as this one (fp4fuse.passes.cache_guards)."""
        cache_guards.install()
        self.__dict__.update(state)

    @property
    def pass_names(self) -> list[str]:
        return [p.name for p in self.passes]

    @property
    def match_counts(self) -> collections.Counter[str]:
        cache_record.close_lookup()
        return self._run_counts + self._cached_counts

    @property
    def fusion_counts(self) -> dict[str, int]:
        return {k: v for k, v in self.match_counts.items() if is_fusion(k)}

    @property
    def cached_match_counts(self) -> collections.Counter[str]:
        cache_record.close_lookup()
        return collections.Counter(self._cached_counts)

    @property
    def cached_graphs(self) -> int:
        cache_record.close_lookup()
        return self._cached_graphs

    def __call__(self, graph: fx.Graph) -> None:
        counts: dict[str, int] = {}
        skips: list[Skip] = []
        for graph_pass in self.passes:
            graph_pass(graph)
            counts.update(graph_pass.match_counts)
            skips.extend(graph_pass.skips)
        self.calls += 1
        self.last_match_counts = {k: v for k, v in counts.items() if v}
        self.last_skips = skips
        self._run_counts.update(self.last_match_counts)
        cache_record.record_compiled(self._uuid(), self.last_match_counts, len(skips))
        fused, detail, rest = _summary(self.last_match_counts)
        logger.info("fp4fuse: replaced %d patterns%s (%d skipped, %s)", fused, detail, len(skips), rest)

    def served_from_cache(self, record: cache_record.CompileRecord) -> None:
        """Inductor served ``record.graphs`` graphs compiled under this pass's uuid from the FX
        graph cache (called by fp4fuse.passes.cache_record): count and log them."""
        self._cached_graphs += record.graphs
        self._cached_counts.update(record.counts)
        fused, detail, rest = _summary(record.counts)
        logger.info("fp4fuse: served %d graph(s) from the FX graph cache (the passes did not run again): %d "
                    "fusions recorded at compile time%s (%d skipped, %s)", record.graphs, fused, detail,
                    record.skipped, rest)

    def uuid(self) -> str:
        """sha256 over the config's ``hash_key()``, each pass's ``uuid()`` in pipeline order, the
        source of every module of the fp4fuse package (:func:`package_sources_digest`: the passes
        also trace and decide with code they reach indirectly -- thresholds, gathers, launchers --
        and a cache directory outlives an upgrade), the run-time switches the passes read while
        compiling (``fp4fuse.config.compile_time_env``) and, where a pass needs it, the
        process-group layout.

        Inductor calls it for every FX-graph-cache lookup: each call opens a cache lookup
        (fp4fuse.passes.cache_record), so counts of a graph the cache serves reach this pass."""
        uuid = self._uuid()
        cache_record.open_lookup(self, uuid)
        return uuid

    def _uuid(self) -> str:
        hasher = hashlib.sha256(self.config.hash_key().encode())
        for graph_pass in self.passes:
            hasher.update(graph_pass.uuid().encode())
        hasher.update(package_sources_digest().encode())
        hasher.update(json.dumps(compile_time_env(), sort_keys=True).encode())
        if any(p.reads_process_groups for p in self.passes):
            hasher.update(json.dumps(process_group_fingerprint(), sort_keys=True).encode())
        return hasher.hexdigest()
