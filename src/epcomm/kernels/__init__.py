"""Data-movement and reduction kernels. Each op has a pure-torch twin (`<op>_torch`) used on CPU and in tests."""

from .reduce import canonical_reduce, canonical_reduce_torch, weighted_reduce_torch

__all__ = ["canonical_reduce", "canonical_reduce_torch", "weighted_reduce_torch"]
