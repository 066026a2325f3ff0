"""No-op view elimination: the first pass of the pipeline.

A chain of views (``aten.view.dtype``, ``aten.view``, ``aten.reshape``, ``aten._unsafe_view``)
that ends where it started -- same dtype, shape and strides as an earlier tensor of the chain --
is a no-op. Inductor's ``remove_noop_ops`` drops single no-op views; it keeps round trips such as
``s.view(uint8).view(float8_e4m3fn)``, which hide the producer of a tensor from the fusion
patterns that run next::

    before:  v1 = view.dtype(s, uint8);  v2 = view.dtype(v1, float8_e4m3fn);  mm_fp4(.., v2, ..)
    after:   mm_fp4(.., s, ..)                       # v1, v2 erased once unused

Graph outputs keep their own node (a graph output must not become an input or another output),
so only their other uses are redirected.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fp4fuse.passes.base import GraphPass
from fp4fuse.patterns import base
from fp4fuse.patterns.base import VIEW_OPS, erase_if_unused, fake_value, is_call, shapes_known_equal

__all__ = ["NoOpViewCleanupPass", "find_noop_source", "fold_noop_views", "read_sizes_from_graph_inputs"]

aten = torch.ops.aten

PATTERN = "noop_view"


def _is_view(node: object) -> bool:
    return is_call(node, *VIEW_OPS)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and shapes_known_equal(a.shape, b.shape) and shapes_known_equal(a.stride(), b.stride())


def find_noop_source(view: fx.Node) -> fx.Node | None:
    """The earliest tensor up ``view``'s chain of views with ``view``'s exact layout, if any."""
    out = fake_value(view)
    if not isinstance(out, torch.Tensor):
        return None
    source = None
    node = view
    while _is_view(node):
        node = node.args[0]
        if not isinstance(node, fx.Node):
            break
        val = fake_value(node)
        if isinstance(val, torch.Tensor) and _same_layout(val, out):
            source = node
    return source


def fold_noop_views(graph: fx.Graph) -> int:
    """Replace every no-op view chain of ``graph`` by its source (graph outputs keep their node);
    returns how many views lost readers. Also run by passes that create such chains."""
    touched: list[fx.Node] = []
    for node in list(graph.nodes):
        if not _is_view(node) or len(node.users) == 0:
            continue
        source = find_noop_source(node)
        if source is None:
            continue
        before = len(node.users)
        node.replace_all_uses_with(source, delete_user_cb=lambda user: user.op != "output")
        if len(node.users) < before:
            touched.append(node)
    for node in touched:
        chain = [node]
        while _is_view(chain[-1]) and isinstance(chain[-1].args[0], fx.Node):
            chain.append(chain[-1].args[0])
        erase_if_unused([n for n in chain if _is_view(n)])  # with the size reads only they needed
    return len(touched)


def read_sizes_from_graph_inputs(graph: fx.Graph) -> int:
    """Point every ``aten.sym_size`` read of an intermediate tensor whose size is one of the graph's
    SymInt inputs (a dynamic dimension Dynamo lifted, e.g. the batch) at that input, and erase the
    read; returns how many reads moved. Rewrites that view a tensor to rows and back (sequence
    parallelism) size the way back from the first view; read from the input instead, that size no
    longer keeps the view, and through it the producer, alive as an extra reader."""
    inputs: dict[object, fx.Node] = {}
    for placeholder in graph.find_nodes(op="placeholder"):
        val = fake_value(placeholder)
        if isinstance(val, torch.SymInt) and val.node.expr.is_Symbol:
            inputs.setdefault(val.node.expr, placeholder)
    moved = 0
    for read in list(graph.find_nodes(op="call_function", target=aten.sym_size.int)):
        val, source = fake_value(read), read.args[0]
        if isinstance(val, torch.SymInt) and source.op != "placeholder" and val.node.expr in inputs:
            read.replace_all_uses_with(inputs[val.node.expr])
            erase_if_unused([read])
            moved += 1
    return moved


class NoOpViewCleanupPass(GraphPass):
    """Replace every no-op view chain by its source (always on; changes no numerics)."""

    name = "cleanup"
    source_modules = (base,)

    def __call__(self, graph: fx.Graph) -> int:
        self.recorder.reset()
        folded = fold_noop_views(graph)
        if folded:
            self.recorder.matched(PATTERN, folded)
        return self.finish()
