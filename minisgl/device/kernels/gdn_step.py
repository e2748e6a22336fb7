"""One decode step of Gated DeltaNet in two Triton kernels that read and write the state pool's
rows in place, by slot.

A decode step's cost is its states: each request's [heads, k_dim, v_dim] float32 matrix is read
and written once per layer (2 MB per request per layer at Qwen3.5-35B-A3B's shape), so the step
is bound by memory. Gathering the rows into a batch, stepping and scattering them back moves
them three times; these kernels move them once, and take the slots from a device tensor, so a
CUDA graph replays them for whatever slots the step's requests hold. ``conv_step`` is the causal
conv of one token (its last inputs kept in the pool's conv rows), ``delta_step`` the gates, the
L2 norms and the gated delta rule. ``causal_conv_step`` and ``gated_delta_rule`` in
``layers/gated_delta.py`` are their reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(
    x_ptr, w_ptr, conv_ptr, slots_ptr, y_ptr,
    C, x_stride, conv_stride,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = c < C
    slot = tl.load(slots_ptr + row).to(tl.int64)
    state = conv_ptr + slot * conv_stride + c * WIDTH
    x = tl.load(x_ptr + row * x_stride + c, mask=live, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + c * (WIDTH + 1) + WIDTH, mask=live, other=0.0).to(tl.float32)
    for i in tl.static_range(WIDTH):
        past = tl.load(state + i, mask=live, other=0.0)
        acc += past.to(tl.float32) * tl.load(w_ptr + c * (WIDTH + 1) + i, mask=live, other=0.0).to(tl.float32)
        if i > 0:  # shift the kept inputs down by one, then the new one last
            tl.store(state + i - 1, past, mask=live)
    tl.store(state + WIDTH - 1, x.to(conv_ptr.dtype.element_ty), mask=live)
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + row * C + c, y.to(y_ptr.dtype.element_ty), mask=live)


def conv_step(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """SiLU of the causal conv of one token per request: ``x`` [B, C], ``weight`` [C, W + 1],
    ``conv`` [rows, C, W] (one layer's rows, contiguous), ``slots`` [B]; the requests' rows
    shift in the new input. Returns [B, C] in ``x``'s dtype."""
    b, c = x.shape
    width = conv.shape[-1]
    y = torch.empty(b, c, dtype=x.dtype, device=x.device)
    block = 256
    _conv_step_kernel[(b, triton.cdiv(c, block))](
        x, weight, conv, slots, y, c, x.stride(0), conv.stride(0), WIDTH=width, BLOCK_C=block
    )
    return y


@triton.jit
def _delta_step_kernel(
    mixed_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, ssm_ptr, slots_ptr, o_ptr,
    mixed_stride, ab_stride, ssm_stride, scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    kh = head // (HV // HK)  # the key head this value head reads
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_live, v_live = ks < DK, vs < DV
    base = mixed_ptr + row * mixed_stride
    q = tl.load(base + kh * DK + ks, mask=k_live, other=0.0).to(tl.float32)
    k = tl.load(base + HK * DK + kh * DK + ks, mask=k_live, other=0.0).to(tl.float32)
    v = tl.load(base + 2 * HK * DK + head * DV + vs, mask=v_live, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
    a = tl.load(a_ptr + row * ab_stride + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus)
    beta = tl.sigmoid(tl.load(b_ptr + row * ab_stride + head).to(tl.float32))
    slot = tl.load(slots_ptr + row).to(tl.int64)
    cells = ssm_ptr + slot * ssm_stride + head * DK * DV + ks[:, None] * DV + vs[None, :]
    live = k_live[:, None] & v_live[None, :]
    s = tl.load(cells, mask=live, other=0.0).to(tl.float32) * decay
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s += k[:, None] * delta[None, :]
    tl.store(cells, s.to(ssm_ptr.dtype.element_ty), mask=live)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + (row * HV + head) * DV + vs, o, mask=v_live)


def delta_step(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm: torch.Tensor,
    slots: torch.Tensor,
    key_heads: int,
) -> torch.Tensor:
    """The gated delta rule for one token per request, from the conv's output ``mixed`` [B, q|k|v]
    (q and k un-normalised), the gate inputs ``a`` and ``b`` [B, Hv] and the layer's ``A_log``
    and ``dt_bias``; ``ssm`` [rows, Hv, dk, dv] (one layer's rows, contiguous) is updated in the
    requests' ``slots``. Returns o [B, Hv, dv] float32."""
    rows, hv, dk, dv = ssm.shape
    n = mixed.shape[0]
    o = torch.empty(n, hv, dv, dtype=torch.float32, device=mixed.device)
    block_v = min(32, triton.next_power_of_2(dv))
    _delta_step_kernel[(n, hv, triton.cdiv(dv, block_v))](
        mixed, a, b, a_log, dt_bias, ssm, slots, o,
        mixed.stride(0), a.stride(0), ssm.stride(0), dk**-0.5,
        HK=key_heads, HV=hv, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
    )  # fmt: skip
    return o
