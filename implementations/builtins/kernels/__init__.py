"""Kernels: the Triton flash-attention kernel."""
