"""fp4fuse's post-grad passes and the ``FusionPass`` manager that runs them in order.

``GraphPass`` (base) is the interface of one pass of the pipeline; ``FusionPass`` (manager) is the
``CustomGraphPass`` handed to Inductor as ``post_grad_custom_post_pass``.
"""
from fp4fuse.passes.base import GraphPass, process_group_fingerprint
from fp4fuse.passes.manager import FusionPass

__all__ = ["GraphPass", "FusionPass", "process_group_fingerprint"]
