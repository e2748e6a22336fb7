"""Linear layers that shard over tensor-parallel ranks.

Column-parallel layers split their output features, row-parallel layers their input features
(and all-reduce the result). Each parameter carries a ``weight_loader`` that cuts the rank's
shard out of a full checkpoint tensor, so loading is the same code at any tp size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, get_tp_info
from minisgl.utils import divide


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T kept in the GEMM's float32 accumulator (CUDA half dtypes), not rounded to x's dtype."""
    out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
    return out.view(*x.shape[:-1], weight.shape[0])  # explicit sizes: zero-row batches happen


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows split across ranks; several checkpoint matrices may be fused.

    ``output_sizes`` lists the full (unsharded) sizes of the fused parts, e.g. [gate, up].
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__()
        tp = get_tp_info()
        self.local_sizes = [self._local_size(i, s, tp.size) for i, s in enumerate(output_sizes)]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(output_sizes))]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size), requires_grad=False)
        self.weight.weight_loader = self.load_shard
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False)
            self.bias.weight_loader = self.load_shard

    def _local_size(self, part: int, size: int, tp_size: int) -> int:
        return divide(size, tp_size)

    def _source_start(self, part: int, tp_rank: int) -> int:
        """Row in the full checkpoint tensor where this rank's shard of ``part`` starts."""
        return tp_rank * self.local_sizes[part]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, part: int | str | None = None) -> None:
        idx = self._part_index(part)
        size = self.local_sizes[idx]
        src = loaded.narrow(0, self._source_start(idx, get_tp_info().rank), size)
        param.data.narrow(0, self.offsets[idx], size).copy_(src)

    def _part_index(self, part: int | str | None) -> int:
        if part is None:
            if len(self.local_sizes) != 1:
                raise ValueError("a fused linear layer needs a shard id to load a part")
            return 0
        return int(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. KV heads are split across ranks, or replicated when tp > kv heads."""

    _PARTS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], bias)

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

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.local_input = divide(input_size, get_tp_info().size)
        self.weight = nn.Parameter(torch.empty(output_size, self.local_input), requires_grad=False)
        self.weight.weight_loader = self.load_weight
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, part: None = None) -> None:
        start = get_tp_info().rank * self.local_input
        param.data.copy_(loaded.narrow(1, start, self.local_input))

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """With ``reduce=False`` (no bias) this rank's partial sums, for a following
        ``RMSNorm(..., reduce=True)`` to all-reduce together with its residual add."""
        if not reduce:
            assert self.bias is None, "a bias is added after the all-reduce"
            return F.linear(x, self.weight)
        tp = get_tp_info()
        if tp.reduce_fp32 and tp.size > 1 and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            y = all_reduce(linear_fp32(x, self.weight)).to(x.dtype)
        else:
            y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
