"""Tensor-parallel rank information and collectives.

Every parallel layer asks here for its rank and world size, so a single process (tp=1) and a
multi-GPU run share the same model code; the collectives are no-ops at tp=1.

A row-parallel layer's partial sums are followed in every decoder layer by a residual add and an
RMSNorm; ``all_reduce_add_rmsnorm`` does the three at once, in one FlashInfer kernel on GPUs for
decode-sized batches (``FusedAllReduceNorm``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minisgl.device.kernels.fused import add_rmsnorm

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


class FusedAllReduceNorm:
    """All-reduce, residual add and RMSNorm in one kernel (FlashInfer's port of TensorRT-LLM's
    one-shot Lamport all-reduce): each rank pushes its partial sums straight into its peers'
    buffers, whose "not yet written" marker (-0.0) the readers poll, so no barrier round trip
    precedes the sum, and the norm runs on the summed rows where they land. At tp=2 on H200s it
    replaces an all-reduce of ~10.5 us and a fused add-norm of ~2.6 us per call (two per layer;
    ``benchmarks/tp_check.py step``). Only 16-bit tensors of up to ``max_tokens`` rows: prefill
    goes to NCCL, whose bandwidth matters more there."""

    def __init__(self, max_tokens: int, hidden: int):
        from flashinfer.comm import trtllm_create_ipc_workspace_for_all_reduce_fusion

        self.max_tokens, self.hidden = max_tokens, hidden
        # (peer pointers, the device table of them the kernel reads, metadata); the first keeps
        # the symmetric buffers alive.
        self._ipc, self.workspace, self.metadata = trtllm_create_ipc_workspace_for_all_reduce_fusion(
            _TP.rank, _TP.size, max_tokens, hidden, create_metadata=True
        )
        # Build the kernel now (JIT, once per machine), and fail here, where the caller falls
        # back, on shapes it refuses; every rank makes this call, as the kernel needs.
        x = torch.zeros(1, hidden, dtype=torch.bfloat16, device="cuda")
        self(x, x.clone(), torch.ones(hidden, dtype=torch.bfloat16, device="cuda"), 1e-6)
        torch.cuda.synchronize()

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and x.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16)
            and 0 < x.shape[0] <= self.max_tokens
            and x.shape[1] == self.hidden
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from flashinfer.comm import AllReduceFusionPattern, trtllm_allreduce_fusion

        out = torch.empty_like(x)
        trtllm_allreduce_fusion(
            allreduce_in=x.view(-1),
            world_size=_TP.size,
            world_rank=_TP.rank,
            token_num=x.shape[0],
            hidden_dim=self.hidden,
            workspace_ptrs=self.workspace,
            launch_with_pdl=False,
            trigger_completion_at_end=True,
            fp32_acc=False,
            pattern_code=AllReduceFusionPattern.kARResidualRMSNorm,
            use_oneshot=True,
            allreduce_out=None,
            residual_in=residual.view(-1),
            residual_out=residual.view(-1),
            norm_out=out.view(-1),
            quant_out=None,
            scale_out=None,
            rms_gamma=weight,
            rms_eps=eps,
            scale_factor=None,
            layout_code=None,
        )
        return out, residual


_ONE_SHOT: OneShotAllReduce | None = None
_FUSED_NORM: FusedAllReduceNorm | None = None


def init_one_shot_all_reduce(device: torch.device) -> None:
    """Use the one-shot all-reduce for small tensors where the GPUs can map each other's memory;
    otherwise every all-reduce stays with NCCL (logged, not fatal)."""
    global _ONE_SHOT
    try:
        _ONE_SHOT = OneShotAllReduce(device)
    except Exception as e:  # no P2P between the GPUs, or a torch built without symmetric memory
        logger.warning("one-shot all-reduce unavailable (%s: %s); using NCCL for every all-reduce", type(e).__name__, e)


def init_fused_all_reduce_norm(max_tokens: int, hidden: int) -> None:
    """Use the fused all-reduce + add + RMSNorm kernel for up to ``max_tokens`` rows, where
    FlashInfer's communication module builds and the GPUs can map each other's memory; otherwise
    those steps all-reduce, then add and norm (logged, not fatal). Call with the rank's GPU current."""
    global _FUSED_NORM
    start = time.perf_counter()
    try:
        _FUSED_NORM = FusedAllReduceNorm(max_tokens, hidden)
        # Built once per machine (FlashInfer's JIT cache keeps it); a cold build takes minutes.
        if _TP.is_primary:
            logger.info("fused all-reduce + RMSNorm ready in %.1f s", time.perf_counter() - start)
    except Exception as e:  # no FlashInfer, no P2P, or its kernels do not build here
        logger.warning(
            "fused all-reduce + RMSNorm unavailable (%s: %s); all-reducing before each norm", type(e).__name__, e
        )


def all_reduce_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rmsnorm`` of the sum of every rank's ``x`` (a row-parallel layer's partial sums):
    (rmsnorm(sum + residual), sum + residual). Inputs may be updated in place."""
    if _FUSED_NORM is not None and _FUSED_NORM.fits(x):
        return _FUSED_NORM(x, residual, weight, eps)
    return add_rmsnorm(all_reduce(x), residual, weight, eps)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel ranks; the result may be a new tensor, so use the return."""
    if _TP.size == 1:
        return x
    if _ONE_SHOT is not None and _ONE_SHOT.fits(x):
        return _ONE_SHOT(x)
    dist.all_reduce(x)
    return x


def stack_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x``, stacked [tp, *x.shape]: each rank writes its row of a zeroed table and
    the table is summed (exact: each entry has one nonzero term), so the one-shot all-reduce
    serves it as it serves sums."""
    table = x.new_zeros(_TP.size, *x.shape)
    table[_TP.rank] = x
    return all_reduce(table)


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over the ranks (amaxes of activations)."""
    return x if _TP.size == 1 else stack_over_ranks(x).amax(dim=0)


def argmax_over_ranks(local: torch.Tensor, start: int, valid: int) -> torch.Tensor:
    """Greedy token ids [N] of vocab-parallel logits (this rank's ``local`` [N, shard] holds ids
    ``start`` onward, its first ``valid`` columns real) without gathering them: each rank's
    best (value, id) travels instead of its [N, shard] float32 slice, ~16 MB per rank for a
    batch of 64 on a 128K vocabulary (0.1 ms of a 5 ms step at tp=2). Ties go to the lowest id,
    as ``argmax`` over the whole row breaks them."""
    if valid > 0:
        values, ids = local[:, :valid].float().max(dim=-1)
    else:  # a tiny vocabulary leaves this rank only padding
        values = local.new_full((local.shape[0],), float("-inf"), dtype=torch.float32)
        ids = torch.zeros_like(values, dtype=torch.int64)
    if _TP.size == 1:
        return ids + start if start else ids
    # Each rank's best values and ids, stacked (ids travel as float32: exact below 2**24).
    table = stack_over_ranks(torch.stack([values, (ids + start).float()]))
    best = table[:, 0].argmax(dim=0, keepdim=True)  # the first (lowest) rank on a tie
    return table[:, 1].gather(0, best).squeeze(0).long()


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (vocab-parallel logits)."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
