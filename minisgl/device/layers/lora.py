"""LoRA adapters served beside the base weights, several in one batch (``--enable-lora``).

Every adapted linear layer keeps ``slots`` adapters of rank up to ``rank`` in two stacked
matrices: A [parts * slots * rank, in] (each fused part's A, e.g. q, k and v of qkv_proj) and B
[out, slots * rank] (each output row belongs to one part). A step's rows each name the slot of
their request's adapter (-1: none, the base model) in ``LoraRows``, a fixed buffer the decode
CUDA graphs and the piecewise prefill graphs read; a step none of whose rows uses an adapter
skips the adapters (``LoraRows.active``: eager steps, and decode graphs captured without them).
On the CPU (the reference) a layer computes
x A^T for every slot at once, zeroes the columns of the slots a row does not use, and adds each
part's product with B to that part's output columns: masked columns are exact zeros, so a row
gets exactly its own adapter's x A^T B^T (a smaller rank is zero-padded to ``rank``). On the GPU
``kernels.lora`` computes the same in two launches that multiply only the slots the rows use.
Which adapter sits in which slot is the scheduler's (``scheduler.lora``).

Under tensor parallelism a column-parallel layer holds the whole A and its rows of B; a
row-parallel layer holds its input columns of A and the whole B, so its product is a partial
sum that goes into the same all-reduce as the base layer's.
"""

from __future__ import annotations

import torch

from minisgl.device.layers.quantization import Fp8Act, dequantize

# Checkpoint module names an adapter may target, and the layer (with part) each lands in.
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}


def slot_rank(rank: int) -> int:
    """The rank a slot holds for adapters up to ``rank``: a power of two, at least 16 (the GPU
    kernels' smallest tile)."""
    return max(16, 1 << (rank - 1).bit_length())


class LoraRows:
    """Which adapter slot each row of the step uses: the rows' slots in a fixed buffer (CUDA
    graphs read it), and the columns of the stacked products each slot owns."""

    def __init__(self, rows: int, slots: int, rank: int, device: torch.device):
        self.slots, self.rank = slots, slot_rank(rank)
        self.buffer = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.current = self.buffer
        # On the GPU, the rows in the order of their slots (the kernels' tiles), and their slots.
        self.order_buffer = torch.zeros(rows, dtype=torch.int64, device=device)
        self.sorted_buffer = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.order, self.sorted = self.order_buffer, self.sorted_buffer
        self.column_slot = torch.arange(slots * self.rank, device=device) // self.rank
        # Whether any row of the step uses an adapter (from the host copy of the rows' slots):
        # when none does, layers skip the adapter products, and decode replays a graph without them.
        self.active = True

    def set(self, row_slots: torch.Tensor, active: bool = True) -> None:
        """The step's rows' slots (device int64, -1 for none; ``active``: whether any is not). A
        step longer than the buffer (an eager one only: graphs are captured within it) gets a
        tensor of its own."""
        self.active = active
        n = row_slots.shape[0]
        own = n > self.buffer.shape[0]
        self.current = row_slots if own else self.buffer
        if not own:
            self.buffer[:n].copy_(row_slots)
        if row_slots.is_cuda:  # the kernels' order (the CPU reference needs none)
            sorted_slots, order = torch.sort(row_slots, stable=True)
            self.order, self.sorted = (order, sorted_slots) if own else (self.order_buffer, self.sorted_buffer)
            if not own:
                self.order_buffer[:n].copy_(order)
                self.sorted_buffer[:n].copy_(sorted_slots)

    def mask(self, n: int, parts: int, dtype: torch.dtype) -> torch.Tensor:
        """[n, parts * slots * rank]: 1 where the column belongs to the row's adapter."""
        own = self.current[:n, None] == self.column_slot[None, :]
        return own.to(dtype).repeat(1, parts) if parts > 1 else own.to(dtype)


class LoraWeights:
    """The stacked adapters of one linear layer (see the module docstring)."""

    def __init__(
        self,
        rows: LoraRows,
        input_size: int,
        part_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.rows = rows
        self.part_sizes = part_sizes
        self.offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        width = rows.slots * rows.rank
        self.a = torch.zeros(len(part_sizes) * width, input_size, dtype=dtype, device=device)
        self.b = torch.zeros(sum(part_sizes), width, dtype=dtype, device=device)

    def add(self, x: torch.Tensor | Fp8Act, y: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """y + each row's adapter's x A^T B^T (y: the base layer's output for x, [T, out]); on
        the GPU in place, by ``kernels.lora`` (this is its reference). An fp8 layer's input that
        arrived quantized (scales per token, or per ``block`` columns) enters dequantized (on the
        GPU as the kernel loads it): the adapter reads what the base GEMM reads."""
        if not self.rows.active:
            return y
        if y.is_cuda:
            from minisgl.device.kernels.lora import lora_add

            data, scale = (x.data, x.scale) if isinstance(x, Fp8Act) else (x, None)
            x2, rows = data.reshape(-1, data.shape[-1]).contiguous(), self.rows
            n = x2.shape[0]
            return lora_add(
                x2, y, self.a, self.b, rows.order[:n], rows.sorted[:n], self.part_sizes, rows.rank, scale, block
            )
        if isinstance(x, Fp8Act):
            x = dequantize(x.data, x.scale, block).to(x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        parts = len(self.part_sizes)
        u = (x2 @ self.a.t()) * self.rows.mask(x2.shape[0], parts, x2.dtype)
        if parts == 1:
            return torch.addmm(y, u, self.b.t()) if y.dtype == u.dtype else y.add_(u @ self.b.t())
        width = self.b.shape[1]
        for p, (start, size) in enumerate(zip(self.offsets, self.part_sizes)):
            y[:, start : start + size].addmm_(u[:, p * width : (p + 1) * width], self.b[start : start + size].t())
        return y

    def clear(self, slot: int) -> None:
        """Zero one slot's columns (before an adapter is written into it)."""
        r, width = self.rows.rank, self.b.shape[1]
        for p in range(len(self.part_sizes)):
            self.a[p * width + slot * r : p * width + (slot + 1) * r].zero_()
        self.b[:, slot * r : (slot + 1) * r].zero_()

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """One part's adapter (this rank's share): a [r, in], b [part rows, r], scaling folded in."""
        r, width = a.shape[0], self.b.shape[1]
        at = part * width + slot * self.rows.rank
        self.a[at : at + r].copy_(a, non_blocking=True)  # (from pinned host memory on a GPU)
        start = self.offsets[part]
        self.b[start : start + b.shape[0], slot * self.rows.rank : slot * self.rows.rank + r].copy_(
            b, non_blocking=True
        )
