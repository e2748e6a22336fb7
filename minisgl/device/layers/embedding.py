"""Vocabulary-parallel token embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.device import batch_invariant
from minisgl.device.distributed import all_gather_last_dim, all_reduce, argmax_over_ranks, get_tp_info
from minisgl.device.layers.linear import Piece, linear_fp32
from minisgl.device.layers.quantization import dequantize, fp8_logits, quantize_weight
from minisgl.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        tp = get_tp_info()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.shard = cdiv(vocab_size, tp.size)
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.load_weight

    def checkpoint_shape(self, attr: str, part: None = None) -> tuple[int, ...]:
        """The full checkpoint tensor: every vocabulary row."""
        return self.vocab_size, self.hidden_size

    def checkpoint_piece(self, attr: str, part: None, rows: int) -> Piece:
        """This rank's vocabulary rows (at most ``rows``), in float32; the padding rows past the
        vocabulary are not counted."""
        return self.weight.data[:rows].float(), 0, self.start, self._real_rows()

    def _real_rows(self) -> int:
        return max(0, min(self.shard, self.vocab_size - self.start))

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, part: None = None) -> None:
        rows = loaded[self.start : self.start + self.shard]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_info().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits over the full vocabulary (gathered across ranks).

    On CUDA in bf16/fp16 the GEMM writes float32 logits straight from its accumulator: rounded
    to bf16, logits near 20 are spaced 0.125 apart, so close candidates tie exactly and greedy
    picks between them by index, flipping with any change of summation order upstream.

    ``quantize`` turns the head fp8 (``--quantize-lm-head``): rows scaled one by one, so each
    rank's slice quantizes as the whole would; logits stay float32."""

    qweight: torch.Tensor | None = None
    qscale: torch.Tensor | None = None

    def quantize(self, keep_float: bool, rows_per_pass: int = 8192) -> None:
        """Hold the head in fp8 with one scale per vocabulary row; the float weight is freed
        unless the embedding shares it or updates will come (``keep_float``). Again after new
        weights: into the same tensors, which CUDA graphs read."""
        w = self.weight.data
        parts = [quantize_weight(w[i : i + rows_per_pass], None) for i in range(0, w.shape[0], rows_per_pass)]
        qweight, qscale = torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
        if self.qweight is None:
            self.qweight, self.qscale = qweight, qscale
        else:
            self.qweight.copy_(qweight)
            self.qscale.copy_(qscale)
        if not keep_float:
            del self.weight

    def checkpoint_piece(self, attr: str, part: None, rows: int) -> Piece:
        """As the embedding's; an fp8 head whose float weight was freed gives its fp8 rows
        dequantized."""
        if hasattr(self, "weight"):
            return super().checkpoint_piece(attr, part, rows)
        return dequantize(self.qweight[:rows], self.qscale[:rows]), 0, self.start, self._real_rows()

    def forward(self, hidden: torch.Tensor, gather: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, vocab]; with ``gather=False`` this rank's slice [N, shard], for ``gather``
        or ``greedy`` later (a greedy step at tp>1 then never moves the whole rows). ``out``
        (with ``gather=False``): where to write the slice, as a CUDA graph's fixed output buffer
        (the bf16 head's GEMM writes there itself: at 256 rows the 8B's copy of 131 MB took 85 us of
        a 10.8 ms decode step)."""
        if out is not None and gather:
            raise ValueError("out= takes this rank's slice (gather=False)")
        if self.qweight is not None:
            logits = fp8_logits(hidden, self.qweight, self.qscale)
        elif hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
            logits = linear_fp32(hidden, self.weight, out)
        else:
            logits = batch_invariant.linear(hidden, self.weight)
        if out is not None and logits.data_ptr() != out.data_ptr():
            logits = out.copy_(logits)
        return self.gather(logits) if gather else logits

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of ``forward(gather=False)`` joined into [N, vocab]."""
        return all_gather_last_dim(local)[..., : self.vocab_size]

    def greedy(self, local: torch.Tensor) -> torch.Tensor:
        """argmax over the whole vocabulary of ``forward(gather=False)``'s slices: token ids [N]."""
        return argmax_over_ranks(local, self.start, min(self.shard, self.vocab_size - self.start))
