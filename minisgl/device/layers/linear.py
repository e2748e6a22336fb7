"""Linear layers that shard over tensor-parallel ranks.

Column-parallel layers split their output features, row-parallel layers their input features
(and all-reduce the result). Each parameter carries a ``weight_loader`` that cuts the rank's
shard out of a full checkpoint tensor, so loading is the same code at any tp size.

Under an ``Fp8Scheme`` the weight is float8 with per-row scales (``weight_scale``, see
``layers.quantization``): a float checkpoint tensor is quantized whole before it is cut (so every
rank holds the scales of the full rows), an fp8 one is cut with its scales.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.device import batch_invariant
from minisgl.device.distributed import all_reduce, all_reduce_max, get_tp_info
from minisgl.device.layers.fp8_scheme import Fp8Scheme
from minisgl.device.layers.lora import LoraWeights
from minisgl.device.layers.quantization import (
    FP8,
    FP8_MAX,
    MIN_SCALE,
    Fp8Act,
    dequantize,
    fp8_linear,
    quantize_weight,
    row_scales,
    to_fp8,
)
from minisgl.utils import cdiv, divide


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T kept in the GEMM's float32 accumulator (CUDA half dtypes), not rounded to x's dtype;
    written into ``out`` (float32 [T, N], contiguous) when given."""
    x2 = x.reshape(-1, x.shape[-1])
    if out is not None:
        return torch.mm(x2, weight.t(), out_dtype=torch.float32, out=out)
    return torch.mm(x2, weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], weight.shape[0])  # zero rows happen


def quantize_across_ranks(x: torch.Tensor) -> Fp8Act:
    """A row-parallel layer's input [T, K / tp] quantized per token with the scale of the whole
    row over every rank's columns (an all-reduced amax), as tp=1 quantizes it: the rounding then
    does not depend on the tp size (--enable-fp32-all-reduce)."""
    amax = all_reduce_max(x.abs().amax(dim=-1, keepdim=True).float())
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return Fp8Act(to_fp8(x, scale), scale, x.dtype)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows split across ranks; several checkpoint matrices may be fused.

    ``output_sizes`` lists the full (unsharded) sizes of the fused parts, e.g. [gate, up].
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, quant: Fp8Scheme | None = None):
        super().__init__()
        tp = get_tp_info()
        self.quant = quant
        self.input_size = input_size
        self.output_sizes = output_sizes
        self.local_sizes = [self._local_size(i, s, tp.size) for i, s in enumerate(output_sizes)]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(output_sizes))]
        self.weight, self.weight_scale = make_weight(sum(self.local_sizes), input_size, quant)
        self.weight.weight_loader = self.load_shard
        if quant is not None:
            self.weight_scale.weight_loader = self.load_shard
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False)
            self.bias.weight_loader = self.load_shard
        self.lora: LoraWeights | None = None  # --enable-lora: the adapters' stacked weights

    def _local_size(self, part: int, size: int, tp_size: int) -> int:
        return divide(size, tp_size)

    def _source_start(self, part: int, tp_rank: int) -> int:
        """Row in the full checkpoint tensor where this rank's shard of ``part`` starts."""
        return tp_rank * self.local_sizes[part]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, part: int | str | None = None) -> None:
        idx = self._part_index(part)
        rows = slice(self.offsets[idx], self.offsets[idx] + self.local_sizes[idx])
        start = self._source_start(idx, get_tp_info().rank)
        if param is self.bias:
            load_row_shard(param.data[rows], None, loaded, False, None, self.output_sizes[idx], start)
            return
        scale = None if self.weight_scale is None else self.weight_scale.data[rows]
        is_scale = param is self.weight_scale
        load_row_shard(self.weight.data[rows], scale, loaded, is_scale, self.quant, self.output_sizes[idx], start)

    def checkpoint_shape(self, attr: str, part: int | str | None) -> tuple[int, ...] | None:
        """The full checkpoint tensor ``attr`` (of ``part``) loads from; None for fp8 scales,
        whose shape depends on the checkpoint's scheme."""
        rows = self.output_sizes[self._part_index(part)]
        return {"weight": (rows, self.input_size), "bias": (rows,)}.get(attr)

    def checkpoint_piece(self, attr: str, part: int | str | None, rows: int) -> Piece:
        """This rank's rows of the checkpoint tensor ``attr`` (of ``part``; at most ``rows``),
        in float32."""
        idx = self._part_index(part)
        held = slice(self.offsets[idx], self.offsets[idx] + min(self.local_sizes[idx], rows))
        if attr == "bias":
            values = self.bias.data[held].float()
        else:
            scale = None if self.weight_scale is None else self.weight_scale.data[held]
            values = float_weight(self.weight.data[held], scale, self.quant)
        return values, 0, self._source_start(idx, get_tp_info().rank), self.local_sizes[idx]

    def _part_index(self, part: int | str | None) -> int:
        if part is None:
            if len(self.local_sizes) != 1:
                raise ValueError("a fused linear layer needs a shard id to load a part")
            return 0
        return int(part)

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        if self.quant is not None:
            y = fp8_linear(x, self.weight, self.weight_scale, self.bias, self.quant.block)
            return y if self.lora is None else self.lora.add(x, y, self.quant.block)
        y = batch_invariant.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.add(x, y)


# This rank's share of a checkpoint tensor's first rows (``checkpoint_piece``): its values in
# float32, the dimension the ranks split (None: every rank holds all of it), where the share starts
# along it and how long it is there. Cut to the rows asked for before any conversion.
Piece = tuple[torch.Tensor, int | None, int, int]


def float_weight(weight: torch.Tensor, scale: torch.Tensor | None, quant: Fp8Scheme | None) -> torch.Tensor:
    """A weight [..., rows, cols] in float32: fp8 ones dequantized with their per-row scales."""
    if quant is None:
        return weight.float()
    rows = weight.reshape(-1, weight.shape[-1])
    return dequantize(rows, scale.reshape(rows.shape[0], -1), quant.block).view(weight.shape)


def make_weight(rows: int, cols: int, quant: Fp8Scheme | None, *lead: int) -> tuple[nn.Parameter, nn.Parameter | None]:
    """The weight [*lead, rows, cols] (``lead``: e.g. the experts) in the default dtype, or fp8
    with its float32 per-row scales."""
    if quant is None:
        return nn.Parameter(torch.empty(*lead, rows, cols), requires_grad=False), None
    scale_shape = (*lead, rows) if quant.block is None else (*lead, rows, cdiv(cols, quant.block))
    return (
        nn.Parameter(torch.empty(*lead, rows, cols, dtype=FP8), requires_grad=False),
        nn.Parameter(torch.ones(scale_shape, dtype=torch.float32), requires_grad=False),
    )


def _layer_form(
    loaded: torch.Tensor, is_scale: bool, quant: Fp8Scheme | None, rows: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A full checkpoint tensor as (weight, per-row scales) in a layer's form: a checkpoint's
    scale tensor gives only scales; under fp8 a float weight is quantized whole (so the scales
    cover full rows whatever the shard); anything else is the weight as it is."""
    block = None if quant is None else quant.block
    if is_scale:
        return None, row_scales(loaded, rows, block)
    if quant is not None and loaded.dtype != FP8:
        return quantize_weight(loaded, block)
    return loaded, None


def load_row_shard(
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    loaded: torch.Tensor,
    is_scale: bool,
    quant: Fp8Scheme | None,
    rows: int,
    start: int,
) -> None:
    """Fill ``weight`` (a shard of ``weight.shape[0]`` rows) and its per-row ``scale`` from rows
    ``start``.. of a full checkpoint tensor of ``rows`` rows (or of its scales, ``is_scale``):
    column-parallel layers, an expert's gate or up projection."""
    new_weight, new_scale = _layer_form(loaded, is_scale, quant, rows)
    size = weight.shape[0]
    if new_scale is not None:
        scale.copy_(new_scale.narrow(0, start, size))
    if new_weight is not None:
        weight.copy_(new_weight.narrow(0, start, size))


def load_column_shard(
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    loaded: torch.Tensor,
    is_scale: bool,
    quant: Fp8Scheme | None,
    start: int,
) -> None:
    """Fill ``weight`` (a shard of ``weight.shape[1]`` input columns) and its ``scale`` from
    columns ``start``.. of a full checkpoint tensor (or of its scales): per channel the scales
    of whole rows, per block this rank's column groups. Row-parallel layers, an expert's down
    projection."""
    new_weight, new_scale = _layer_form(loaded, is_scale, quant, weight.shape[0])
    if new_scale is not None:
        if quant.block is not None:
            new_scale = new_scale.narrow(1, start // quant.block, scale.shape[-1])
        scale.copy_(new_scale)
    if new_weight is not None:
        weight.copy_(new_weight.narrow(1, start, weight.shape[1]))


def input_shard(size: int, quant: Fp8Scheme | None, what: str) -> int:
    """This rank's share of ``size`` input columns (row-parallel layers, the experts' down
    projection), which must hold whole fp8 column groups."""
    tp = get_tp_info()
    local = divide(size, tp.size)
    if quant is not None and quant.block is not None and tp.size > 1 and local % quant.block:
        raise ValueError(
            f"{what}'s {local} input columns per rank do not hold whole {quant.block}-column fp8 blocks at tp={tp.size}"
        )
    return local


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. KV heads are split across ranks, or replicated when tp > kv heads."""

    _PARTS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        quant: Fp8Scheme | None = None,
    ):
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], bias, quant)

    def _local_size(self, part: int, size: int, tp_size: int) -> int:
        if part == 0 or tp_size <= self.num_kv_heads:
            return divide(size, tp_size)
        return self.head_dim  # one replicated kv head per rank

    def _source_start(self, part: int, tp_rank: int) -> int:
        tp_size = get_tp_info().size
        if part == 0 or tp_size <= self.num_kv_heads:
            return tp_rank * self.local_sizes[part]
        kv_head = tp_rank * self.num_kv_heads // tp_size
        return kv_head * self.head_dim

    def _part_index(self, part: int | str | None) -> int:
        if part not in self._PARTS:
            raise ValueError(f"qkv shard id must be q, k or v, got {part!r}")
        return self._PARTS[part]


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns split across ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant: Fp8Scheme | None = None):
        super().__init__()
        self.quant = quant
        self.input_size = input_size
        self.local_input = input_shard(input_size, quant, "a row-parallel layer")
        self.weight, self.weight_scale = make_weight(output_size, self.local_input, quant)
        self.weight.weight_loader = self.load_weight
        if quant is not None:
            self.weight_scale.weight_loader = self.load_weight
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        self.lora: LoraWeights | None = None  # --enable-lora: this rank's input columns of A

    def checkpoint_shape(self, attr: str, part: None = None) -> tuple[int, ...] | None:
        """The full checkpoint tensor ``attr`` loads from; None for fp8 scales."""
        rows = self.weight.shape[0]
        return {"weight": (rows, self.input_size), "bias": (rows,)}.get(attr)

    def checkpoint_piece(self, attr: str, part: None, rows: int) -> Piece:
        """This rank's input columns of the weight's first ``rows`` rows (the bias: whole on
        every rank), in float32."""
        if attr == "bias":
            return self.bias.data[:rows].float(), None, 0, self.bias.shape[0]
        scale = None if self.weight_scale is None else self.weight_scale.data[:rows]
        start = get_tp_info().rank * self.local_input
        return float_weight(self.weight.data[:rows], scale, self.quant), 1, start, self.local_input

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, part: None = None) -> None:
        scale = None if self.weight_scale is None else self.weight_scale.data
        start = get_tp_info().rank * self.local_input
        load_column_shard(self.weight.data, scale, loaded, param is self.weight_scale, self.quant, start)

    @property
    def scales_across_ranks(self) -> bool:
        """Whether this layer's fp8 input is quantized with the whole row's scale (an all-reduced
        amax) rather than its own columns': at tp > 1 under --enable-fp32-all-reduce, per-token
        schemes only (a 128-column group never straddles two ranks)."""
        tp = get_tp_info()
        return self.quant is not None and self.quant.block is None and tp.size > 1 and tp.reduce_fp32

    @property
    def input_quant(self) -> Fp8Scheme | None:
        """The scheme the op producing this layer's input should quantize for; None where the
        input must arrive in floats (``scales_across_ranks``: this layer quantizes it)."""
        return None if self.scales_across_ranks else self.quant

    def _matmul(self, x: torch.Tensor | Fp8Act, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.quant is None:
            y = batch_invariant.linear(x, self.weight) if out_dtype is None else linear_fp32(x, self.weight)
            return y if self.lora is None else self.lora.add(x, y)
        act = x
        if isinstance(x, torch.Tensor) and self.scales_across_ranks:
            act = quantize_across_ranks(x.reshape(-1, x.shape[-1]))
        y = fp8_linear(act, self.weight, self.weight_scale, None, self.quant.block, out_dtype)
        return y if self.lora is None else self.lora.add(x, y, self.quant.block)

    def forward(self, x: torch.Tensor | Fp8Act, reduce: bool = True) -> torch.Tensor:
        """With ``reduce=False`` (no bias) this rank's partial sums, for a following
        ``RMSNorm(..., reduce=True)`` to all-reduce together with its residual add."""
        if not reduce:
            assert self.bias is None, "a bias is added after the all-reduce"
            return self._matmul(x)
        tp = get_tp_info()
        if tp.reduce_fp32 and tp.size > 1 and x.dtype in (torch.bfloat16, torch.float16) and x.data.is_cuda:
            # Partial sums in float32, rounded once after the sum as tp=1 rounds its one GEMM.
            y = all_reduce(self._matmul(x, torch.float32)).to(x.dtype)
        else:
            y = all_reduce(self._matmul(x))
        return y if self.bias is None else y + self.bias
