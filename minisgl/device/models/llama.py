"""The Llama decoder family: Llama (incl. Llama-3.1 rope scaling), Mistral, Qwen2, Qwen3 and
their mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral).

They differ only in small switches read from ModelConfig: q/k/v biases (Qwen2), per-head
q/k RMSNorm (Qwen3), tied embeddings, and a sparse MLP block (``SparseMoeBlock``: a router and
experts, Qwen2-MoE's gated shared expert) in the layers the config marks. Tokens of all
requests in a step are packed into one [T] sequence; attention goes through the installed
backend. Under tensor parallelism the row-parallel projections (o_proj, down_proj, the experts)
hand their partial sums to the norm after them, which all-reduces them together with its
residual add (``RMSNorm(..., reduce=True)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minisgl.checkpoint.model_config import ModelConfig
from minisgl.device import batch_invariant
from minisgl.device.attention.context import get_attention_backend
from minisgl.device.distributed import all_reduce, get_tp_info
from minisgl.device.kernels.fused import silu_and_mul
from minisgl.device.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.device.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minisgl.device.layers.moe import FusedMoE, RoutedExperts, route
from minisgl.device.layers.norm import RMSNorm
from minisgl.device.layers.quantization import Fp8Act
from minisgl.device.layers.rotary import RotaryEmbedding
from minisgl.utils import divide

if TYPE_CHECKING:
    from minisgl.device.worker.step_replay import StepReplay


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.head_dim = divide(config.num_heads, get_tp_info().size), config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, config.qkv_bias, config.quant
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, config.attention_bias, config.quant
        )
        self.rotary = rotary
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(
        self, x: torch.Tensor | Fp8Act, positions: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The query [T, Hq, D] of the qkv projection (written into ``out`` if given), with K and V
        stored in the cache: everything before attention that the step's metadata decides."""
        backend = get_attention_backend()
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if hasattr(self, "q_norm") else None
        return backend.rope_store(self.qkv_proj(x), positions, self.layer_id, self.rotary.cos_sin, norm, out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, size: int | None = None):
        super().__init__()
        size = size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], config.mlp_bias, config.quant)
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, config.quant)

    def forward(self, x: torch.Tensor | Fp8Act, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.down_proj.input_quant), reduce)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: a router picks each token's top-k experts (``layers.moe``);
    Qwen2-MoE adds a shared expert that every token passes, scaled by a sigmoid gate."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.capture: RoutedExperts | None = None  # set when requests may return their routing
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(
            config.num_experts, self.top_k, config.hidden_size, config.moe_intermediate_size, config.quant
        )
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """x [T, H] (never fp8: the router reads it); with ``reduce=False`` the partial sums."""
        weights, ids = route(batch_invariant.linear(x, self.gate.weight), self.top_k, self.renormalize)
        if self.capture is not None:
            self.capture.record(self.layer_id, ids)
        y = self.experts(x, weights, ids)
        if hasattr(self, "shared_expert"):
            gate = batch_invariant.linear(x, self.shared_expert_gate.weight)
            y = y + torch.sigmoid(gate) * self.shared_expert(x, reduce=False)
        return all_reduce(y) if reduce else y


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(config, layer_id, rotary)
        sparse = config.is_moe_layer(layer_id)
        self.mlp = SparseMoeBlock(config, layer_id) if sparse else MLP(config)
        # Under fp8 both norms hand their linear layer a quantized activation (a router reads floats).
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.quant)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, None if sparse else config.quant
        )
        self.defer = defers_reduce(config)

    def attention_input(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the embeddings (``residual`` None) or the last layer's MLP output, as partial sums
        when ``defer``; returns the query for attention (see ``Attention.project``) and the
        residual stream."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual, self.defer)
        return self.self_attn.project(x, positions, out), residual

    def attention_output(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From attention's output [T, Hq, D]: this layer's MLP output (partial sums when
        ``defer``) and the residual stream."""
        x = self.self_attn.o_proj(attn.flatten(1), not self.defer)
        x, residual = self.post_attention_layernorm(x, residual, self.defer)
        return self.mlp(x, not self.defer), residual

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, residual = self.attention_input(x, residual, positions)
        return self.attention_output(get_attention_backend().forward(q, self.self_attn.layer_id), residual)

    # The layer cut at attention for piecewise CUDA graphs (``DecoderModel.piece``): what comes
    # before it and after it replays from a graph, attention runs eagerly between them.
    @property
    def kv_layer(self) -> int:
        return self.self_attn.layer_id

    def piece_shapes(self) -> dict[str, tuple[int, ...]]:
        """The per-token buffers between the pieces: the query and attention's output."""
        heads = (self.self_attn.heads, self.self_attn.head_dim)
        return {"q": heads, "attn": heads}

    def mixer_input(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, bufs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return self.attention_input(x, residual, positions, bufs["q"])[1]

    def mix(self, tokens: int, bufs: dict[str, torch.Tensor], replay: StepReplay | None = None) -> None:
        attend_into(bufs, tokens, self.self_attn.layer_id)

    def mixer_output(self, bufs: dict[str, torch.Tensor], residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attention_output(bufs["attn"], residual)


def attend_into(bufs: dict[str, torch.Tensor], tokens: int, kv_layer: int) -> None:
    """Attention of the step's first ``tokens`` queries in ``bufs["q"]`` into ``bufs["attn"]``: an
    attention layer's eager part between its pieces."""
    get_attention_backend().forward(bufs["q"][:tokens], kv_layer, out=bufs["attn"][:tokens])


def defers_reduce(config: ModelConfig) -> bool:
    """Whether the row-parallel projections leave their all-reduce to the next norm: under
    tensor parallelism, unless a bias must be added after the sum or the partial sums are
    all-reduced in float32 (--enable-fp32-all-reduce)."""
    tp = get_tp_info()
    return tp.size > 1 and not tp.reduce_fp32 and not (config.attention_bias or config.mlp_bias)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.defer = defers_reduce(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions)
        x, _ = self.norm(x, residual, self.defer)
        return x

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def piece_buffers(self, tokens: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """Static buffers, ``tokens`` rows, for what passes between the pieces and the eager
        mixing (attention, or a linear-attention layer's recurrence) of every kind of layer."""
        shapes = {name: shape for layer in self.layers for name, shape in layer.piece_shapes().items()}
        return {name: torch.zeros(tokens, *shape, dtype=dtype, device=device) for name, shape in shapes.items()}

    def piece(
        self,
        i: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        residual: torch.Tensor,
        hidden_out: torch.Tensor,
    ) -> None:
        """Piece ``i`` of ``forward`` cut at each layer's mixing (piecewise CUDA graphs): from
        layer i-1's mixing output in ``bufs`` (piece 0: from the embeddings of ``input_ids``)
        through layer i's mixing input, written to ``bufs`` (with its K/V stored, for attention;
        the last piece: the final norm, written to ``hidden_out``). The residual stream lives in
        ``residual`` between pieces. Running every piece with ``mix(i)`` between them is
        ``forward``."""
        if i == 0:
            x, res = self.embed_tokens(input_ids), None
        else:
            x, res = self.layers[i - 1].mixer_output(bufs, residual)
        if i < len(self.layers):
            res = self.layers[i].mixer_input(x, res, positions, bufs)
        else:
            hidden_out.copy_(self.norm(x, res, self.defer)[0])
        if res.data_ptr() != residual.data_ptr():  # the fused norms update it in place; the torch ones do not
            residual.copy_(res)

    def mix(self, i: int, tokens: int, bufs: dict[str, torch.Tensor], replay: StepReplay | None = None) -> None:
        """Layer ``i``'s mixing over the step's first ``tokens`` rows of ``bufs``, between its
        pieces (``replay``: a layer kind whose mixing can replay one captured at an earlier
        layer of the step does)."""
        self.layers[i].mix(tokens, bufs, replay)


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our fused parameter, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint name part -> ours (Mixtral calls its sparse MLP block_sparse_moe)
    renamed_modules = {"block_sparse_moe": "mlp"}
    decoder: type[nn.Module] = DecoderModel  # the stack of layers (the hybrids have their own)

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.model = self.decoder(config, max_positions)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] for the packed new tokens of every request in the step."""
        return self.model(input_ids, positions)

    def compute_logits(
        self, hidden: torch.Tensor, gather: bool = True, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [N, vocab], or with ``gather=False`` this rank's vocabulary slice, into ``out``
        if given (``ParallelLMHead``)."""
        return self.lm_head(hidden, gather, out)
