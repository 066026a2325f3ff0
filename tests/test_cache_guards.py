"""fp4fuse.passes.cache_guards: a compile cache serves each graph only to the sizes its guards admit.

The expected values come from the guards themselves, evaluated in Python one by one (the meaning of
a conjunction), and from the two graphs' arithmetic (x * 2 below the threshold, x * 3 from it)."""
from __future__ import annotations

import glob
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch._dynamo.source import LocalSource
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.utils import fresh_cache
from torch.fx.experimental.symbolic_shapes import ShapeEnv, sym_or

from fp4fuse import FusionPass
from fp4fuse.passes import cache_guards
from fp4fuse.patterns.base import threshold_reason


def _meaning(rows: int) -> bool:
    """The guards of ``_guarded_shape_env`` as written: ``rows % 2 == 0 and (rows == 8 or rows % 3 == 0)``."""
    return rows % 2 == 0 and (rows == 8 or rows % 3 == 0)


def _guarded_shape_env() -> tuple[ShapeEnv, torch.SymInt]:
    shape_env = ShapeEnv()
    rows = shape_env.create_symintnode(shape_env.create_symbol(8, LocalSource("rows")), hint=8)
    assert rows % 2 == 0                       # a divisibility guard, as sequence parallelism installs
    assert sym_or(rows == 8, rows % 3 == 0)    # a disjunction, as a view's size check installs
    return shape_env, rows


def test_each_guard_of_a_cached_graph_keeps_its_meaning():
    FusionPass()
    assert cache_guards.installed()
    shape_env, rows = _guarded_shape_env()
    expression = shape_env.produce_guards_expression([rows])
    for value in range(2, 40):
        admitted = shape_env.evaluate_guards_expression(expression, [value])
        assert admitted == _meaning(value), (value, expression)


def test_an_unpickled_fusion_pass_installs_the_fix_in_its_process():
    """Inductor's compile subprocess receives the pass pickled: it must write the same expressions."""
    check = ("import pickle, sys; pickle.loads(sys.stdin.buffer.read()); "
             "from fp4fuse.passes import cache_guards; print(cache_guards.installed())")
    done = subprocess.run([sys.executable, "-c", check], input=pickle.dumps(FusionPass()),
                          capture_output=True, timeout=120, check=True)
    assert done.stdout.decode().split()[-1] == "True", done.stderr.decode()[-2000:]


def test_torch_alone_misreads_the_disjunction():
    """Why the fix exists (and a witness that the test above can fail): torch's own expression
    admits odd sizes. If a torch release writes it right, this test says so and skips."""
    shape_env, rows = _guarded_shape_env()
    expression = ShapeEnv.produce_guards_expression.__wrapped__(shape_env, [rows])
    wrong = [v for v in range(2, 40) if shape_env.evaluate_guards_expression(expression, [v]) != _meaning(v)]
    if not wrong:
        pytest.skip(f"this torch parenthesizes its guard expressions: {expression}")
    assert 9 in wrong, (wrong, expression)


THRESHOLD = 32


class _TimesThreeFromThreshold(CustomGraphPass):
    """Post-grad: ``x * 2`` becomes ``x * 3`` from THRESHOLD rows, decided with fp4fuse's own
    threshold_reason (the guard on the side chosen), after a disjunction guard on the same rows.
    Both graphs share the cache key of the graph before the pass."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.target is torch.ops.aten.mul.Tensor and node.args[1] == 2:
                rows = node.args[0].meta["val"].shape[0]
                assert sym_or(rows % 4 == 0, rows % 5 == 0)
                if threshold_reason(rows, THRESHOLD) is None:
                    node.args = (node.args[0], 3)

    def uuid(self) -> str:
        return "fp4fuse-tests-times-three-from-threshold"


def _double_and_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum(-1)


def _aot_entries(directory: str) -> dict[str, list[str]]:
    """Guard expressions of the AOT autograd cache's entries, by key (torch's on-disk layout:
    ``aotautograd/<key>/<entry>``, a pickle with ``guards_expr``)."""
    by_key: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "aotautograd", "*", "*"))):
        with open(path, "rb") as f:
            by_key.setdefault(os.path.basename(os.path.dirname(path)), []).append(pickle.load(f).guards_expr)
    return by_key


def test_a_warm_cache_serves_each_size_the_graph_compiled_for_its_side(tmp_path):
    FusionPass()
    # Cold: 5 compiles the graph below THRESHOLD, 40 the one above, 8 reuses the first. Warm (a new
    # process, as Dynamo sees it): 8 and 40 (at least) are served from the cache.
    with fresh_cache(dir=str(tmp_path)):
        for warm, sizes in ((False, (5, 40, 8)), (True, (8, 40, 5))):
            torch._dynamo.reset()
            hits = counters["aot_autograd"]["autograd_cache_hit"]
            options = {"post_grad_custom_post_pass": _TimesThreeFromThreshold()}
            compiled = torch.compile(_double_and_sum, options=options)
            for rows in sizes:
                x = torch.randn(rows, 3, generator=torch.Generator().manual_seed(rows))
                torch._dynamo.mark_dynamic(x, 0)
                expected = (x * (2 if rows < THRESHOLD else 3)).sum(-1)
                assert torch.equal(compiled(x), expected), (warm, rows)
            served = counters["aot_autograd"]["autograd_cache_hit"] - hits
            assert served >= 2 if warm else served == 0, (warm, served)
        entries = _aot_entries(cache_dir())
    # one key, two entries: the graph before the pass is the same on both sides
    (shared,) = [guards for guards in entries.values() if len(guards) == 2]
    for rows in range(2, 61):
        admitting = [g for g in shared if ShapeEnv().evaluate_guards_expression(g, [rows])]
        # the pass's guards: (rows % 4 == 0 or rows % 5 == 0), and rows < THRESHOLD or rows >= THRESHOLD
        assert len(admitting) == (1 if rows % 4 == 0 or rows % 5 == 0 else 0), (rows, shared)
