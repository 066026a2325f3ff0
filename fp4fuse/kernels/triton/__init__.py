"""fp4fuse's Triton kernels for GPUs without FP4 tensor cores (SM80/SM90)."""
