"""kvstrata.kernels."""
