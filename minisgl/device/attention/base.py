"""The attention backend interface and the per-step metadata every backend consumes."""

from __future__ import annotations

import copy
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

from minisgl.device.kernels.rope_store import rope_store
from minisgl.device.kvcache.mha_pool import BaseKVCache
from minisgl.wire.steps import MAX_CASCADE_GROUPS

# Steps of at most this many rows build their host-side inputs, page lists and kernel work lists
# in Python, larger ones in numpy: at a few rows numpy's microseconds a call outweigh the work.
FEW_ROWS = 32


def graph_groups(batch_size: int) -> int:
    """How many cascade groups the CUDA graph of a batch size has room for."""
    return min(batch_size // 2, MAX_CASCADE_GROUPS)


@dataclass
class Gains:
    """Rows planned shorter than they may turn out: row ``rows[i]`` was planned at its shortest
    and is ``tokens[i]`` (on the device, not yet known to the host) <= ``most[i]`` tokens longer.
    A step planned while a verify run it follows is still on the device uses them: the rows that
    run rejected are only known there."""

    rows: np.ndarray  # int64, indices into the step's requests
    most: np.ndarray  # int64
    tokens: torch.Tensor  # int64, on the device
    rows_on_device: torch.Tensor  # ``rows``, uploaded once for every use


@dataclass
class AttentionMetadata:
    """What one forward step attends over, built once per step by the model runner.

    Request i owns row ``slots[i]`` of ``page_table_host``; it has ``cached_lens[i]`` tokens already
    in the cache and computes ``new_lens[i]`` new ones this step. New tokens appear in
    request order in q/k/v; ``out_loc`` holds their cache slot ids. ``group_sizes`` and
    ``group_pages`` describe a cascade decode step (see ``ForwardBatch``); empty otherwise.
    A mixed step (``prefill_reqs`` > 0) is prefill rows, then decode rows that the groups cover:
    ``split`` gives each part, whose attention runs apart.
    """

    slots: list[int]
    cached_lens: list[int]
    new_lens: list[int]
    # [max_slots, max_pages_per_req] int32 page ids, on the host: backends cut each step's page
    # lists here and copy them up, rather than keep a device copy and run kernels to cut it.
    page_table_host: np.ndarray
    positions: torch.Tensor  # [T] int64
    out_loc: torch.Tensor  # [T] int64
    group_sizes: list[int] = field(default_factory=list)
    group_pages: list[int] = field(default_factory=list)
    prefill_reqs: int = 0
    gains: Gains | None = None  # (decode steps on a backend that ``plans_gains``)

    @property
    def num_reqs(self) -> int:
        return len(self.slots)

    @property
    def is_decode(self) -> bool:
        return not self.prefill_reqs and max(self.new_lens, default=1) == 1

    def split(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """A mixed step's prefill part (no groups) and its decode part (the groups)."""
        n = self.prefill_reqs
        tokens = sum(self.new_lens[:n])
        end = tokens + len(self.slots) - n  # (piecewise graphs pad the token tensors past it)
        head = AttentionMetadata(
            self.slots[:n],
            self.cached_lens[:n],
            self.new_lens[:n],
            self.page_table_host,
            self.positions[:tokens],
            self.out_loc[:tokens],
        )
        tail = AttentionMetadata(
            self.slots[n:],
            self.cached_lens[n:],
            self.new_lens[n:],
            self.page_table_host,
            self.positions[tokens:end],
            self.out_loc[tokens:end],
            self.group_sizes,
            self.group_pages,
        )
        return head, tail

    @functools.cached_property
    def seq_lens(self) -> np.ndarray:
        """Each request's length after the step (numpy: steps carry thousands of requests)."""
        return np.asarray(self.cached_lens, dtype=np.int64) + np.asarray(self.new_lens, dtype=np.int64)

    @property
    def cascade(self) -> bool:
        return bool(self.group_sizes)

    def skip_pages(self, group_pages: list[int] | None = None) -> np.ndarray:
        """Per request, the leading pages its group reads at the shared level (0 outside groups):
        ``group_pages`` of each group, or all its shared ones."""
        pages = self.group_pages if group_pages is None else group_pages
        skip = np.zeros(self.num_reqs, dtype=np.int64)
        skip[: sum(self.group_sizes)] = np.repeat(np.asarray(pages, dtype=np.int64), self.group_sizes)
        return skip


class AttentionBackend(ABC):
    """Writes the step's new K/V into the paged cache and attends over cached + new tokens."""

    def __init__(self, kv_cache: BaseKVCache, num_qo_heads: int, num_kv_heads: int, head_dim: int):
        self.kv_cache = kv_cache
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.meta: AttentionMetadata | None = None  # what ``attend`` runs: the step, or a mixed step's prefill part
        self.out_loc: torch.Tensor | None = None  # the KV slots of all the step's new tokens
        self.tail: AttentionBackend | None = None  # a mixed step's decode part

    supports_cuda_graph = False

    def prepare(self, meta: AttentionMetadata, graph_batch_size: int | None = None) -> None:
        """Called once per step before any layer runs (plans are shared by all layers).
        ``graph_batch_size``: the step replays the CUDA graph captured for that many requests.

        A mixed step's decode rows attend as a decode step would (cascade groups included): read
        as prefill rows, each re-read its shared prefix, which cost the 8B shared-prefix workload
        more than the decode steps the mixing saved."""
        self.tail, self.out_loc = None, meta.out_loc
        if not meta.prefill_reqs:
            self.plan(meta, graph_batch_size)
            return
        head, tail = meta.split()
        self.plan(head)
        self.tail = self.decode_part()
        self.tail.plan(tail)

    def plan(self, meta: AttentionMetadata, graph_batch_size: int | None = None) -> None:
        """Plan a step of one kind (``prepare`` says what)."""
        self.meta = meta

    def plans_gains(self, cascade: bool) -> bool:
        """Whether a decode step (with cascade groups or not) may carry ``Gains``: rows whose
        lengths grow on the device after the host planned them."""
        return False

    def decode_part(self) -> AttentionBackend:
        """The backend a mixed step's decode rows attend with: a shallow copy (same cache and
        kernels, its own plan). Backends whose two plans would share state override it."""
        return copy.copy(self)

    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        """Allocate the fixed buffers that captured decode graphs read their plans from."""
        raise NotImplementedError(f"{type(self).__name__} cannot run inside CUDA graphs")

    def rope_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        layer_id: int,
        cos_sin: torch.Tensor,
        norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """From a layer's qkv projection [T, (Hq + 2 Hk) * D]: per-head q/k norm (``norm``),
        rotary, K/V written to the new tokens' slots. Returns q [T, Hq, D] for ``forward``
        (``out`` if given)."""
        self.kv_cache.wait_layer(layer_id)  # host-tier copies into (or out of) this layer's pages
        return rope_store(
            qkv,
            self.num_qo_heads,
            positions,
            cos_sin,
            self.kv_cache.k_cache(layer_id),
            self.kv_cache.v_cache(layer_id),
            self.out_loc,
            norm,
            self.kv_cache.scales[layer_id],
            out,
        )

    def forward(self, q: torch.Tensor, layer_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D] of the new tokens, whose K/V ``rope_store`` has written; returns [T, Hq, D]
        (``out`` if given: piecewise CUDA graphs read it from a fixed buffer)."""
        if self.tail is None:
            return self.attend(q, layer_id, out)
        head = sum(self.meta.new_lens)
        end = head + self.tail.meta.num_reqs
        out = torch.empty_like(q) if out is None else out
        self.attend(q[:head], layer_id, out[:head])
        self.tail.attend(q[head:end], layer_id, out[head:end])
        return out

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` for a step of one kind."""
