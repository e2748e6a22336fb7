"""Mixture-of-experts layers: the router's choice and the experts that carry it out.

``FusedMoE`` holds every expert of a layer stacked: [gate | up] as ``w13_weight`` [E, 2 I, H]
and ``down`` as ``w2_weight`` [E, H, I], where I is this rank's share of the expert width (tensor
parallelism splits each expert like a dense MLP: w13 by rows, w2 by columns, partial sums
all-reduced after). Under an ``Fp8Scheme`` both are e4m3 with per-row scales, as the linear
layers keep theirs. On CUDA in 16-bit the Triton path of ``kernels.moe`` runs; the loop over
experts here is the reference every faster path is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.device import batch_invariant
from minisgl.device.distributed import get_tp_info
from minisgl.device.layers.fp8_scheme import Fp8Scheme
from minisgl.device.layers.linear import (
    Piece,
    float_weight,
    input_shard,
    load_column_shard,
    load_row_shard,
    make_weight,
)
from minisgl.device.layers.quantization import dequantize, quantize
from minisgl.utils import has_module


def _fused(x: torch.Tensor, top_k: int) -> bool:
    """Whether the Triton path runs: CUDA with Triton, k a power of two (the top-k kernel's)."""
    return x.is_cuda and has_module("triton") and top_k & (top_k - 1) == 0


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts from its router logits [T, E]: softmax in float32, the k
    largest, renormalized to sum to one if the model says so. Returns (weights float32 [T, k],
    expert ids int32 [T, k])."""
    if _fused(logits, top_k):
        from minisgl.device.kernels.moe import topk_softmax

        return topk_softmax(logits, top_k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _fake_quant(x: torch.Tensor, quant: Fp8Scheme | None) -> torch.Tensor:
    """x as the fp8 GEMM sees it: quantized per token (and group) and back, in float32."""
    if quant is None:
        return x
    act = quantize(x, quant.block)
    return dequantize(act.data, act.scale, quant.block)


def experts_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    quant: Fp8Scheme | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: for each expert in use, its tokens through SiLU(x Wg^T) * (x Wu^T) Wd^T,
    scaled by their routing weight and summed into their rows (fp8 weights dequantized, the
    activations quantized where the fused path quantizes them)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        up, down = w13[e], w2[e]
        if quant is not None:
            up = dequantize(up, w13_scale[e], quant.block)
            down = dequantize(down, w2_scale[e], quant.block)
        # Rounded where the fused path rounds: the first GEMM's output to the model dtype, the
        # SiLU-and-mul product to it (or, under fp8, quantized straight from float32).
        gate_up = batch_invariant.linear(_fake_quant(x[token], quant).float(), up.float()).to(x.dtype).float()
        gate, value = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * value
        act = act.to(x.dtype).float() if quant is None else _fake_quant(act, quant).float()
        out.index_add_(0, token, batch_invariant.linear(act, down.float()) * weights[token, slot, None])
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    """The experts of one sparse layer; ``forward`` returns this rank's partial sums."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, quant: Fp8Scheme | None):
        super().__init__()
        self.num_experts, self.top_k, self.hidden, self.intermediate = num_experts, top_k, hidden, intermediate
        self.quant = quant
        self.local = input_shard(intermediate, quant, "the experts' down projection")
        self.w13_weight, self.w13_weight_scale = make_weight(2 * self.local, hidden, quant, num_experts)
        self.w2_weight, self.w2_weight_scale = make_weight(hidden, self.local, quant, num_experts)
        for param in (self.w13_weight, self.w13_weight_scale, self.w2_weight, self.w2_weight_scale):
            if param is not None:
                param.weight_loader = self.load

    def checkpoint_shape(self, attr: str, part: tuple[int | None, int | None]) -> tuple[int, ...] | None:
        """One expert's checkpoint tensor (all experts' stacked when the part names none); None
        for fp8 scales."""
        expert, _ = part
        shapes = {"w13_weight": (self.intermediate, self.hidden), "w2_weight": (self.hidden, self.intermediate)}
        shape = shapes.get(attr)
        if shape is None or expert is not None:
            return shape
        return (self.num_experts, *shape)

    def checkpoint_piece(self, attr: str, part: tuple[int | None, int | None], rows: int) -> Piece:
        """This rank's share of one expert's tensor (all experts' stacked when the part names
        none; at most ``rows`` along the first dimension) in float32: rows of the gate or up
        projection, input columns of the down one."""
        expert, shard = part
        experts = slice(None) if expert is None else expert
        if attr == "w13_weight":
            own = slice(shard * self.local, (shard + 1) * self.local)
            weight, scale, dim = self.w13_weight, self.w13_weight_scale, 0
        else:
            own, weight, scale, dim = slice(None), self.w2_weight, self.w2_weight_scale, 1
        scale = None if scale is None else scale.data[experts, own][:rows]
        values = float_weight(weight.data[experts, own][:rows], scale, self.quant)
        return values, dim + (expert is None), get_tp_info().rank * self.local, self.local

    def load(self, param: nn.Parameter, loaded: torch.Tensor, part: tuple[int | None, int | None]) -> None:
        """``part``: (expert, 0 gate / 1 up / None down); expert None loads a stacked tensor."""
        expert, shard = part
        if expert is None:
            for e in range(loaded.shape[0]):
                self.load(param, loaded[e], (e, shard))
            return
        start = get_tp_info().rank * self.local
        if param is self.w13_weight or param is self.w13_weight_scale:
            rows = slice(shard * self.local, (shard + 1) * self.local)
            scale = None if self.quant is None else self.w13_weight_scale.data[expert, rows]
            is_scale = param is self.w13_weight_scale
            load_row_shard(
                self.w13_weight.data[expert, rows], scale, loaded, is_scale, self.quant, self.intermediate, start
            )
        else:
            scale = None if self.quant is None else self.w2_weight_scale.data[expert]
            is_scale = param is self.w2_weight_scale
            load_column_shard(self.w2_weight.data[expert], scale, loaded, is_scale, self.quant, start)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] in the model dtype with its routing (``route``); returns [T, H]."""
        if _fused(x, self.top_k) and x.shape[0] > 0:
            from minisgl.device.kernels.moe import fused_experts

            return fused_experts(self, x, weights, ids)
        return experts_torch(
            x, self.w13_weight, self.w2_weight, weights, ids, self.quant, self.w13_weight_scale, self.w2_weight_scale
        )


class RoutedExperts:
    """Each sparse layer's expert ids for the step's token rows, kept on the device
    ([layers, rows, k] int32; -1 in dense layers) so requests can return their routing
    (``--enable-return-routed-experts``). Writes are copies into a fixed buffer, so they replay
    inside CUDA graphs."""

    def __init__(self, num_layers: int, rows: int, top_k: int, device: torch.device):
        self.ids = torch.full((num_layers, rows, top_k), -1, dtype=torch.int32, device=device)

    def record(self, layer: int, ids: torch.Tensor) -> None:
        self.ids[layer, : ids.shape[0]].copy_(ids)

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), layers, k] for the given token rows of the last step."""
        return self.ids[:, rows].transpose(0, 1).contiguous()
