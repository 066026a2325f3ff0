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

Caching: ``uuid()`` hashes the config's ``hash_key()`` and the source of every pass, pattern and
op module (and of ``config.py`` and ``format.py``), so Inductor's FX graph cache stays on and
never serves a graph compiled under other settings or other code. A pass that bakes
process-group state into its rewrites (``reads_process_groups``) adds this process's rank and
group layout. A graph served from the FX graph cache does not run the passes again: the counts
then stay as they were.

Logging (logger ``fp4fuse.passes.manager``): one INFO line per call,
``fp4fuse: replaced N patterns: key=count, ...``; each skipped match is a DEBUG line from its
pass's logger (``fp4fuse.passes.<module>``) with the reason.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
from pathlib import Path

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from fp4fuse.config import FusionConfig
from fp4fuse.passes.async_tp import AsyncTPPass
from fp4fuse.passes.base import FusionGraphPass, process_group_fingerprint
from fp4fuse.passes.cleanup import NoOpViewCleanupPass
from fp4fuse.passes.sequence_parallel import SequenceParallelismPass
from fp4fuse.patterns.base import Skip

__all__ = ["FusionPass"]

logger = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parent.parent
# Everything whose code decides what a rewritten graph looks like or computes.
_SOURCE_DIRS = ("passes", "patterns", "ops")
_SOURCE_FILES = ("config.py", "format.py")


class FusionPass(CustomGraphPass):
    """Runs fp4fuse's passes in order on a post-grad graph; see the module docstring.

    Attributes:
        config: the (normalized) configuration.
        passes: the enabled passes, in the order they run.
        match_counts: per-pattern counts summed over every call (``"pass.pattern" -> n``).
        last_match_counts: per-pattern counts of the last call (patterns that fired).
        last_skips: the matches the last call left alone, with reasons.
        calls: how many graphs the pipeline has run on.
    """

    def __init__(self, config: FusionConfig | None = None) -> None:
        self.config = config if config is not None else FusionConfig()
        if self.config.log_level_number is not None:
            logging.getLogger("fp4fuse").setLevel(self.config.log_level_number)
        self.passes: list[FusionGraphPass] = [NoOpViewCleanupPass(self.config)]
        if self.config.enable_sequence_parallelism:
            self.passes.append(SequenceParallelismPass(self.config))
        if self.config.enable_async_tp:
            self.passes.append(AsyncTPPass(self.config))
        self.match_counts: collections.Counter[str] = collections.Counter()
        self.last_match_counts: dict[str, int] = {}
        self.last_skips: list[Skip] = []
        self.calls = 0

    @property
    def pass_names(self) -> list[str]:
        return [p.name for p in self.passes]

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
        self.match_counts.update(self.last_match_counts)
        fused = {k: v for k, v in self.last_match_counts.items() if not k.startswith(f"{NoOpViewCleanupPass.name}.")}
        detail = ", ".join(f"{k}={v}" for k, v in sorted(fused.items()))
        logger.info("fp4fuse: replaced %d patterns%s (%d skipped, %d no-op views removed)",
                    sum(fused.values()), f": {detail}" if detail else "", len(skips),
                    sum(self.last_match_counts.values()) - sum(fused.values()))

    def source_files(self) -> list[str]:
        """Every file hashed into ``uuid()``, sorted."""
        files = {str(p) for d in _SOURCE_DIRS for p in (_PACKAGE / d).rglob("*.py")}
        files.update(str(_PACKAGE / f) for f in _SOURCE_FILES)
        for graph_pass in self.passes:
            files.update(str(Path(f).resolve()) for f in graph_pass.source_files())
        return sorted(files)

    def uuid(self) -> str:
        """sha256 over the config's ``hash_key()``, the enabled passes, the content of every file of
        ``source_files()`` (read on each call: Inductor's ``get_hash_for_files`` caches by path and
        would miss an edit made while the process runs) and, where a pass needs it, the process-group
        layout."""
        hasher = hashlib.sha256()
        hasher.update(self.config.hash_key().encode())
        hasher.update(json.dumps(self.pass_names).encode())
        for path in map(Path, self.source_files()):
            name = path.relative_to(_PACKAGE) if path.is_relative_to(_PACKAGE) else Path(path.name)
            hasher.update(name.as_posix().encode())
            hasher.update(path.read_bytes())
        if any(p.reads_process_groups for p in self.passes):
            hasher.update(json.dumps(process_group_fingerprint(), sort_keys=True).encode())
        return hasher.hexdigest()
