"""PiecewiseGraphRunner: prefill steps replayed from CUDA graphs of the pieces between each layer's mixing.

A prefill chunk of a small model is bound by the host's kernel launches: on the H100 an 8192-token
chunk of Qwen3-0.6B took 23-28 ms of host time to launch with FP8 linear layers (11-13 ms in
bf16) against ~17 ms of GPU work. A layer's mixing cannot be captured once for all steps: its
work follows the requests (attention's plan, a linear-attention layer's conv and chunked
recurrence over each request's state). Everything between two mixings depends only on the
number of tokens. So the forward is cut at the mixing (``DecoderModel.piece``), captured for a
ladder of token counts; a step pads its tokens to the next size on the padding slot (their K/V
land in the scratch page, and no row reads another outside the mixing), replays each piece and
runs the mixing eagerly between them over the real tokens only, on static buffers the model
names (``piece_buffers``). SGLang's piecewise CUDA graphs do the same through torch.compile; the
model's own split keeps this one plain.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

from minisgl.device.attention.context import set_attention_backend
from minisgl.device.distributed import get_tp_info
from minisgl.device.worker.cuda_graph import StepInputs, with_requests
from minisgl.device.worker.step_replay import StepReplay
from minisgl.utils import progress
from minisgl.wire.steps import ForwardBatch

if TYPE_CHECKING:
    from minisgl.device.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def token_sizes(max_tokens: int) -> list[int]:
    """The capture ladder: 16 to 1024 by doubling (small steps are host-bound: padding is cheap
    there), then steps of 1/8 of the power of two below, so padding adds at most 1/8 of a
    larger step's tokens; ``max_tokens`` itself last."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        size += size if size < 1024 else 1 << (size.bit_length() - 4)
    return sizes + [max_tokens]


class PiecewiseGraphRunner:
    def __init__(self, runner: ModelRunner, sizes: list[int], capture: bool = True):
        """Static buffers for ``max(sizes)`` tokens, and with ``capture`` (CUDA) the graphs of
        every piece at every size; without it the pieces run eagerly (the CPU tests' path)."""
        self.runner = runner
        self.model = runner.model.model
        self.sizes = sorted(set(sizes))
        self.max_tokens = self.sizes[-1]
        n, dev, dtype, hidden = self.max_tokens, runner.device, runner.dtype, runner.config.hidden_size
        self.inputs = StepInputs(n, dev)
        self.bufs = self.model.piece_buffers(n, dtype, dev)
        self.residual = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # (hybrids) a step's linear-attention mixing replayed from one layer's capture
        self.replay = StepReplay() if capture and runner.states is not None else None
        if capture:
            self._capture()

    def _size(self, tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, tokens)]

    def can_run(self, batch: ForwardBatch) -> bool:
        """A prefill step (some request has several new tokens, or a mixed step) that fits the
        largest size."""
        if batch.prefill_reqs:
            return sum(batch.new_lens) <= self.max_tokens
        return sum(batch.new_lens) <= self.max_tokens and max(batch.new_lens, default=1) > 1 and not batch.group_sizes

    def _padding(self, tokens: int) -> ForwardBatch:
        """``tokens`` tokens on the padding slot, as requests of at most a context each (the
        slot's page-table row, all scratch page, is a context long)."""
        lens = [min(self.runner.context_len, tokens - at) for at in range(0, tokens, self.runner.context_len)]
        n = len(lens)
        return ForwardBatch([self.runner.pad_slot] * n, [0] * n, lens, [0] * tokens, [False] * n)

    def _load(self, batch: ForwardBatch, tokens: int, size: int) -> None:
        """Inputs of the batch (``tokens`` new tokens) padded to ``size`` tokens into the static
        buffers; attention planned over the real requests."""
        padded = batch if size == tokens else with_requests(batch, self._padding(size - tokens))
        meta = self.inputs.load(self.runner, padded)
        real = dataclasses.replace(meta, slots=batch.slots, cached_lens=batch.cached_lens, new_lens=batch.new_lens)
        self.runner.attn.prepare(real)
        set_attention_backend(self.runner.attn)
        if self.runner.states is not None:  # (hybrids) over the real requests too
            self.runner.states.prepare(real, batch.state_loads, splits=batch.state_splits)

    def _piece(self, i: int, size: int) -> None:
        inputs = self.inputs
        self.model.piece(
            i,
            inputs.input_ids[:size],
            inputs.positions[:size],
            {name: buf[:size] for name, buf in self.bufs.items()},
            self.residual[:size],
            self.hidden[:size],
        )

    def _run(self, tokens: int, size: int, graphs: list[torch.cuda.CUDAGraph] | None) -> None:
        """Every piece (replayed, or run eagerly without ``graphs``) with each layer's mixing
        (attention, a linear-attention layer's recurrence) between them, over the first
        ``tokens`` rows."""
        cache, model = self.runner.kv_cache, self.model
        layers = model.num_pieces - 1
        replay = self.replay if graphs is not None else None
        if replay is not None:
            replay.new_step()
        for i in range(layers + 1):
            if graphs is None:
                self._piece(i, size)
            else:
                if i < layers and model.layers[i].kv_layer is not None:
                    cache.wait_layer(model.layers[i].kv_layer)  # host-tier copies (a no-op in capture)
                graphs[i].replay()
            if i < layers:
                model.mix(i, tokens, self.bufs, replay)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's new tokens (a view of a static buffer: valid
        until the next step)."""
        tokens = sum(batch.new_lens)
        size = self._size(tokens)
        self._load(batch, tokens, size)
        self._run(tokens, size, self.graphs.get(size))
        return self.hidden[:tokens]

    @torch.inference_mode()
    def _capture(self) -> None:
        start = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream()
        pieces = self.model.num_pieces
        for size in progress(
            sorted(self.sizes, reverse=True),
            get_tp_info().is_primary,
            desc="Capturing prefill CUDA graphs",
            unit="size",
        ):
            self._load(self._padding(size), size, size)  # tokens whose K/V go to the scratch page
            if self.runner.lora_rows is not None:  # pieces hold the adapter products (rows without one skip them)
                self.runner.lora_rows.active = True
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run(size, size, None)  # warm-up outside the graphs (lazy inits, first compiles)
            torch.cuda.current_stream().wait_stream(stream)
            graphs = []
            for i in range(pieces):
                graph = torch.cuda.CUDAGraph()
                # Pieces share one pool: none keeps a tensor of it alive (they write the static buffers).
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._piece(i, size)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[size] = graphs
        torch.cuda.synchronize()
        logger.info(
            "captured %d prefill CUDA graphs (%d pieces x %d sizes up to %d tokens) in %.1f s",
            pieces * len(self.sizes),
            pieces,
            len(self.sizes),
            self.max_tokens,
            time.perf_counter() - start,
        )
