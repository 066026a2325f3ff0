"""The distributed runtime the ops use: process groups and cross-rank agreement (``groups``), and
the CUDA symmetric-memory workspaces, overlap policy and pipelines (``symm_mem``).

Knows nothing of graphs or patterns; imports only ``fp4fuse.config`` and torch.
"""
