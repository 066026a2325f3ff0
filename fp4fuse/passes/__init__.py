"""fp4fuse's post-grad passes and the ``FusionPass`` manager that runs them in order.

``FusionGraphPass`` (base) is the interface of one pass; ``FusionPass`` (manager) is the
``CustomGraphPass`` handed to Inductor as ``post_grad_custom_post_pass``.
"""
from fp4fuse.passes.base import FusionGraphPass, process_group_fingerprint
from fp4fuse.passes.manager import FusionPass

__all__ = ["FusionGraphPass", "FusionPass", "process_group_fingerprint"]
