"""Tensor-parallel rank information and collectives.

Every parallel layer asks here for its rank and world size, so a single process (tp=1) and a
multi-GPU run share the same model code; the collectives are no-ops at tp=1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    # Row-parallel partial sums all-reduced in float32, rounded once to the model's dtype as at
    # tp=1 (--enable-fp32-all-reduce): tp=2 then matches tp=1's greedy tokens far more often.
    reduce_fp32: bool = False

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_TP = TPInfo()


def set_tp_info(rank: int, size: int, reduce_fp32: bool = False) -> None:
    global _TP
    _TP = TPInfo(rank, size, reduce_fp32)


def get_tp_info() -> TPInfo:
    return _TP


class OneShotAllReduce:
    """All-reduce of small tensors through symmetric memory: each rank copies its part into a
    buffer its peers can read over NVLink, and one kernel sums every rank's buffer (torch's
    ``symm_mem.one_shot_all_reduce_copy``; no NVLink multicast). A decode step at tp=2 issues
    two all-reduces per layer of a few hundred KB, where NCCL's ring costs ~20 us each in
    latency; tensors past ``max_bytes`` (prefill) go to NCCL, whose bandwidth then matters more.
    The buffer is allocated once, so the kernel is captured in CUDA graphs like any other."""

    DTYPES = (torch.float32, torch.bfloat16)  # what the kernel dispatches on

    def __init__(self, device: torch.device, max_bytes: int = 4 << 20):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.dtype in self.DTYPES and nbytes <= self.max_bytes and nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        staging = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x.contiguous(), "sum", self.group_name)


_ONE_SHOT: OneShotAllReduce | None = None


def init_one_shot_all_reduce(device: torch.device) -> None:
    """Use the one-shot all-reduce for small tensors where the GPUs can map each other's memory;
    otherwise every all-reduce stays with NCCL (logged, not fatal)."""
    global _ONE_SHOT
    try:
        _ONE_SHOT = OneShotAllReduce(device)
    except Exception as e:  # no P2P between the GPUs, or a torch built without symmetric memory
        logger.warning("one-shot all-reduce unavailable (%s: %s); using NCCL for every all-reduce",
                       type(e).__name__, e)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel ranks; the result may be a new tensor, so use the return."""
    if _TP.size == 1:
        return x
    if _ONE_SHOT is not None and _ONE_SHOT.fits(x):
        return _ONE_SHOT(x)
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (vocab-parallel logits)."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
