"""StepReplay: one prefill step's mixing captured once and replayed for every layer of a kind.

Piecewise graphs replay everything between the layers' mixings, but a linear-attention layer's
mixing (the batched conv and FLA's chunked kernels, a dozen launches with host-side work in
each) follows the step's requests, so it ran eagerly 30 times a step: on the H200 that host time
set a hybrid model's time to first token. Within one step every linear layer runs the same
kernels on the same shapes and differs only in a few small tensors (its conv weight, gates, and
which layer of the state pool it reads). So the first layer of a step runs eagerly (compiling
and autotuning whatever is new), the second is captured into a CUDA graph over static copies of
those tensors, and it and every later layer copy their own tensors in and replay it. A step's
graph is dropped once the next step's is captured: the capture reuses its memory (the graphs
share one pool, and nothing a capture allocates outlives it), so no step allocates anew.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    static: list[torch.Tensor] | None = None  # the captured graph reads these
    graph: torch.cuda.CUDAGraph | None = None


class StepReplay:
    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()
        self.pool = torch.cuda.graph_pool_handle()  # one pool: a step's graph reuses the last one's memory
        self.entries: dict[str, _Entry] = {}
        self.previous: dict[str, _Entry] = {}  # the last step's, kept until this step's capture
        self.enabled = True

    def new_step(self) -> None:
        self.previous.update(self.entries)
        self.entries = {}

    def run(self, kind: str, tensors: list[torch.Tensor], fn: Callable[[list[torch.Tensor]], None]) -> None:
        """``fn(tensors)`` for this layer: eagerly for the step's first layer of ``kind``,
        otherwise by replaying the graph captured at its second one. ``fn`` must write its
        results into static buffers and read nothing per layer but ``tensors``."""
        entry = self.entries.get(kind)
        if entry is None or not self.enabled:
            fn(tensors)
            self.entries[kind] = _Entry()
            return
        if entry.graph is None:
            if not self._capture(entry, tensors, fn):
                return fn(tensors)
            self.previous.pop(kind, None)
        else:
            for static, t in zip(entry.static, tensors):
                static.copy_(t, non_blocking=True)
        entry.graph.replay()

    def _capture(self, entry: _Entry, tensors: list[torch.Tensor], fn: Callable[[list[torch.Tensor]], None]) -> bool:
        entry.static = [t.clone() for t in tensors]
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(self.stream):
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    fn(entry.static)
                finally:
                    graph.capture_end()
        except RuntimeError as e:  # (a kernel that cannot be captured: run eagerly from now on)
            logger.warning("prefill mixing cannot be replayed from a CUDA graph, running it eagerly: %s", e)
            self.enabled = False
            return False
        torch.cuda.current_stream().wait_stream(self.stream)
        entry.graph = graph
        return True
