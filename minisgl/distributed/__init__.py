"""Tensor-parallel rank information and collectives.

Every parallel layer asks here for its rank and world size, so a single process (tp=1) and a
multi-GPU run share the same model code; the collectives are no-ops at tp=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_TP = TPInfo()


def set_tp_info(rank: int, size: int) -> None:
    global _TP
    _TP = TPInfo(rank, size)


def get_tp_info() -> TPInfo:
    return _TP


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (vocab-parallel logits)."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
