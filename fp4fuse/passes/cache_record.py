"""Fusion counts that survive Inductor's FX graph cache.

A graph served from the FX graph cache was compiled earlier (another process, or before
``torch._dynamo.reset()``): Inductor loads its code and does not run the post-grad passes, so
``FusionPass`` never sees it, and a second run of a script would look as if nothing fused.

Inductor already stores one compile-time record with each cache entry: what the compile added to
``torch._dynamo.utils.counters["inductor"]`` (``CompiledFxGraph.counter_deltas``), added back to
the counters on every cache hit -- the reason ``counters["inductor"]["pattern_matcher_count"]``
reads the same with the cache on or off. fp4fuse records through the same channel::

    compile (miss):  the passes ran -> record_compiled(uuid, counts):
                     counters["inductor"]["fp4fuse:<uuid[:16]>:<pattern key>"] += n,
                     "...:graphs" += 1, "...:skipped" += k   -> stored in the entry's counter_deltas
    load (hit):      Inductor adds counter_deltas back: the keys grow, no pass ran

Telling a hit from a compile: Inductor calls ``FusionPass.uuid()`` for every cache lookup, before
it loads or compiles, and the pass opens a :class:`Lookup` (a snapshot of its keys). The next
event closes it: the passes running (a miss: nothing was served), the next lookup, the end of the
Dynamo compile (a ``torch._dynamo.callback_handler`` end callback) or a read of the counts.
Growth of the keys between the snapshot and the close, with no pass run, is what the cache
served; the owner of the lookup hears of it through ``served_from_cache(record)``.

Cost: nothing per call of the compiled graph (no node is added to it), a dict scan per lookup.
Limits: ``counters.clear()`` between a lookup and its close loses that record; counters cleared
later do not change what an owner was told.
"""
from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Mapping
from typing import Protocol

import torch
from torch._dynamo.utils import counters

__all__ = ["CompileRecord", "Lookup", "close_lookup", "open_lookup", "record_compiled"]

#: The counter group Inductor stores with a cache entry and adds back on a hit.
_GROUP = "inductor"
_GRAPHS = "graphs"
_SKIPPED = "skipped"


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """What the passes did to ``graphs`` graphs: per-pattern ``counts`` and ``skipped`` matches."""

    graphs: int
    counts: dict[str, int]
    skipped: int


class CacheListener(Protocol):
    def served_from_cache(self, record: CompileRecord) -> None: ...


def _prefix(uuid: str) -> str:
    return f"fp4fuse:{uuid[:16]}:"


def _snapshot(uuid: str) -> collections.Counter[str]:
    prefix = _prefix(uuid)
    return collections.Counter({k[len(prefix):]: v for k, v in counters[_GROUP].items() if k.startswith(prefix)})


def record_compiled(uuid: str, counts: Mapping[str, int], skipped: int) -> None:
    """Record one graph the passes ran on, compiled under ``uuid``, where Inductor keeps it with
    the graph's cache entry. Closes the open lookup first (it was a miss)."""
    close_lookup()
    group, prefix = counters[_GROUP], _prefix(uuid)
    group[prefix + _GRAPHS] += 1
    if skipped:
        group[prefix + _SKIPPED] += skipped
    for key, n in counts.items():
        if n:
            group[prefix + key] += n


@dataclasses.dataclass
class Lookup:
    """A cache lookup under ``uuid`` by ``owner``, with its keys as they were when it began."""

    owner: weakref.ref[CacheListener]
    uuid: str
    before: collections.Counter[str]

    def served(self) -> CompileRecord | None:
        """What grew since the lookup began, or None if nothing did."""
        grown = _snapshot(self.uuid) - self.before
        graphs, skipped = grown.pop(_GRAPHS, 0), grown.pop(_SKIPPED, 0)
        return CompileRecord(graphs, dict(grown), skipped) if graphs else None


_open: Lookup | None = None


def open_lookup(owner: CacheListener, uuid: str) -> None:
    """A cache lookup under ``uuid`` begins (``owner.uuid()`` was called): close the previous
    one, snapshot the keys, and make sure the end of this compile closes it."""
    global _open
    close_lookup()
    _open = Lookup(weakref.ref(owner), uuid, _snapshot(uuid))
    _close_at_compile_end()


def close_lookup() -> None:
    """Close the open lookup, if any; tell its owner what the cache served during it."""
    global _open
    lookup, _open = _open, None
    if lookup is None:
        return
    owner, record = lookup.owner(), lookup.served()
    if owner is not None and record is not None:
        owner.served_from_cache(record)


def _on_compile_end(_args: object) -> None:
    close_lookup()


def _close_at_compile_end() -> None:
    """Register :func:`close_lookup` as a Dynamo compile-end callback, once (again after
    ``torch._dynamo.reset()``, which clears the callbacks). Without Dynamo's callback handler
    (older torch) lookups close at the next lookup, pass run or read of the counts."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is not None and _on_compile_end not in handler.end_callbacks:
        handler.register_end_callback(_on_compile_end)
