"""StatePool: the recurrent state of every Gated DeltaNet layer, one row per request slot.

A hybrid model's linear-attention layers keep no KV per token: after token t a request's state
is, per layer, the causal conv's last ``kernel - 1`` inputs and a [heads, k_dim, v_dim] matrix.
The pool holds both for every page-table slot (the slot a request runs in, as the KV page
table has), so a step reads and writes its requests' rows in place, and after them the rows of
the prefix cache's snapshots (the state after a cached prefix: the scheduler's tree names them).
A request whose step starts from nothing (``cached_len`` 0) starts from zeros, one that starts
from a cached prefix from a copy of its snapshot; chunked prefill and decode steps carry the row
over. The runner installs the pool and prepares it once a step (``prepare``), as it does the
attention backend, and the layers fetch it with ``get_state_pool``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from minisgl.checkpoint.model_config import ModelConfig
from minisgl.device.distributed import get_tp_info
from minisgl.utils import divide

if TYPE_CHECKING:
    from minisgl.device.attention.base import AttentionMetadata

FLA_CHUNK = 64  # the token chunks of flash-linear-attention's chunked kernels


@dataclass
class StateShape:
    """One rank's share of a layer's state: conv channels (q, k and v heads) and DeltaNet heads."""

    layers: int
    conv_channels: int
    conv_width: int  # the conv kernel's width minus one: the inputs it keeps
    heads: int
    k_dim: int
    v_dim: int

    @classmethod
    def of(cls, config: ModelConfig) -> StateShape:
        """One rank's state of every linear layer of ``config`` (heads split across ranks)."""
        tp = get_tp_info().size
        hk, hv = divide(config.linear_num_key_heads, tp), divide(config.linear_num_value_heads, tp)
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        return cls(len(config.linear_layers), 2 * hk * dk + hv * dv, config.linear_conv_kernel_dim - 1, hv, dk, dv)

    def bytes_per_slot(self, ssm_dtype: torch.dtype, conv_dtype: torch.dtype) -> int:
        conv = self.conv_channels * self.conv_width * conv_dtype.itemsize
        ssm = self.heads * self.k_dim * self.v_dim * ssm_dtype.itemsize
        return self.layers * (conv + ssm)


class StatePool:
    def __init__(
        self, shape: StateShape, slots: int, ssm_dtype: torch.dtype, conv_dtype: torch.dtype, device: torch.device
    ):
        self.shape = shape
        s = shape
        self.conv = torch.zeros(s.layers, slots, s.conv_channels, s.conv_width, dtype=conv_dtype, device=device)
        self.ssm = torch.zeros(s.layers, slots, s.heads, s.k_dim, s.v_dim, dtype=ssm_dtype, device=device)
        # each layer's first row in the pool flattened over layers (``StepReplay``'s graphs address it so)
        self.layer_base = torch.arange(s.layers, device=device) * slots
        # per request, two for one that saves a snapshot part-way: (slot, first token row, tokens,
        # the row its state after them is copied to or -1)
        self.segments: list[tuple[int, int, int, int]] = []
        self.slots = torch.zeros(0, dtype=torch.int64, device=device)  # each segment's slot
        self.prefill: PrefillIndex | None = None  # (a step that is not all decode rows)
        self.decode = False
        self.graph_slots: torch.Tensor | None = None  # (CUDA graphs) the buffer the captured steps read

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    def copy(self, pairs: list[int]) -> None:
        """Copy row ``pairs[2i]`` into row ``pairs[2i + 1]`` (snapshots in and out of requests)."""
        if pairs:
            index = torch.tensor(pairs, dtype=torch.int64).view(-1, 2).to(self.conv.device, non_blocking=True)
            self.conv[:, index[:, 1]] = self.conv[:, index[:, 0]]
            self.ssm[:, index[:, 1]] = self.ssm[:, index[:, 0]]

    def init_cuda_graph(self, max_bs: int) -> None:
        self.graph_slots = torch.zeros(max_bs, dtype=torch.int64, device=self.conv.device)

    def prepare(self, meta: AttentionMetadata, loads: list[int], graph: bool = False, splits: list[int] = ()) -> None:
        """The step's requests: their slots and where their tokens sit; the rows of those that
        start from nothing are zeroed (a slot's last owner left its state there), those that
        start from a cached prefix get its snapshot (``loads``: snapshot, slot pairs). ``splits``:
        (slot, snapshot, tokens) triples, a request whose state after its chunk's first tokens
        is saved part-way: its chunk runs as two segments in turn. With ``graph`` the slots go
        into the buffer captured decode steps read."""
        cut = {splits[i]: (splits[i + 1], splits[i + 2]) for i in range(0, len(splits), 3)}
        segments, row = [], 0
        for slot, n in zip(meta.slots, meta.new_lens):
            save, head = cut.get(slot, (-1, n))
            segments.append((slot, row, head, save))
            if head < n:
                segments.append((slot, row + head, n - head, -1))
            row += n
        self.segments = segments
        self.decode = all(n == 1 for n in meta.new_lens)
        seg_slots = np.array([s[0] for s in segments], dtype=np.int64)
        self.prefill = None
        if graph:  # (straight into the captured buffer: one copy)
            self.slots = self.graph_slots[: len(seg_slots)]
            self.slots.copy_(torch.from_numpy(seg_slots), non_blocking=True)
        elif self.decode:
            self.slots = torch.from_numpy(seg_slots).to(self.conv.device, non_blocking=True)
        else:
            self.slots, self.prefill = self._prefill_index(meta, segments, seg_slots, cut)
        set_state_pool(self)
        fresh = [s for s, c in zip(meta.slots, meta.cached_lens) if c == 0]
        if fresh:  # (built on the host and sent without waiting: no sync with the step before)
            index = torch.tensor(fresh, dtype=torch.int64).to(self.conv.device, non_blocking=True)
            self.conv[:, index] = 0
            self.ssm[:, index] = 0
        self.copy(loads)

    def _prefill_index(
        self, meta: AttentionMetadata, segments: list[tuple[int, int, int, int]], seg_slots: np.ndarray, cut: dict
    ) -> tuple[torch.Tensor, PrefillIndex]:
        """The segments' slots and the step's ``PrefillIndex`` (with its ``Splits`` when some
        request saves a snapshot part-way): built on the host and sent in one copy."""
        offsets = np.array([s[1] for s in segments] + [sum(meta.new_lens)], dtype=np.int64)
        points = [(slot, i, n) for i, (slot, n) in enumerate(zip(meta.slots, meta.new_lens))]
        points += [(save, meta.slots.index(slot), head) for slot, (save, head) in cut.items()]
        parts = {
            "slots": seg_slots, "req_slots": np.asarray(meta.slots, dtype=np.int64),
            **conv_index(np.asarray(meta.new_lens, dtype=np.int64), self.shape.conv_width, points),
            "cu_seqlens": offsets, "chunk_indices": chunk_indices(np.diff(offsets)),
        }  # fmt: skip
        split = split_parts(segments) if cut else {}
        arrays = [*parts.values(), *split.values()]
        # (one copy to the device for all: eager hybrid prefill steps are host-bound)
        flat = torch.from_numpy(np.concatenate([x.reshape(-1) for x in arrays])).to(self.conv.device, non_blocking=True)
        sent = [t.view(x.shape) for t, x in zip(flat.split([x.size for x in arrays]), arrays)]
        index = dict(zip(parts, sent))
        splits = Splits(**dict(zip(split, sent[len(parts) :]))) if cut else None
        return index.pop("slots"), PrefillIndex(**index, splits=splits)


def chunk_indices(lens: np.ndarray, chunk: int = FLA_CHUNK) -> np.ndarray:
    """FLA's varlen chunk indices of sequences of ``lens`` tokens: a (sequence, chunk within it)
    row per chunk of ``chunk`` tokens. Made on the host: FLA would make them from the device
    lengths, reading their sum back (a sync each step)."""
    counts = -(-lens // chunk)
    seq = np.repeat(np.arange(len(lens), dtype=np.int64), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([seq, np.arange(len(seq), dtype=np.int64) - first], axis=1)


def conv_index(lens: np.ndarray, width: int, points: list[tuple[int, int, int]]) -> dict[str, np.ndarray]:
    """The causal conv's fields of ``PrefillIndex`` for requests of ``lens`` new tokens (rows in
    order); ``points``: (pool row, request, tokens) - the state after a request's first tokens
    goes to that row. The torch conv lays each request out as its ``width`` state inputs then
    its tokens; the Triton one reads tokens and states where they are."""
    n_req = len(lens)
    padded = lens + width
    starts = np.cumsum(padded) - padded  # each request's first row in the padded layout
    req = np.repeat(np.arange(n_req, dtype=np.int64), padded)
    i = np.arange(int(padded.sum()), dtype=np.int64) - starts[req]
    token_start = np.cumsum(lens) - lens
    order = np.where(i < width, req * width + i, n_req * width + token_start[req] + i - width)
    outputs = np.repeat(starts, lens) + np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(token_start, lens)
    dst, point_req, point_len = (np.array([p[i] for p in points], dtype=np.int64) for i in range(3))
    ends = starts[point_req] + point_len  # (a state's first padded row)
    return {
        "order": order, "outputs": outputs, "state_rows": ends[:, None] + np.arange(width, dtype=np.int64),
        "state_dst": dst, "point_req": point_req, "point_len": point_len,
        "token_req": np.repeat(np.arange(n_req, dtype=np.int64), lens), "req_start": token_start,
    }  # fmt: skip


def split_parts(segments: list[tuple[int, int, int, int]]) -> dict[str, np.ndarray]:
    """The fields of ``Splits`` for the step's segments, on the host."""
    heads = [i for i, s in enumerate(segments) if s[3] >= 0]
    tails = {i + 1 for i in heads}
    finals = [i for i in range(len(segments)) if i not in tails and segments[i][3] < 0]
    tokens, offsets = [], [0]
    for i in heads:
        _, start, n, _ = segments[i + 1]
        tokens += range(start, start + n)
        offsets.append(offsets[-1] + n)
    lists = {
        "heads": heads, "save_rows": [segments[i][3] for i in heads], "finals": finals,
        "final_slots": [segments[i][0] for i in finals], "tail_slots": [segments[i][0] for i in heads],
        "tokens": tokens, "cu_seqlens": offsets,
    }  # fmt: skip
    parts = {name: np.array(values, dtype=np.int64) for name, values in lists.items()}
    return {**parts, "chunk_indices": chunk_indices(np.diff(parts["cu_seqlens"]))}


@dataclass
class Splits:
    """A step's segments for the chunked kernel when some requests save a snapshot part-way
    (``StatePool.prepare``): it runs every segment from its slot's state, then the second
    segments again from the first ones' final states. Indices are into the segment list,
    ``tokens`` the second segments' token rows."""

    heads: torch.Tensor  # the first segment of each split request
    save_rows: torch.Tensor  # the snapshot row its final state goes to
    finals: torch.Tensor  # segments whose final state is their slot's: unsplit ones
    final_slots: torch.Tensor
    tail_slots: torch.Tensor  # the split requests' slots (their second segments' final state)
    tokens: torch.Tensor
    cu_seqlens: torch.Tensor  # the second segments' offsets in ``tokens``
    chunk_indices: torch.Tensor  # FLA's, of the second segments


@dataclass
class PrefillIndex:
    """Where a prefill step's tokens and states sit (``StatePool._prefill_index``): for the
    batched causal conv (``gated_delta.varlen_conv``) and FLA's varlen kernels."""

    req_slots: torch.Tensor  # each request's slot: its conv inputs come first
    order: torch.Tensor  # rows of cat(the requests' conv inputs, the tokens) in padded order
    outputs: torch.Tensor  # the conv's output columns that are the tokens'
    state_rows: torch.Tensor  # [points, width] padded rows whose inputs are a state ...
    state_dst: torch.Tensor  # ... and the pool rows they go to
    point_req: torch.Tensor  # (the same points for the Triton conv: each one's request ...
    point_len: torch.Tensor  # ... and its tokens before the point)
    token_req: torch.Tensor  # each token's request
    req_start: torch.Tensor  # each request's first token row
    cu_seqlens: torch.Tensor  # the segments' token offsets
    chunk_indices: torch.Tensor  # FLA's, of the segments
    splits: Splits | None  # (requests saving a snapshot part-way)


_pool: weakref.ref[StatePool] | None = None


def set_state_pool(pool: StatePool | None) -> None:
    global _pool
    _pool = None if pool is None else weakref.ref(pool)


def get_state_pool() -> StatePool:
    pool = _pool() if _pool is not None else None
    if pool is None:
        raise RuntimeError("no state pool installed; run the hybrid model through ModelRunner")
    return pool


def make_state_pool(
    config: ModelConfig, slots: int, ssm_dtype: torch.dtype, dtype: torch.dtype, device: torch.device
) -> StatePool | None:
    """The pool of a hybrid model (None for the others), ``slots`` rows (requests' slots, then
    snapshots): conv inputs in the model's dtype, the DeltaNet matrices in ``ssm_dtype``."""
    if not config.is_hybrid:
        return None
    return StatePool(StateShape.of(config), slots, ssm_dtype, dtype, device)
