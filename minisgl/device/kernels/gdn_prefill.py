"""The elementwise parts of a Gated DeltaNet prefill step in Triton, around FLA's chunked kernel.

In torch, the causal conv of a step's prompts (a padded gather, a depthwise conv, a transpose),
the SiLU, the L2 norms of q and k, the gates and the gated output norm are some twenty kernels
per layer, most of them passes over [tokens, channels] in float32 with strided reads: at
Qwen3.5-35B-A3B's shape they took more GPU time than the layer's recurrence and its MoE together.
Here each is one pass: ``conv_prefill`` reads q|k|v once and writes the normalised q, k and v
FLA takes (and the conv states the step leaves), ``gates`` makes the decay and write strength,
``gated_norm`` normalises and gates the output. They read the step's indices from the device,
so ``StepReplay``'s graphs replay them. ``varlen_conv``, ``l2norm`` and ``GatedDeltaNet.output``
in ``layers/gated_delta.py`` are their torch reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from minisgl.device.kvcache.state_pool import PrefillIndex


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, states_ptr, token_req_ptr, req_start_ptr, q_ptr, k_ptr, v_ptr,
    T, x_stride,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    C: tl.constexpr = 2 * HK * DK + HV * DV
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    ts = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    ds = tl.arange(0, BLOCK_D)
    is_v = head >= 2 * HK
    dim = tl.where(is_v, DV, DK)
    ch = tl.where(is_v, 2 * HK * DK + (head - 2 * HK) * DV, head * DK) + ds
    t_live, d_live = ts < T, ds < dim
    live = t_live[:, None] & d_live[None, :]
    req = tl.load(token_req_ptr + ts, mask=t_live, other=0).to(tl.int64)
    pos = ts - tl.load(req_start_ptr + req, mask=t_live, other=0)  # the token's place in its request
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(WIDTH + 1):  # tap j reads the input WIDTH - j tokens back
        p = pos - WIDTH + j
        in_x = (p >= 0)[:, None]
        x = tl.load(x_ptr + (ts - WIDTH + j)[:, None] * x_stride + ch[None, :], mask=live & in_x, other=0.0)
        kept = states_ptr + req[:, None] * (C * WIDTH) + ch[None, :] * WIDTH + (WIDTH + p)[:, None]
        s = tl.load(kept, mask=live & ~in_x, other=0.0)
        w = tl.load(w_ptr + ch * (WIDTH + 1) + j, mask=d_live, other=0.0).to(tl.float32)
        acc += (x.to(tl.float32) + s.to(tl.float32)) * w[None, :]
    y = acc * tl.sigmoid(acc)
    if head < 2 * HK:  # q and k: L2-normalised per head
        y = y * tl.rsqrt(tl.sum(y * y, axis=1) + 1e-6)[:, None]
    rows = ts[:, None]
    if head < HK:
        tl.store(q_ptr + (rows * HK + head) * DK + ds[None, :], y.to(q_ptr.dtype.element_ty), mask=live)
    elif head < 2 * HK:
        tl.store(k_ptr + (rows * HK + head - HK) * DK + ds[None, :], y.to(k_ptr.dtype.element_ty), mask=live)
    else:
        tl.store(v_ptr + (rows * HV + head - 2 * HK) * DV + ds[None, :], y.to(v_ptr.dtype.element_ty), mask=live)


@triton.jit
def _conv_state_kernel(
    x_ptr, states_ptr, conv_ptr, dst_ptr, point_req_ptr, point_len_ptr, req_start_ptr,
    C, x_stride, conv_stride,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    point = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = c < C
    req = tl.load(point_req_ptr + point).to(tl.int64)
    n = tl.load(point_len_ptr + point)
    start = tl.load(req_start_ptr + req)
    dst = conv_ptr + tl.load(dst_ptr + point).to(tl.int64) * conv_stride + c * WIDTH
    for i in tl.static_range(WIDTH):  # the last WIDTH inputs up to the point: tokens, or older kept ones
        p = n - WIDTH + i
        if p >= 0:
            value = tl.load(x_ptr + (start + p) * x_stride + c, mask=live, other=0.0)
        else:
            value = tl.load(states_ptr + req * (C * WIDTH) + c * WIDTH + WIDTH + p, mask=live, other=0.0)
        tl.store(dst + i, value.to(conv_ptr.dtype.element_ty), mask=live)


def conv_prefill(
    qkv: torch.Tensor,
    weight: torch.Tensor,
    conv: torch.Tensor,
    index: PrefillIndex,
    base: torch.Tensor | None,
    heads: tuple[int, int, int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SiLU of the causal conv of the step's tokens ``qkv`` [T, C] after their requests' kept
    inputs (rows of ``conv`` [rows, C, W], from ``base`` when it is every layer's rows), with q
    and k L2-normalised: q, k [T, Hk, dk] and v [T, Hv, dv] in ``qkv``'s dtype. The states after
    the points ``index`` names are written to their rows. ``heads``: Hk, dk, Hv, dv."""
    hk, dk, hv, dv = heads
    t, c = qkv.shape
    width = conv.shape[-1]
    req_rows, dst = (index.req_slots, index.state_dst) if base is None else (index.req_slots + base, index.state_dst + base)
    states = conv[req_rows]  # (a copy: the points may overwrite rows that tokens still read)
    q = torch.empty(t, hk, dk, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q)
    v = torch.empty(t, hv, dv, dtype=qkv.dtype, device=qkv.device)
    block_t = 32
    _conv_kernel[(triton.cdiv(t, block_t), 2 * hk + hv)](
        qkv, weight, states, index.token_req, index.req_start, q, k, v, t, qkv.stride(0),
        HK=hk, HV=hv, DK=dk, DV=dv, WIDTH=width, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(max(dk, dv)),
    )  # fmt: skip
    block_c = 256
    _conv_state_kernel[(dst.shape[0], triton.cdiv(c, block_c))](
        qkv, states, conv, dst, index.point_req, index.point_len, index.req_start,
        c, qkv.stride(0), conv.stride(0), WIDTH=width, BLOCK_C=block_c,
    )  # fmt: skip
    return q, k, v


@triton.jit
def _gates_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, T, a_stride, b_stride,
    H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = tl.arange(0, BLOCK_H)
    h_live = hs < H
    live = (ts < T)[:, None] & h_live[None, :]
    a = tl.load(a_ptr + ts[:, None] * a_stride + hs[None, :], mask=live, other=0.0).to(tl.float32)
    a += tl.load(dt_bias_ptr + hs, mask=h_live, other=0.0).to(tl.float32)[None, :]
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    decay = tl.exp(tl.load(a_log_ptr + hs, mask=h_live, other=0.0).to(tl.float32))[None, :]
    tl.store(g_ptr + ts[:, None] * H + hs[None, :], -decay * softplus, mask=live)
    b = tl.load(b_ptr + ts[:, None] * b_stride + hs[None, :], mask=live, other=0.0).to(tl.float32)
    tl.store(beta_ptr + ts[:, None] * H + hs[None, :], tl.sigmoid(b), mask=live)


def gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log decay g = -exp(A_log) * softplus(a + dt_bias) and the write strength
    beta = sigmoid(b) of ``a``, ``b`` [T, Hv] (rows may be strided): float32 [T, Hv] each."""
    t, h = a.shape
    g = torch.empty(t, h, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    block_t = 64
    _gates_kernel[(triton.cdiv(t, block_t),)](
        a, b, a_log, dt_bias, g, beta, t, a.stride(0), b.stride(0),
        H=h, BLOCK_T=block_t, BLOCK_H=triton.next_power_of_2(h),
    )  # fmt: skip
    return g, beta


@triton.jit
def _gated_norm_kernel(
    o_ptr, z_ptr, w_ptr, y_ptr, rows, eps,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rs = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    ds = tl.arange(0, BLOCK_D)
    d_live = ds < D
    live = (rs < rows)[:, None] & d_live[None, :]
    cells = rs[:, None] * D + ds[None, :]
    o = tl.load(o_ptr + cells, mask=live, other=0.0).to(tl.float32)
    normed = o * tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)[:, None]
    normed = normed.to(o_ptr.dtype.element_ty).to(tl.float32)  # (rounded where the reference rounds)
    normed *= tl.load(w_ptr + ds, mask=d_live, other=0.0).to(tl.float32)[None, :]
    z = tl.load(z_ptr + cells, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + cells, (normed * z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=live)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head of ``o`` [T, Hv, dv] times SiLU(``z``): [T, Hv * dv] in ``z``'s dtype."""
    t, h, d = o.shape
    o, z = o.contiguous(), z.contiguous()
    y = torch.empty(t, h * d, dtype=z.dtype, device=z.device)
    block_r = 16
    _gated_norm_kernel[(triton.cdiv(t * h, block_r),)](
        o, z, weight, y, t * h, eps, D=d, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d)
    )
    return y
