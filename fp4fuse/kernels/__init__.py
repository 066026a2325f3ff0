"""fp4fuse's compute kernels, grouped by implementation language."""
