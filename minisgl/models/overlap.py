"""Two micro-batches between attentions, so that tensor parallelism's all-reduces run behind
GEMMs (``--enable-two-batch-overlap``).

Under tensor parallelism every layer all-reduces twice (after o_proj and after down_proj, each
fused with the next RMSNorm), and nothing of the same rows can run while a sum travels: at tp=4
on the 8B shape those waits are a quarter of a decode step. Everything from one attention to the
next (o_proj, all-reduce + norm, the MLP, all-reduce + norm, the qkv projection and the K/V store)
treats each token row on its own, so the step's rows split in two halves A and B: the
all-reduces go to a second CUDA stream, in the same order on every rank, while the main stream
computes the other half::

    main:  o(A)  o(B)        mlp(A)        mlp(B)        qkv(A)   qkv(B)
    side:        sum1(A)     sum1(B)       sum2(A)       sum2(B)

Attention runs on the whole batch as before (one plan per step, cascade groups untouched).
Without CUDA (the CPU tests) the same schedule runs on one stream, in the order above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from minisgl.layers.norm import RMSNorm
    from minisgl.models.llama import DecoderLayer

# Below this many rows a half's GEMMs are too short to hide a sum behind, and each half's
# kernels launch costs more than the overlap saves.
MIN_ROWS = 32


class TwoBatchOverlap:
    def __init__(self, min_rows: int = MIN_ROWS):
        import os  # EXPERIMENT

        self.min_rows = int(os.environ.get("MINISGL_TBO_MIN_ROWS", min_rows))
        self._side: torch.cuda.Stream | None = None

    def takes(self, rows: int) -> bool:
        return rows >= self.min_rows

    def _reduce(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[Any, torch.cuda.Event | None]:
        """``norm(x, residual, reduce=True)`` on the side stream, after the main stream's work so
        far; returns its result and the event the main stream waits on before reading it."""
        if not x.is_cuda:
            return norm(x, residual, True), None
        main = torch.cuda.current_stream()
        if self._side is None:
            self._side = torch.cuda.Stream()
            import os  # EXPERIMENT

            if os.environ.get("MINISGL_SM_CARVEOUT"):
                torch._C._set_sm_carveout_experimental(int(os.environ["MINISGL_SM_CARVEOUT"]))
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            result = norm(x, residual, True)
        done = torch.cuda.Event()
        done.record(self._side)
        return result, done

    def __call__(
        self,
        layer: DecoderLayer,
        nxt: DecoderLayer | None,
        final_norm: RMSNorm,
        attn: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``DecoderModel.after_attention`` in two halves; the residual stream is updated in place."""
        rows = attn.shape[0]
        half = (rows // 2 + 7) // 8 * 8  # GEMM-friendly row counts
        halves = (slice(0, half), slice(half, rows))
        if out is None:
            out = torch.empty_like(attn) if nxt is not None else residual.new_empty(residual.shape)
        # Tensors one stream hands the other stay referenced until the main stream has waited
        # for the side stream's last sum: the allocator could otherwise give their memory to a
        # kernel that runs while the other stream still reads it.
        keep: list[Any] = []
        first = []
        for r in halves:
            y = layer.self_attn.o_proj(attn[r].flatten(1), False)
            keep.append(y)
            first.append(self._reduce(layer.post_attention_layernorm, y, residual[r]))
        second = []
        norm: Callable = nxt.input_layernorm if nxt is not None else final_norm
        for (x, res), done in first:
            _wait(done)
            m = layer.mlp(x, False)
            keep.append(m)
            second.append(self._reduce(norm, m, res))
        for r, ((x, res), done) in zip(halves, second):
            _wait(done)
            if res.data_ptr() != residual[r].data_ptr():  # the torch norms return a new tensor
                residual[r].copy_(res)
            if nxt is not None:
                nxt.self_attn.project(x, positions, out[r], r)
            else:
                out[r].copy_(x)
        keep.clear()
        return out, residual


def _wait(done: torch.cuda.Event | None) -> None:
    if done is not None:
        torch.cuda.current_stream().wait_event(done)
