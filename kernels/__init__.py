"""Triton kernels the shared layers and the core call (each with a torch reference elsewhere)."""
