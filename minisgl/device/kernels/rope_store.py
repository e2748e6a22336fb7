"""rope_store: a layer's step from the qkv projection to the KV cache, in one kernel on CUDA.

Between the qkv GEMM and attention a layer normalizes q and k per head (Qwen3), rotates them,
and writes k and v into their cache slots. Done as separate torch or FlashInfer ops that is
four to twelve launches per layer, each reading and writing the activations; the JIT kernel in
kernels/csrc/rope_store.cu does it in one. The torch version is the reference (CPU, tests).
"""

from __future__ import annotations

import torch

from minisgl.device.kernels.fused import rmsnorm_torch
from minisgl.device.kernels.jit import load_module
from minisgl.device.layers.quantization import FP8, to_fp8
from minisgl.utils import into

KERNEL_HEAD_DIMS = (32, 64, 128, 256)


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Values as a cache of ``dtype`` holds them: fp8 caches store x / scale, saturated."""
    return to_fp8(x, scale) if dtype == FP8 else x.to(dtype)


def from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 values of cache entries (times the scale for an fp8 cache)."""
    return x.float() * scale if x.dtype == FP8 else x.float()


def store_kv_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_loc: torch.Tensor,
    scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Caches are [pages, page_size, H, D] layer views (contiguous); ``out_loc`` holds slot ids
    (page * page_size + offset), which are row numbers of the cache seen as [slots, H, D]."""
    loc = out_loc.long()
    for cache, x, scale in ((k_cache, k, scales[0]), (v_cache, v, scales[1])):
        x = to_cache(x, cache.dtype, scale)
        if cache.dtype == FP8:  # index_copy_ has no fp8 kernels: copy the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, loc, x)


def rotate_half_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_rows(cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, 1, D/2] of ``positions`` from the [max_pos, D] cos | sin table."""
    cos, sin = cos_sin[positions].unsqueeze(1).to(dtype).chunk(2, dim=-1)
    return cos, sin


def rope_store_torch(
    qkv: torch.Tensor,
    num_q_heads: int,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """``rope_store`` in torch ops; ``rows``: (cos, sin) [T, 1, D/2] of ``positions`` if the
    caller already has them (the same for every layer of a step)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    heads = qkv.view(qkv.shape[0], -1, head_dim)
    qk, v = heads[:, : num_q_heads + num_kv_heads], heads[:, num_q_heads + num_kv_heads :]
    if norm is not None:
        q_weight, k_weight, eps = norm
        q, k = qk.split([num_q_heads, num_kv_heads], dim=1)
        qk = torch.cat([rmsnorm_torch(q, q_weight, eps), rmsnorm_torch(k, k_weight, eps)], dim=1)
    cos, sin = rows if rows is not None else rope_rows(cos_sin, positions, qkv.dtype)
    # q and k side by side in one rotation: half the ops of rotating each (they are a CPU step's
    # per-layer overhead on a small model). A table narrower than the heads rotates their first
    # dimensions only (partial rotary).
    rot = cos_sin.shape[-1]
    if rot < head_dim:
        qk = torch.cat([rotate_half_torch(qk[..., :rot], cos, sin), qk[..., rot:]], dim=-1)
    else:
        qk = rotate_half_torch(qk, cos, sin)
    q, k = qk.split([num_q_heads, num_kv_heads], dim=1)
    store_kv_torch(k_cache, v_cache, k, v, out_loc, scales)
    return q.contiguous()


def rope_store(
    qkv: torch.Tensor,
    num_q_heads: int,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    scales: tuple[float, float] = (1.0, 1.0),
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k of ``qkv`` [T, (Hq + 2 Hk) * D] by ``positions`` (rotate-half layout,
    ``cos_sin`` = [max_pos, R] float32 cos | sin: the first R dimensions of each head, R = D
    unless the rotary is partial), after a per-head RMSNorm when ``norm`` = (q_weight, k_weight,
    eps) is given. K and V go to slots ``out_loc`` of the [pages, page_size, Hk, D] cache views
    (an fp8 cache stores K / scales[0] and V / scales[1]); returns q as a contiguous [T, Hq, D],
    written into ``out`` (contiguous) if given."""
    head_dim = k_cache.shape[3]
    if not qkv.is_cuda or head_dim not in KERNEL_HEAD_DIMS or cos_sin.shape[-1] != head_dim:
        q = rope_store_torch(qkv, num_q_heads, positions, cos_sin, k_cache, v_cache, out_loc, norm, scales=scales)
        return into(q, out)
    q = out if out is not None else torch.empty(qkv.shape[0], num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    empty = qkv.new_empty(0)
    q_weight, k_weight, eps = norm if norm is not None else (empty, empty, 0.0)
    load_module("rope_store").rope_store(
        qkv,
        q,
        k_cache,
        v_cache,
        positions,
        out_loc,
        cos_sin,
        q_weight,
        k_weight,
        eps,
        1.0 / scales[0],
        1.0 / scales[1],
        torch.cuda.current_stream().cuda_stream,
    )
    return q
