"""Triton kernels."""
