"""Pattern families for fp4fuse's passes, one family per module.

* ``base``: shared FX helpers (match recording, node and collective decoding, size checks,
  tracing and inlining, ``register_replacement`` patterns).
* ``collectives``: the shapes functional all-gathers and reduce-scatters take in a post-grad graph.
* ``rank_uniform``: which values are the same on every TP rank, and the run-time check of the
  graph inputs that rests on.
* ``sequence_parallel``: ``all_reduce -> rms_norm`` -> ``reduce_scatter -> rms_norm -> all_gather``,
  for fp4fuse's norm ops and the torch forms (Hugging Face's included), on ``[..., hidden]``.
* ``quant_before_gather``: NVFP4 quantization moved before the all-gather (SP's NVFP4 half).
* ``async_tp_fp4``: all_gather + ``mm_fp4`` and ``mm_fp4`` + reduce_scatter -> fp4fuse collective GEMMs.
* ``async_tp_bf16``: bf16 ``aten.mm`` + all_gather / reduce_scatter -> ``torch.ops.symm_mem.*`` (CUDA).
"""
