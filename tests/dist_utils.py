"""The tests' spawn helper: ``fp4fuse.launch`` (shared with the demo)."""
from fp4fuse.launch import RankError, run_on_ranks

__all__ = ["RankError", "run_on_ranks"]
