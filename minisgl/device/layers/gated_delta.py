"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5, with its torch reference.

Per token the layer projects q, k, v (and the output gate z, the write strength b, the decay a),
runs q|k|v through a short causal depthwise conv (SiLU), L2-normalises q and k, and updates one
[k_dim, v_dim] matrix per value head with the gated delta rule:

    S = exp(g) * S;  S += k (beta * (v - S^T k))^T;  o = S^T q / sqrt(k_dim)

with g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b). The output is RMS-normalised
per head, gated by SiLU(z) and projected back. A request's conv inputs and matrices live in the
``StatePool`` between steps, so a prompt may be split into chunks and decoding goes on from
where the prompt left it. The recurrence here, token by token in float32, is the reference the
faster kernels are compared against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.checkpoint.model_config import ModelConfig
from minisgl.device.distributed import get_tp_info
from minisgl.device.kernels.fused import rmsnorm_torch
from minisgl.device.kvcache.state_pool import PrefillIndex, get_state_pool
from minisgl.device.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.utils import divide

if TYPE_CHECKING:
    from minisgl.device.worker.step_replay import StepReplay


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """SiLU of the causal depthwise conv of ``x`` [n, C] (``weight`` [C, W + 1]) after the W
    inputs in ``state`` [C, W], which then holds the last W inputs."""
    full = torch.cat([state.to(x.dtype), x.t()], dim=1)
    y = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0]).squeeze(0)
    state.copy_(full[:, -state.shape[1] :])
    return F.silu(y).t()


def _pool_rows(rows: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """Pool rows ``rows`` of one layer, as rows of the pool flattened over layers from ``base``."""
    return rows if base is None else rows + base


def varlen_conv(
    x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, index: PrefillIndex, base: torch.Tensor | None = None
) -> torch.Tensor:
    """``causal_conv`` of every request of a step at once: each request's state inputs (its row
    of ``conv`` [rows, C, W]) are laid before its tokens (rows of ``x`` [T, C]) in one padded
    sequence, one depthwise conv runs over it, and its columns at the tokens are the outputs.
    The states after the points ``index`` names (each request's last token, part-way snapshots)
    are written to their rows. ``base``: a device offset added to every pool row (``conv`` is
    then every layer's rows, flattened)."""
    states = conv[_pool_rows(index.req_slots, base)].transpose(1, 2).reshape(-1, x.shape[1]).to(x.dtype)
    padded = torch.cat([states, x])[index.order]
    y = F.conv1d(padded.t().unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0]).squeeze(0)
    conv[_pool_rows(index.state_dst, base)] = padded[index.state_rows].transpose(1, 2).to(conv.dtype)
    return F.silu(y[:, index.outputs].t())


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """``causal_conv`` of one token per request: ``x`` [B, C], ``states`` [B, C, W] (the
    requests' rows, returned updated in ``states``); returns [B, C]."""
    full = torch.cat([states.to(x.dtype), x.unsqueeze(-1)], dim=-1)
    states.copy_(full[..., 1:])
    return F.silu((full * weight).sum(-1))


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """The recurrence over time: q, k [B, n, H, dk] (normalised, q scaled), v [B, n, H, dv], g
    and beta [B, n, H], ``state`` [B, H, dk, dv] float32 (updated). Returns o [B, n, H, dv] in
    float32."""
    s = state.float()
    out = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kv = (s * k[:, t, ..., None]).sum(-2)
        delta = (v[:, t] - kv) * beta[:, t, ..., None]
        s = s + k[:, t, ..., None] * delta[..., None, :]
        out.append((s * q[:, t, ..., None]).sum(-2))
    state.copy_(s)
    return torch.stack(out, dim=1)


def fla_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm: torch.Tensor,
    pool,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gated_delta_rule`` over every prompt chunk of the step in flash-linear-attention's varlen
    chunked kernel: normalised q, k [T, Hk, dk] (each key head shared by its value heads, q
    scaled in the kernel), v [T, Hv, dv], float32 g and beta [T, Hv]; states gathered from the
    pool's rows and written back. FLA's forward is called below its autograd wrapper, whose
    checks and casts cost as much host time as its kernels take on the GPU. ``base`` as in
    ``varlen_conv``."""
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    def run(rows: torch.Tensor | None, initial: torch.Tensor, cu_seqlens: torch.Tensor, chunks: torch.Tensor):
        pick = (lambda x: x[None]) if rows is None else (lambda x: x[None, rows])
        _, o, _, final, _, _ = chunk_gated_delta_rule_fwd(
            q=pick(q), k=pick(k), v=pick(v), g=pick(g), beta=pick(beta), scale=q.shape[-1] ** -0.5,
            initial_state=initial, output_final_state=True, cu_seqlens=cu_seqlens, chunk_indices=chunks,
        )  # fmt: skip
        return o, final

    index, slots = pool.prefill, _pool_rows(pool.slots, base)
    o, ht = run(None, ssm[slots], index.cu_seqlens, index.chunk_indices)
    sp = index.splits
    if sp is None:
        ssm[slots] = ht.to(ssm.dtype)
        return o[0]
    # Requests saving a snapshot part-way: their first segments' states are the snapshots, and
    # their second segments run again from those (the first pass ran them from a stale state).
    ssm[_pool_rows(sp.save_rows, base)] = ht[sp.heads].to(ssm.dtype)
    ssm[_pool_rows(sp.final_slots, base)] = ht[sp.finals].to(ssm.dtype)
    o2, ht2 = run(sp.tokens, ht[sp.heads], sp.cu_seqlens, sp.chunk_indices)
    ssm[_pool_rows(sp.tail_slots, base)] = ht2.to(ssm.dtype)
    o = o[0]
    o[sp.tokens] = o2[0]
    return o


class SplitColumnLinear(ColumnParallelLinear):
    """A column-parallel layer whose checkpoint holds its fused parts in one tensor (Qwen3.5's
    in_proj_qkv: q, k and v stacked): the tensor is cut into the parts, each sharded."""

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, part: int | str | None = None) -> None:
        if part is not None:
            return super().load_shard(param, loaded, part)
        sizes = self.output_sizes
        if param is self.weight_scale and loaded.shape[0] != sum(sizes):  # block scales: a row per block
            block = self.quant.block
            if any(s % block for s in sizes):
                raise ValueError(f"fp8 blocks of {block} rows cut across the fused q/k/v parts {sizes}")
            sizes = [s // block for s in sizes]
        for i, piece in enumerate(loaded.split(sizes, dim=0)):
            super().load_shard(param, piece, i)

    def checkpoint_shape(self, attr: str, part: int | str | None) -> tuple[int, ...] | None:
        if part is not None:
            return super().checkpoint_shape(attr, part)
        return {"weight": (sum(self.output_sizes), self.input_size)}.get(attr)


class ConvWeight(nn.Module):
    """The depthwise conv's weight [C, W + 1] (the checkpoint's [C, 1, W + 1]): this rank's
    channels of each of q, k and v."""

    def __init__(self, parts: list[int], width: int):
        super().__init__()
        self.parts, self.width = parts, width
        local = sum(divide(p, get_tp_info().size) for p in parts)
        self.weight = nn.Parameter(torch.empty(local, width), requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param: nn.Parameter, loaded: torch.Tensor, part: None = None) -> None:
        rank, size = get_tp_info().rank, get_tp_info().size
        pieces = [p.narrow(0, rank * (p.shape[0] // size), p.shape[0] // size) for p in loaded.split(self.parts)]
        param.data.copy_(torch.cat(pieces).reshape(param.shape))

    def checkpoint_shape(self, attr: str, part: None = None) -> tuple[int, ...] | None:
        return (sum(self.parts), 1, self.width) if attr == "weight" else None


class GatedDeltaNet(nn.Module):
    """``grouped``: Qwen3-Next's projections (q, k, v, z and b, a interleaved per key head in two
    matrices); otherwise Qwen3.5's (q|k|v, z, b, a apart). Heads are split across ranks."""

    def __init__(self, config: ModelConfig, index: int, grouped: bool):
        super().__init__()
        tp = get_tp_info()
        self.index = index  # among the linear layers: its rows of the state pool
        self.grouped = grouped
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.hk, self.hv = divide(hk, tp.size), divide(hv, tp.size)
        self.ratio = hv // hk  # value heads per key head
        h, quant = config.hidden_size, config.quant  # (fp8: the large projections; b and a stay float)
        if grouped:
            self.in_proj_qkvz = ColumnParallelLinear(h, [hk * (2 * self.dk + 2 * self.ratio * self.dv)], quant=quant)
            self.in_proj_ba = ColumnParallelLinear(h, [hv * 2])
        else:
            self.in_proj_qkv = SplitColumnLinear(h, [hk * self.dk, hk * self.dk, hv * self.dv], quant=quant)
            self.in_proj_z = ColumnParallelLinear(h, [hv * self.dv], quant=quant)
            self.in_proj_b = ColumnParallelLinear(h, [hv])
            self.in_proj_a = ColumnParallelLinear(h, [hv])
        self.conv1d = ConvWeight([hk * self.dk, hk * self.dk, hv * self.dv], config.linear_conv_kernel_dim)
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        for p in (self.A_log, self.dt_bias):
            p.weight_loader = self._load_heads
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv), requires_grad=False)
        self.eps = config.rms_norm_eps
        self.out_proj = RowParallelLinear(hv * self.dv, h, quant=quant)

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor, part: None = None) -> None:
        param.data.copy_(loaded.narrow(0, get_tp_info().rank * self.hv, self.hv))

    def checkpoint_shape(self, attr: str, part: None = None) -> tuple[int, ...] | None:
        return None  # (its own parameters' loaders check their pieces)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """qkv [T, C] (conv input, q|k|v channels), z [T, Hv, dv], b and a [T, Hv]."""
        t = x.shape[0]
        if not self.grouped:
            z = self.in_proj_z(x).view(t, self.hv, self.dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r, dk, dv = self.ratio, self.dk, self.dv
        q, k, v, z = self.in_proj_qkvz(x).view(t, self.hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, self.hv, dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv, z, b, a = self._project(x)
        return self.output(self.mix(qkv, b, a).to(x.dtype), z)

    def mix(
        self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, params: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The conv and the recurrence of the step's tokens from their requests' states: o [T, Hv, dv].
        ``params`` (prefill only): ``replay_tensors``' stand-ins for this layer's own, which a
        graph captured at another layer reads (``StepReplay``)."""
        pool = get_state_pool()
        conv, ssm = pool.conv[self.index], pool.ssm[self.index]
        if qkv.is_cuda and pool.decode:  # in place by slot, in two kernels (CUDA graphs replay them)
            from minisgl.device.kernels.gdn_step import conv_step, delta_step

            mixed = conv_step(qkv.contiguous(), self.conv1d.weight, conv, pool.slots)
            return delta_step(mixed, a.contiguous(), b.contiguous(), self.A_log, self.dt_bias, ssm, pool.slots, self.hk)
        if params is None:
            params = [self.conv1d.weight, self.A_log, self.dt_bias, None]
        else:  # (every layer's rows, addressed from the layer's base row)
            conv, ssm = pool.conv.flatten(0, 1), pool.ssm.flatten(0, 1)
        return self._mix(qkv, b, a, conv, ssm, pool, *params)

    def replay_tensors(self) -> list[torch.Tensor]:
        """What the mixing reads of this layer: its conv weight, gate parameters and the first
        row of its layer in the flattened state pool."""
        return [self.conv1d.weight, self.A_log, self.dt_bias, get_state_pool().layer_base[self.index]]

    def output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated per-head norm of ``o`` [T, Hv, dv] (in the model's dtype), projected back."""
        if o.is_cuda:
            from minisgl.device.kernels.gdn_prefill import gated_norm

            return self.out_proj(gated_norm(o, z, self.norm.weight, self.eps))
        o = rmsnorm_torch(o, self.norm.weight, self.eps) * F.silu(z.float())
        return self.out_proj(o.to(z.dtype).reshape(o.shape[0], -1))

    # For piecewise CUDA graphs (``HybridLayer``): the projections and ``output`` replay from
    # graphs, ``mix`` runs eagerly between them on static buffers.
    def piece_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            "qkv": (2 * self.hk * self.dk + self.hv * self.dv,), "z": (self.hv, self.dv), "b": (self.hv,),
            "a": (self.hv,), "o": (self.hv, self.dv),
        }  # fmt: skip

    def project_into(self, x: torch.Tensor, bufs: dict[str, torch.Tensor]) -> None:
        for name, value in zip(("qkv", "z", "b", "a"), self._project(x)):
            bufs[name].copy_(value)

    def mix_into(self, tokens: int, bufs: dict[str, torch.Tensor], replay: StepReplay | None = None) -> None:
        def run(params: list[torch.Tensor] | None = None) -> None:
            bufs["o"][:tokens].copy_(self.mix(bufs["qkv"][:tokens], bufs["b"][:tokens], bufs["a"][:tokens], params))

        if replay is None or get_state_pool().decode:
            return run()
        replay.run("gated_delta", self.replay_tensors(), run)

    def _mix(
        self,
        qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        pool,
        weight: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        base: torch.Tensor | None,
    ) -> torch.Tensor:
        """The conv and the gated delta rule in torch (on the GPU, a prefill step's in
        ``gdn_prefill``'s kernels and FLA's chunked one): o [T, Hv, dv] (float32 in torch), the
        requests' rows of ``conv`` and ``ssm`` updated.
        ``base`` (CUDA prefill): ``conv`` and ``ssm`` are every layer's rows, this layer's from it."""
        if qkv.is_cuda:  # (prefill: decode steps on the GPU take ``mix``'s kernels)
            from minisgl.device.kernels.gdn_prefill import conv_prefill, gates

            heads = (self.hk, self.dk, self.hv, self.dv)
            q, k, v = conv_prefill(qkv, weight, conv, pool.prefill, base, heads)
            return fla_chunked(q, k, v, *gates(a, b, A_log, dt_bias), ssm, pool, base)
        if pool.decode:
            states = conv[pool.slots]
            mixed = causal_conv_step(qkv, weight, states)
            conv[pool.slots] = states
        else:
            mixed = varlen_conv(qkv, weight, conv, pool.prefill, base)
        t, qk = qkv.shape[0], 2 * self.hk * self.dk
        q, k = l2norm(mixed[:, :qk].reshape(t, 2 * self.hk, self.dk).float()).split(self.hk, dim=1)
        v = mixed[:, qk:].reshape(t, self.hv, self.dv)
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())  # log decay
        beta = b.float().sigmoid()  # write strength
        q = q.repeat_interleave(self.ratio, dim=1) * self.dk**-0.5
        k, v = k.repeat_interleave(self.ratio, dim=1), v.float()
        if pool.decode:  # one token per request: every request in one batched step
            states = ssm[pool.slots]
            o = gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], states)[:, 0]
            ssm[pool.slots] = states
            return o
        out = []
        for slot, s, n, save in pool.segments:  # (in order: a request's second segment after its first)
            rows = slice(s, s + n)
            out.append(
                gated_delta_rule(
                    q[None, rows], k[None, rows], v[None, rows], g[None, rows], beta[None, rows], ssm[slot : slot + 1]
                )[0]
            )
            if save >= 0:
                ssm[save] = ssm[slot]
        return torch.cat(out)
