"""Kernel families, one file each. Every file holds the torch reference of its math (used by the
CPU reference runtime and as the oracle for the GPU kernels); the GPU kernels live beside them."""
