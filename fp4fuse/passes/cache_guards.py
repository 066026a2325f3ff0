"""Compile-cache guards that say what they mean: each guard of a cached graph parenthesized.

PyTorch's FX graph cache and AOT autograd cache keep several graphs under one key when they were
compiled for different sizes: the graph before the post-grad passes is the same, and the passes'
choices differ by the guards they installed (fp4fuse's ``rows % group_size == 0`` and
``rows >= min_tokens``; fp4fuse.patterns.base.threshold_reason). A lookup serves the first entry
whose guard expression holds for the call's sizes. ``ShapeEnv.produce_guards_expression`` writes
that expression as the guards joined with ``" and "``, and prints a disjunction guard (a
``sympy.Or``, as a view's size check installs: ``Eq(a, b) | Eq(Mod(a, b), 0)``) as ``a or b``,
without parentheses (seen in torch 2.13). Python reads ``g1 and a or b and g2`` as
``(g1 and a) or (b and g2)``, so an entry is served to sizes that fail its guards.

Seen with Hugging Face Phi-3 at TP=2 (CPU, gloo): with warm caches, one rank ran the graph compiled
for 4096+ tokens at 1024 tokens and the other the right one, and they hung in mismatched
collectives. At one rank the wrong graph runs silently; a graph that shards tokens, served an odd
count, miscomputes or fails.

:func:`install` (called by ``FusionPass()``) replaces the method with one that parenthesizes every
guard; it changes no guard, only how the expression is written, for every compile of the process.
Entries that older code wrote are not served to it: this module's source is part of
``FusionPass.uuid()``.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Sequence

from torch.fx.experimental.symbolic_shapes import ShapeEnv

__all__ = ["install", "installed"]

logger = logging.getLogger(__name__)

#: the signature the replacement is written against
_EXPECTED_PARAMETERS = ("self", "placeholders", "guards", "ignore_static")


def _produce_parenthesized_guards_expression(
    self: ShapeEnv, placeholders: Sequence[Any], *, guards: list | None = None, ignore_static: bool = True,
) -> str | None:
    """``ShapeEnv.produce_guards_expression`` with each guard in parentheses: the same guards, for
    ``evaluate_guards_expression`` over the placeholders ``t0, t1, ...``."""
    from torch._dynamo.source import LocalSource

    arg_names = [f"t{i}" for i in range(len(placeholders))]
    produced = self.produce_guards(placeholders, [LocalSource(a) for a in arg_names], guards=guards,
                                   ignore_static=ignore_static)
    return " and ".join(f"({guard})" for guard in produced) if produced else None


def installed() -> bool:
    """Whether this process writes parenthesized guard expressions."""
    return getattr(ShapeEnv.produce_guards_expression, "_fp4fuse_parenthesized", False)


def install() -> None:
    """Make ``ShapeEnv.produce_guards_expression`` parenthesize each guard (once per process).

    If this torch's method takes other parameters than the ones the replacement is written for, it
    is left alone with a warning: the caches then keep torch's own expressions."""
    if installed():
        return
    original = ShapeEnv.produce_guards_expression
    parameters = tuple(inspect.signature(original).parameters)
    if parameters != _EXPECTED_PARAMETERS:
        logger.warning("fp4fuse: ShapeEnv.produce_guards_expression takes %s, not %s; its guard expressions "
                       "are left unparenthesized (a cached graph whose guards include a disjunction can "
                       "be served to sizes outside them)", parameters, _EXPECTED_PARAMETERS)
        return
    replacement = functools.wraps(original)(_produce_parenthesized_guards_expression)
    replacement._fp4fuse_parenthesized = True  # type: ignore[attr-defined]
    ShapeEnv.produce_guards_expression = replacement
    logger.debug("fp4fuse: compile-cache guard expressions parenthesize each guard")
