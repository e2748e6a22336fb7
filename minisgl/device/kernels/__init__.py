"""Python side of the custom kernels: CUDA sources in the top-level kernels/csrc/, compiled on first use."""

from minisgl.device.kernels.rope_store import rope_store, rope_store_torch, store_kv_torch

__all__ = ["rope_store", "rope_store_torch", "store_kv_torch"]
