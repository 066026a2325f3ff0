"""fp4fuse's post-grad passes and the ``FusionPass`` manager that runs them in order."""
from fp4fuse.passes.base import FusionGraphPass, process_group_fingerprint

__all__ = ["FusionGraphPass", "process_group_fingerprint"]
