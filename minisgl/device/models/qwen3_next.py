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
from minisgl.device.models.llama import MLP, LlamaForCausalLM, SparseMoeBlock
from minisgl.utils import divide


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg, kv = self._split(x)
        q, gate = qg.view(t, self.heads, 2, d).unbind(2)
        backend = get_attention_backend()
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q = backend.rope_store(
            torch.cat([q.reshape(t, -1), kv], dim=-1), positions, self.kv_layer, self.rotary.cos_sin, norm
        )
        out = backend.forward(q, self.kv_layer).reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qkv = self.qkv_proj(x)
        q_size = 2 * self.heads * self.head_dim
        return qkv[:, :q_size], qkv[:, q_size:]


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

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.linear_attn(h) if hasattr(self, "linear_attn") else self.self_attn(h, positions)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.rotary_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(HybridLayer(config, i, rotary) for i in range(config.num_layers))
        self.norm = zero_centred(RMSNorm(config.hidden_size, config.rms_norm_eps))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions)
        x, _ = self.norm(x, residual)
        return x


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Llama's head and weight names over the hybrid stack (Qwen3.5's classes too)."""

    decoder = HybridModel
