"""Python side of the custom kernels: CUDA sources in kernels/csrc compiled on first use."""

from minisgl.kernels.store import store_kv, store_kv_torch

__all__ = ["store_kv", "store_kv_torch"]
