"""``GraphPass``: the interface every pass of fp4fuse's pipeline implements.

    class MyPass(GraphPass):
        name = "my_pass"
        source_modules = (my_patterns,)             # what decides the graphs this pass writes

        def __call__(self, graph: torch.fx.Graph) -> int:
            self.recorder.reset()
            ...                                     # find -> check -> rewrite, recording each
            return self.finish()                    # publishes match_counts, returns the total

``FusionPass`` (fp4fuse.passes.manager) runs the passes in a fixed order, sums their
``match_counts`` and composes its ``uuid()`` from theirs: a pass's :meth:`GraphPass.uuid` hashes
its name and the source of its own module, its fp4fuse base classes and ``source_modules``.

Anything a pass bakes into a rewritten graph that is not already in the input graph (a rank, a
group size that only the process group knows) must reach the FX-cache key: such a pass sets
``reads_process_groups = True`` and the manager then adds ``process_group_fingerprint()`` (this
process's rank and the name, size and ranks of every process group) to its uuid.
"""
from __future__ import annotations

import abc
import hashlib
import inspect
import logging
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from fp4fuse.patterns.base import MatchRecorder, Skip

if TYPE_CHECKING:
    from fp4fuse.config import FusionConfig

__all__ = ["GraphPass", "process_group_fingerprint"]


class GraphPass(abc.ABC):
    """One pass of the pipeline.

    Attributes:
        name: short pass name; the prefix of its pattern keys (``"name.pattern"``).
        reads_process_groups: True if the pass bakes process-group state (rank, sizes) that the
            input graph does not hold into its rewrites; see the module docstring.
        source_modules: modules besides the pass's own (and its fp4fuse base classes') whose
            source decides what the pass writes into a graph: its patterns, the ops it inserts.
        match_counts: per-pattern counts of the last call, keys ``"name.pattern"``.
        skips: the matches the last call found and left alone, with their reasons.
    """

    name: ClassVar[str]
    reads_process_groups: ClassVar[bool] = False
    source_modules: ClassVar[tuple[ModuleType, ...]] = ()

    def __init__(self, config: FusionConfig) -> None:
        self.config = config
        self.logger = logging.getLogger(type(self).__module__)
        self.recorder = MatchRecorder(self.name, self.logger)
        self.match_counts: dict[str, int] = {}
        self.skips: list[Skip] = []

    @abc.abstractmethod
    def __call__(self, graph: torch.fx.Graph) -> int:
        """Rewrite ``graph`` in place; return the number of rewrites made."""

    def finish(self) -> int:
        """Publish the recorder's counts and skips as this call's; return the total count."""
        self.match_counts = self.recorder.counts
        self.skips = self.recorder.skips
        return self.recorder.total

    def source_files(self) -> list[str]:
        """The files :meth:`uuid` hashes: the modules of the pass class and of its fp4fuse bases,
        then ``source_modules``; no duplicates."""
        files: list[str] = []
        modules = [inspect.getmodule(cls) for cls in type(self).__mro__ if cls.__module__.startswith("fp4fuse")]
        for module in [*modules, *self.source_modules]:
            path = getattr(module, "__file__", None)
            if path is not None and path not in files:
                files.append(path)
        return files

    def uuid(self) -> str:
        """sha256 of the pass's name and the content of :meth:`source_files` (read on every call:
        Inductor's ``get_hash_for_files`` caches by path and would miss an edit made while the
        process runs)."""
        hasher = hashlib.sha256(self.name.encode())
        for path in map(Path, self.source_files()):
            hasher.update(path.name.encode())
            hasher.update(path.read_bytes())
        return hasher.hexdigest()


def process_group_fingerprint() -> dict[str, Any]:
    """This process's rank and every process group's name, size and ranks (empty if
    torch.distributed is not initialized). Goes into the uuid of a pipeline with a pass that
    bakes process-group state into graphs, so ranks and layouts never share cache entries."""
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    from torch.distributed.distributed_c10d import _get_all_pg_configs

    groups = sorted(
        (str(cfg["pg_name"]), int(cfg["pg_size"]), [int(r) for r in cfg["ranks"]])
        for cfg in _get_all_pg_configs()
    )
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "groups": groups}
