"""Device code: fp4fuse's Triton kernels (``triton/``: quantize, GEMMs, norms, ordered reduction)
and the flashinfer adapter for SM100+ (``flashinfer``, written to flashinfer's API, never run).

Launchers here take validated tensors; validation and the choice of kernel family live in
``fp4fuse.ops``.
"""
