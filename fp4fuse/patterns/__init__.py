"""Pattern definitions for fp4fuse's passes, one family per module.

* ``base``: shared pattern-matcher utilities (match recording, collective decoding, size checks,
  ``register_replacement`` helpers).
* ``async_tp_fp4``: all_gather + ``mm_fp4`` and ``mm_fp4`` + reduce_scatter -> fp4fuse collective GEMMs.
* ``async_tp_bf16``: bf16 ``aten.mm`` + all_gather / reduce_scatter -> ``torch.ops.symm_mem.*`` (CUDA).
* ``sp_*``: sequence-parallelism patterns.
"""
