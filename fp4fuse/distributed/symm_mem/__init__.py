"""Symmetric-memory runtime of the overlapped collective GEMMs (CUDA, P2P only, never multicast).

* ``workspace``: per-group P2P buffers, their layouts, side streams and signals;
* ``policy``: when a collective GEMM overlaps (thresholds), which all-gather schedule, why not;
* ``pipelines``: the communication schedules; the per-shard work is a consumer object the caller
  passes in (``fp4fuse.ops.collective_gemm.RowBlockGemm`` for the NVFP4 GEMMs).
"""
