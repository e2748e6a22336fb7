"""CudaGraphRunner: decode steps replayed from CUDA graphs captured once at start-up.

A decode step of an 8B model is ~1,000 small kernel launches; replaying a graph costs one.
Graphs are captured for a ladder of batch sizes up to ``max_bs``; a batch is padded to the next
captured size with dummy requests that live in the runner's padding slot (its page-table row
points at a scratch page, so their K/V writes land nowhere that matters). Inputs go through
static buffers; the attention backend plans each step into per-size buffers outside the graph.
Unless cascade attention or the radix cache is off, each size also has a cascade graph (two-level attention over
cascade groups, see ``ForwardBatch``), replayed for steps that carry groups. With LoRA on, every
graph also has a twin captured without the adapter products, replayed for steps none of whose
rows uses an adapter (so base-model traffic on a LoRA server pays no adapter kernels).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import msgspec
import torch

from minisgl.device.attention.base import AttentionMetadata, graph_groups
from minisgl.device.attention.context import set_attention_backend
from minisgl.device.distributed import get_tp_info
from minisgl.utils import progress
from minisgl.wire.steps import ForwardBatch

if TYPE_CHECKING:
    from minisgl.device.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def batch_sizes(max_bs: int) -> list[int]:
    """The capture ladder: 1, 2, 4, 8, then steps of 16 up to 512 and of about 1/16 of the size
    beyond (a power of two), so padding adds at most 1/16 of a large batch's rows while a ladder
    to 4096 stays under 90 sizes."""
    sizes, size = [1, 2, 4, 8], 16
    while size < max_bs:
        sizes.append(size)
        size += max(16, 1 << (size.bit_length() - 5))
    return [s for s in sizes if s < max_bs] + [max_bs]


def with_requests(batch: ForwardBatch, extra: ForwardBatch) -> ForwardBatch:
    """``batch`` with ``extra``'s requests after its own (the padding of a captured size)."""
    return msgspec.structs.replace(
        batch,
        slots=batch.slots + extra.slots,
        cached_lens=batch.cached_lens + extra.cached_lens,
        new_lens=batch.new_lens + extra.new_lens,
        input_ids=batch.input_ids + extra.input_ids,
        sample=batch.sample + extra.sample,
    )


class StepInputs:
    """The fixed buffers a captured step reads its token ids, positions and KV slots from."""

    def __init__(self, tokens: int, device: torch.device):
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.out_loc = torch.zeros(tokens, dtype=torch.int64, device=device)

    def load(self, runner: ModelRunner, batch: ForwardBatch) -> AttentionMetadata:
        """The batch's metadata (``ModelRunner._metadata``), its token ids, positions and KV slots
        copied into the buffers, which the metadata then points at."""
        meta, input_ids = runner._metadata(batch)
        n = len(input_ids)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(meta.positions)
        self.out_loc[:n].copy_(meta.out_loc)
        meta.positions, meta.out_loc = self.positions[:n], self.out_loc[:n]
        return meta


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_bs: int):
        self.runner = runner
        self.sizes = batch_sizes(max_bs)
        self.max_bs = max_bs
        self.inputs = StepInputs(max_bs, runner.device)
        # Groups come from the radix tree: without it no step carries any.
        self.cascade = not (runner.args.disable_cascade_attention or runner.args.disable_radix_cache)
        self.lora_rows = runner.lora_rows
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}  # by (size, cascade, lora)
        self.loaded_lora = False  # whether the loaded step uses an adapter (its graph's third key)
        # Every graph writes its logits here: one buffer for all sizes. (Each graph keeping its
        # own output held size x vocab float32 per graph: 27 GB for a ladder to 1024 at a
        # 128k vocabulary, out of memory on the H100. The price is one more [size, vocab] copy.)
        self.logits: torch.Tensor | None = None
        # The model's last hidden states, kept for requests that return them (one buffer too).
        self.keep_hidden = runner.args.enable_return_hidden_states
        self.hidden: torch.Tensor | None = None
        runner.attn.init_cuda_graph(max_bs, runner.page_table_host.shape[1])
        if runner.states is not None:  # (hybrids) the state pool's slots, read in place by the graphs
            runner.states.init_cuda_graph(max_bs)
        self._capture()

    def _pad(self, batch: ForwardBatch, size: int) -> ForwardBatch:
        n = size - len(batch.slots)
        if n == 0:
            return batch
        return with_requests(batch, ForwardBatch([self.runner.pad_slot] * n, [0] * n, [1] * n, [0] * n, [False] * n))

    def _load(self, batch: ForwardBatch) -> None:
        """Copy the padded batch's inputs into the static buffers and plan attention."""
        meta = self.inputs.load(self.runner, batch)
        self.runner.attn.prepare(meta, graph_batch_size=len(batch.slots))
        set_attention_backend(self.runner.attn)
        if self.runner.states is not None:
            self.runner.states.prepare(meta, batch.state_loads, graph=True)

    def _run_model(self, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
        model = self.runner.model
        inputs = self.inputs
        hidden = model(inputs.input_ids[:size], inputs.positions[:size])
        if self.keep_hidden:
            if self.hidden is None:  # the largest size comes first
                self.hidden = torch.empty_like(hidden)
            self.hidden[:size].copy_(hidden)
        return model.compute_logits(hidden, gather=False, out=out)

    def _capture_batch(self, size: int, cascade: bool) -> ForwardBatch:
        """A padding batch that plans what the graph must hold: for cascade, as many groups as
        the size has room for, each sharing one (scratch) page, covering every row."""
        batch = self._pad(ForwardBatch([], [], [], [], []), size)
        if not cascade:
            return batch
        groups = graph_groups(size)
        sizes = [2] * (groups - 1) + [size - 2 * (groups - 1)]
        page = self.runner.page_size
        return msgspec.structs.replace(batch, cached_lens=[page] * size, group_sizes=sizes, group_pages=[1] * groups)

    @torch.inference_mode()
    def _capture(self) -> None:
        start = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream()
        loras = (True, False) if self.lora_rows is not None else (False,)
        keys = [
            (s, c, lora)
            for s in sorted(self.sizes, reverse=True)
            for c in (False, True)
            if not c or self._fits(s)
            for lora in loras
        ]
        for size, cascade, lora in progress(keys, get_tp_info().is_primary, desc="Capturing CUDA graphs", unit="graph"):
            self._load(self._capture_batch(size, cascade))
            if self.lora_rows is not None:
                self.lora_rows.active = lora
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                warm = self._run_model(size)  # warm-up outside the graph (lazy inits, autotuning)
            torch.cuda.current_stream().wait_stream(stream)
            if self.logits is None:  # the largest size comes first
                self.logits = torch.empty_like(warm)
            del warm
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._run_model(size, out=self.logits[:size])  # the head writes the fixed buffer itself
            pool = graph.pool()
            self.graphs[size, cascade, lora] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (batch sizes up to %d%s) in %.1f s",
            len(keys),
            self.max_bs,
            (", plain and cascade" if self.cascade else "") + (", with and without LoRA" if len(loras) > 1 else ""),
            time.perf_counter() - start,
        )

    def _fits(self, size: int, groups: int = 1) -> bool:
        """Whether the cascade graph of this size exists and has room for ``groups`` groups."""
        return self.cascade and 1 <= groups <= graph_groups(size)

    def _size(self, batch: ForwardBatch) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, len(batch.slots))]

    def can_run(self, batch: ForwardBatch) -> bool:
        if len(batch.slots) > self.max_bs or max(batch.new_lens, default=1) != 1 or batch.prefill_reqs:
            return False
        return not batch.group_sizes or self._fits(self._size(batch), len(batch.group_sizes))

    def load(self, batch: ForwardBatch) -> None:
        """The batch's inputs into the buffers of the graph of the next size up and its attention
        planned (``replay`` runs it)."""
        self._load(self._pad(batch, self._size(batch)))
        self.loaded_lora = self.lora_rows is not None and self.lora_rows.active

    def set_input_ids(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Input ids of some rows of the loaded batch (device int64), set after ``load``."""
        self.inputs.input_ids[rows] = ids

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the loaded batch's sampling requests (this rank's vocabulary slice)."""
        self.graphs[self._size(batch), bool(batch.group_sizes), self.loaded_lora].replay()
        logits = self.logits[: len(batch.slots)]
        if all(batch.sample):
            return logits
        # int64 even when empty: a one-token prefill chunk that samples nothing has no rows.
        rows = [i for i, s in enumerate(batch.sample) if s]
        return logits[torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)]
