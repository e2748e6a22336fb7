"""The hybrid decoders: Qwen3-Next and Qwen3.5 (dense and MoE), text only.

Most layers are Gated DeltaNet (``layers.gated_delta``: a recurrent state per request, kept in
the ``StatePool``); every few layers one is gated full attention: the Llama attention with a
per-head output gate (q_proj yields each head's query and gate side by side), per-head q/k norm
and rotary on the first ``partial_rotary_factor`` of each head. Only those layers keep KV: the
KV pool holds ``config.attention_layers``, numbered in order. The norms are zero-centred
(``x * (1 + w)``): their weights are stored as 1 + w when they load, so the plain RMSNorm (and
its fused kernels) computes them. The MLP is Llama's dense one or its sparse block with Qwen's
gated shared expert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minisgl.checkpoint.model_config import ModelConfig
from minisgl.device.attention.context import get_attention_backend
from minisgl.device.distributed import get_tp_info
from minisgl.device.layers.embedding import VocabParallelEmbedding
from minisgl.device.layers.gated_delta import GatedDeltaNet
from minisgl.device.layers.linear import QKVParallelLinear, RowParallelLinear
from minisgl.device.layers.norm import RMSNorm
from minisgl.device.layers.rotary import RotaryEmbedding
from minisgl.device.models.llama import MLP, DecoderModel, LlamaForCausalLM, SparseMoeBlock, attend_into
from minisgl.utils import divide

if TYPE_CHECKING:
    from minisgl.device.worker.step_replay import StepReplay


def zero_centred(norm: RMSNorm) -> RMSNorm:
    """A norm whose checkpoint weight w means a scale of 1 + w (it loads as 1 + w)."""
    norm.weight.weight_loader = lambda param, loaded, part=None: param.data.copy_(loaded.float() + 1.0)
    return norm


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, kv_layer: int, rotary: RotaryEmbedding):
        super().__init__()
        self.kv_layer = kv_layer  # its layer of the KV pool
        self.heads, self.head_dim = divide(config.num_heads, get_tp_info().size), config.head_dim
        # The query and the gate of each head come side by side: 2 x heads "heads" of the fused q part.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            2 * config.num_heads,
            config.num_kv_heads,
            config.attention_bias,
            config.quant,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, config.attention_bias, config.quant
        )
        self.q_norm = zero_centred(RMSNorm(config.head_dim, config.rms_norm_eps))
        self.k_norm = zero_centred(RMSNorm(config.head_dim, config.rms_norm_eps))
        self.rotary = rotary

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query [T, H, D] (into ``out`` if given; K and V stored) and the output gate [T, H * D]."""
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        q_size = 2 * self.heads * d
        q, gate = qkv[:, :q_size].view(t, self.heads, 2, d).unbind(2)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q = get_attention_backend().rope_store(
            torch.cat([q.reshape(t, -1), qkv[:, q_size:]], dim=-1), positions, self.kv_layer, self.rotary.cos_sin,
            norm, out,
        )  # fmt: skip
        return q, gate.reshape(t, -1)

    def output(self, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn.reshape(attn.shape[0], -1) * torch.sigmoid(gate))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, gate = self.project(x, positions)
        return self.output(get_attention_backend().forward(q, self.kv_layer), gate)


class HybridLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        if layer_id in config.linear_layers:
            grouped = config.architecture == "Qwen3NextForCausalLM"
            self.linear_attn = GatedDeltaNet(config, config.linear_layers.index(layer_id), grouped)
        else:
            self.self_attn = GatedAttention(config, config.attention_layers.index(layer_id), rotary)
        self.mlp = SparseMoeBlock(config, layer_id) if config.is_moe_layer(layer_id) else MLP(config)
        self.input_layernorm = zero_centred(RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.post_attention_layernorm = zero_centred(RMSNorm(config.hidden_size, config.rms_norm_eps))

    def _norm_in(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm(x, residual)

    def _finish(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self._norm_in(x, residual)
        h = self.linear_attn(h) if hasattr(self, "linear_attn") else self.self_attn(h, positions)
        return self._finish(h, residual)

    # Cut at the mixing for piecewise CUDA graphs (``DecoderModel.piece``): a linear layer's
    # conv and recurrence, or attention, run eagerly (they follow the requests), the rest replays.
    @property
    def kv_layer(self) -> int | None:
        return self.self_attn.kv_layer if hasattr(self, "self_attn") else None

    def piece_shapes(self) -> dict[str, tuple[int, ...]]:
        if hasattr(self, "linear_attn"):
            return self.linear_attn.piece_shapes()
        heads = (self.self_attn.heads, self.self_attn.head_dim)
        return {"q": heads, "attn": heads, "gate": (heads[0] * heads[1],)}

    def mixer_input(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, bufs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        h, residual = self._norm_in(x, residual)
        if hasattr(self, "linear_attn"):
            self.linear_attn.project_into(h, bufs)
        else:
            bufs["gate"].copy_(self.self_attn.project(h, positions, bufs["q"])[1])
        return residual

    def mix(self, tokens: int, bufs: dict[str, torch.Tensor], replay: StepReplay | None = None) -> None:
        if hasattr(self, "linear_attn"):
            self.linear_attn.mix_into(tokens, bufs, replay)
        else:
            attend_into(bufs, tokens, self.self_attn.kv_layer)

    def mixer_output(self, bufs: dict[str, torch.Tensor], residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if hasattr(self, "linear_attn"):
            h = self.linear_attn.output(bufs["o"], bufs["z"])
        else:
            h = self.self_attn.output(bufs["attn"], bufs["gate"])
        return self._finish(h, residual)


class HybridModel(DecoderModel):
    def __init__(self, config: ModelConfig, max_positions: int):
        nn.Module.__init__(self)
        self.defer = False  # (the row-parallel projections all-reduce themselves)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.rotary_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(HybridLayer(config, i, rotary) for i in range(config.num_layers))
        self.norm = zero_centred(RMSNorm(config.hidden_size, config.rms_norm_eps))


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Llama's head and weight names over the hybrid stack (Qwen3.5's classes too)."""

    decoder = HybridModel
