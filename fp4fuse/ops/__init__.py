"""fp4fuse's custom ops (``torch.ops.fp4fuse.*``). Importing this package registers them."""
from fp4fuse.ops import all_reduce_ops, collective_ops, fp4_ops, norm_ops, rank_check, sp_ops  # noqa: F401  (registration side effects)
from fp4fuse.ops.backend import Backend, backend_for

__all__ = ["Backend", "backend_for"]
