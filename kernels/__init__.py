"""Triton kernels (installed as kvlab.kernels)."""
