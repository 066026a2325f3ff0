"""The NVFP4 format and its pure-torch references, the quantizer and amax groups, and the
``NVFP4Tensor`` weight subclass.

* ``format``: e2m1 / e4m3 encoding, packing, global scales, reference quantize / dequantize / GEMM,
  128x4 scale swizzle;
* ``norms``: RMSNorm references;
* ``quantizer``: amax-reduction groups keyed by integer IDs, ``NVFP4Quantizer``;
* ``tensor``: ``NVFP4Tensor`` (FSDP2 hooks, DCP's subclass protocol, frozen-weight autograd).

Nothing here imports fp4fuse's ops, kernels, distributed runtime or passes.
"""
